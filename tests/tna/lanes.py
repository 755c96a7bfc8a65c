"""Where a DATA's lanes go in the Tofino program, run on paper: the generated parser states
of every pass (p4src/generated/thc_tna_parse.p4, thc_tna_eg_parse.p4), a vote DATA's spread
in pass 0, the egress's doubling of a 16-bit job's next block, the words' lookups with the
controller's entries, and the deparsers' order (rest, then cur, then res; egress: its
doubled block in front of what it did not parse). The words add each worker's lookup
values as 32-bit words into a quarter of their registers a pass: summing the workers'
result payloads as 32-bit words is what the registers hold after the last worker.

The pass count, quarter and width come from the program's own statements (set_job,
thc_next's entries, the words' register size), read as text; nothing here needs a
compiler. tests/test_tna_lanes.py and tests/test_tna_vote.py drive it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from thc.controller.targets import tofino

P4SRC = Path(__file__).resolve().parents[2] / "p4src"
GEN = P4SRC / "generated"
FIELDS = {"idx": (31, 0), "w": (31, 0), "hi": (31, 16), "lo": (15, 0)}
"""Each header here is one 32-bit word; where its fields sit in it."""
REF = r"hdr\.(\w+)\[(\d+)\]\.(\w+)(?:\[(\d+):(\d+)\])?"
EMIT = ("rest", "cur", "res")
"""The ingress deparser's order of the lane headers (the struct's)."""


@lru_cache(maxsize=None)
def _text(name: str) -> str:
    return (GEN / name).read_text()


@lru_cache(maxsize=None)
def state(name: str, file: str = "thc_tna_parse.p4") -> list[tuple[str, int]]:
    """The headers a parser state extracts, in packet order."""
    body = re.search(rf"state {name} \{{(.*?)\n    \}}", _text(file), re.S).group(1)
    return [(m[1], int(m[2])) for m in re.finditer(r"pkt\.extract\(hdr\.(\w+)\[(\d+)\]\)", body)]


@lru_cache(maxsize=None)
def lane_states() -> dict[tuple[int, int], str]:
    """parse_lanes's choice for a DATA: (wide, adding passes before) -> state."""
    return {(int(m[1]), int(m[2])): m[3] for m in re.finditer(
        r"\(THC_PAY_IDX, (\d), (\d)\): (\w+);", _text("thc_tna_parse.p4"))}


@lru_cache(maxsize=None)
def actions(file: str, prefix: str) -> list[list[tuple]]:
    """The statements of the actions named prefix_<n>, in order: ('valid', header) or
    ('set', dst, hi, lo, src, hi, lo) with absolute bit positions in the 32-bit headers."""
    out = []
    for body in re.findall(rf"action {prefix}_\d+\(\) \{{(.*?)\n    \}}", _text(file), re.S):
        stmts = []
        for line in body.strip().splitlines():
            if m := re.fullmatch(rf"\s*{REF} = {REF};", line):
                d, s = _bits_of(*m.groups()[:5]), _bits_of(*m.groups()[5:])
                stmts.append(("set", d[0], d[1], d[2], s[0], s[1], s[2]))
            elif m := re.fullmatch(r"\s*hdr\.(\w+)\[(\d+)\]\.setValid\(\);", line):
                stmts.append(("valid", (m[1], int(m[2]))))
            else:
                raise AssertionError(f"unexpected statement in {prefix}: {line!r}")
        out.append(stmts)
    return out


def _bits_of(stack, i, name, hi, lo):
    fhi, flo = FIELDS[name]
    if hi is None:
        return (stack, int(i)), fhi, flo
    return (stack, int(i)), flo + int(hi), flo + int(lo)


@lru_cache(maxsize=None)
def lookups() -> list[tuple[int, int, int, int, int, int]]:
    """Each lookup table: (word, h, index header, key hi, key lo, result hi)."""
    out = []
    for m in re.finditer(r"hdr\.res\[(\d+)\]\.w\[(\d+):\d+\] = value;.*?"
                         r"table thc_w(\d+)_lut_(\d).*?hdr\.cur\[(\d+)\]\.idx\[(\d+):(\d+)\]",
                         _text("thc_tna_luts.p4"), re.S):
        assert m[1] == str(int(m[3])), "word NN's lookups write result word NN"
        out.append((int(m[1]), int(m[4]), int(m[5]), int(m[6]), int(m[7]), int(m[2])))
    return out


@lru_cache(maxsize=None)
def _program(text: str | None = None) -> str:
    """The program's text: the file's, or a (broken) copy's."""
    return text or (P4SRC / "thc_tna.p4").read_text()


@lru_cache(maxsize=None)
def _constant(name: str) -> int:
    text = "".join((GEN / f).read_text() for f in ("thc_constants.p4", "thc_tna_constants.p4"))
    return int(re.search(rf"#define {name} (\d+)", text)[1])


@lru_cache(maxsize=None)
def call_order(control: str, prefix: str, text: str | None = None) -> list[int]:
    """The order in which ``control``'s apply block calls the actions prefix_<n>."""
    body = _program(text).split(f"control {control}(", 1)[1]
    body = body[body.index("\n    apply {"):]
    return [int(n) for n in re.findall(rf"\b{prefix}_(\d+)\(\);", body)]


@lru_cache(maxsize=None)
def egress_state(recirc: int, is_reply: int, wide: int, payload: str,
                 text: str | None = None) -> str:
    """Where the egress parser goes after the bridge header: its select's first match."""
    start = _program(text).split("parser ThcEgressParser(", 1)[1]
    cases = re.search(r"transition select\(hdr\.bridge\.recirc, hdr\.bridge\.is_reply, "
                      r"hdr\.bridge\.wide,\s*hdr\.bridge\.payload\) \{(.*?)\}", start, re.S)
    assert cases, "the egress parser's select changed"
    for m in re.finditer(r"\(([^)]*)\): (\w+);|default: (\w+);", cases.group(1)):
        if m[3]:
            return m[3]
        cells = [c.strip() for c in m[1].split(",")]
        if all(c == "_" or c == v for c, v in zip(cells, (str(recirc), str(is_reply),
                                                          str(wide), payload))):
            return m[2]
    raise AssertionError("the egress parser's select has no default")


@lru_cache(maxsize=None)
def pass_rules(text: str | None = None) -> tuple[int, dict[tuple[int, int], tuple[int, int]],
                                                 int]:
    """What the program's own statements say: set_job's shift for the job's width, the pass
    round's entries ((wide, step) -> (last, next step), thc_next), and how many quarters
    the words' registers hold. The pass round sets the step into the word index's bits
    above a slot version's (the index is the slot's low bits and the version: THC_REG_SIZE
    values, below those bits)."""
    text = _program(text)
    index = re.search(r"thc_word_hash\.get\(\{meta\.slot_idx\[(\d+):0\], "
                      r"hdr\.thc\.version\[0:0\]\}\)", text)
    assert index and 1 << int(index[1]) + 2 == _constant("THC_REG_SIZE") == 1 << 10, \
        "the words' index of a slot version must take THC_REG_SIZE values, bits 9:0"
    wide = re.search(r"meta\.bridge\.wide = meta\.wide;", text)
    shift = re.search(r"meta\.wide = \(bit<1>\)\(sum_bits >> (\d+)\);", text)
    again = re.search(r"action thc_go_round_again\(bit<1> last, bit<2> step\) \{(.*?)\n    \}",
                      text, re.S).group(1)
    quarter = re.search(r"meta\.p1\.word_index\[11:10\] = step;", again)
    nxt = re.search(r"table thc_next \{(.*?)\n    \}", text, re.S).group(1)
    rounds = {(int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for m in re.finditer(
        r"\((\d), (\d)\): thc_go_round_again\((\d), (\d)\);", nxt)}
    size = re.search(r"Register<bit<32>, thc_index_t>\(THC_REG_SIZE \* (\d+)\) thc_sum;", text)
    assert wide and shift and quarter and rounds and size, "set_job, the pass round or thc_sum changed"
    return int(shift[1]), rounds, int(size[1])


def _get(v: int, hi: int, lo: int) -> int:
    return v >> lo & ((1 << (hi - lo + 1)) - 1)


def _put(v: int, hi: int, lo: int, x: int) -> int:
    mask = ((1 << (hi - lo + 1)) - 1) << lo
    return v & ~mask | x << lo & mask


def run(phv: dict, valid: set, stmts: list[tuple], before: dict | None = None) -> None:
    """One action: sources read from ``before`` (the stage's start, as the hardware does)
    or, without it, as P4 reads them (in order)."""
    for st in stmts:
        if st[0] == "valid":
            valid.add(st[1])
            continue
        _, dst, dhi, dlo, src, shi, slo = st
        if dst not in valid:
            continue                # P4: a write to a field of an invalid header does nothing
        phv[dst] = _put(phv[dst], dhi, dlo, _get((before or phv)[src], shi, slo))


def _extract(data: bytes, headers, phv: dict, valid: set) -> bytes:
    for k, h in enumerate(headers):
        phv[h] = int.from_bytes(data[4 * k:4 * k + 4], "big")
        valid.add(h)
    return data[4 * len(headers):]


def _emit(phv: dict, valid: set, order) -> bytes:
    return b"".join(phv[h].to_bytes(4, "big") for h in order if h in valid)


def _garbage(rng, stacks) -> dict:
    keys = [(s, i) for s, n in stacks for i in range(n)]
    return dict(zip(keys, rng.integers(0, 1 << 32, len(keys)).tolist()))


@dataclass
class Walk:
    """A packet through the adding passes: each pass's parser state and quarter, and the
    payload the last pass sends (without registers: one worker's lookup values)."""
    passes: list[str] = field(default_factory=list)      # the parser state of each pass
    quarters: list[int] = field(default_factory=list)
    payload: bytes = b""


@dataclass
class Bridge:
    """What pass 0 decided for the adding passes (thc_pass_h)."""
    payload: str = "THC_PAY_IDX"
    wide: int = 0
    last: int = 0
    lane_op: int | None = None        # None: no registers (a worker's lookup values alone)
    is_max: int = 0
    blank: int = 0
    word_index: int = 0
    lut: bool = True                  # lut_job names the job: the lookups hit


WORD_RAS = {
    "thc_sum_ra": ("if (op == THC_OP_WRITE) { value = r.w; } else { value = value + r.w; } "
                   "rv = value;"),
    "thc_read": "rv = value;",
    "thc_clear": "value = 0; rv = value;",
    "thc_max": "if (op == THC_OP_WRITE || r.w > value) { value = r.w; } rv = value;",
}
"""What each RegisterAction of a word does, as THC_WORD writes it (checked against its
text: Words)."""


class Words:
    """The word registers of the adding passes, one 32-bit cell a word and index, each pass
    applying thc_word_op's const entries (run, op, is_max, blank) -> RegisterAction."""

    def __init__(self, consts: dict[str, int], text: str | None = None):
        self.text = text
        macro = _program(text).split("#define THC_WORD(", 1)[1]
        macro = macro.split("#undef THC_WORD", 1)[0]
        text = " ".join(line.rstrip("\\").strip() for line in macro.splitlines())
        for ra, body in WORD_RAS.items():
            want = re.sub(r"\s+", " ", body)
            got = re.search(rf"\) {ra} = {{ void apply\(inout bit<32> value, out bit<32> rv\) "
                            rf"{{ (.*?) }} }};", re.sub(r"\s+", " ", text))
            assert got and got[1] == want, f"THC_WORD's {ra} is not {want!r}: {got and got[1]}"
        acts = {m[1]: m[2] for m in re.finditer(
            r"action (thc_word_\w+)\(\) \{ r\.w = (\w+)\.execute\(index\); \}", text)}
        self.entries = {}
        for m in re.finditer(r"\((\d), (THC_OP_\w+), (\d), (\d)\): (thc_word_\w+)\(\);", text):
            key = (int(m[1]), consts[m[2]], int(m[3]), int(m[4]))
            self.entries[key] = acts[m[5]]
        self.write = consts["THC_OP_WRITE"]
        self.cells: dict[tuple[int, int], int] = {}

    def apply(self, word: int, index: int, op: int, is_max: int, blank: int, r: int):
        """The word's RegisterAction for this pass (None: NoAction), its output."""
        ra = self.entries.get((1, op, is_max, blank))
        if ra is None:
            return None
        value = self.cells.get((word, index), 0)
        if ra == "thc_sum_ra":
            value = r if op == self.write else (value + r) & 0xFFFFFFFF
        elif ra == "thc_clear":
            value = 0
        elif ra == "thc_max" and (op == self.write or r > value):
            value = r
        self.cells[(word, index)] = value
        return value


def passes(job, br: Bridge, data: bytes, rng, words: Words | None = None,
           parallel: bool = True) -> Walk:
    """A packet of ``job`` through pass 0's parser (and a vote DATA's spread), the egress
    between passes and every adding pass, with the words' registers if given; undefined
    bits start random. ``data``: the DATA's indices or sign bits, a MAX's lanes, or none."""
    text = words.text if words is not None else None
    shift, rounds, quarters = pass_rules(text)
    stacks = (("rest", _constant("THC_TNA_REST_OCTS")), ("cur", _constant("THC_TNA_OCTS")),
              ("res", _constant("THC_TNA_WORDS")))
    order = [(s, i) for s, n in stacks for i in range(n)]
    phv, valid = _garbage(rng, stacks), set()
    if br.payload == "THC_PAY_IDX":
        vote = job.aggregation == "vote"
        rest = _extract(data, state("parse_signs" if vote else "parse_idx"), phv, valid)
        assert rest == b"", "pass 0 parses the whole DATA"
        if vote:
            spread = actions("thc_tna_spread.p4", "thc_spread")
            for n in call_order("ThcIngress", "thc_spread", text):
                run(phv, valid, spread[n], dict(phv) if parallel else None)
        packet = _emit(phv, valid, order)
    else:
        packet = data if br.payload == "THC_PAY_MAX" else b""
    assert br.wide == job.sum_bits >> shift & 1
    wide, step, last = br.wide, 0, br.last
    values = [tofino.lut_values(job, h) for h in range(2)]
    out = Walk()
    while True:
        # the egress of the pass before: a packet going round, its lanes' blocks next
        if egress_state(1, 0, wide, br.payload, text) == "parse_dup":
            n = _constant("THC_TNA_OCTS")
            eg_phv, eg_valid = _garbage(rng, (("dd", n),)), set()
            after = _extract(packet, state("parse_dup_octs", "thc_tna_eg_parse.p4"),
                             eg_phv, eg_valid)
            dup = actions("thc_tna_dup.p4", "thc_dup")
            for k in call_order("ThcEgress", "thc_dup", text):
                run(eg_phv, eg_valid, dup[k], dict(eg_phv) if parallel else None)
            packet = _emit(eg_phv, eg_valid, [("dd", i) for i in range(n)]) + after
        name = {"THC_PAY_IDX": lane_states().get((wide, step)),
                "THC_PAY_MAX": "parse_max"}.get(br.payload)
        out.passes.append(name)
        out.quarters.append(step)
        phv, valid = _garbage(rng, stacks), set()
        behind = _extract(packet, state(name), phv, valid) if name else packet
        if br.lut:
            for word, h, octet, hi, lo, res_hi in lookups():
                value = values[h][_get(phv[("cur", octet)], hi, lo)]
                phv[("res", word)] = _put(phv[("res", word)], res_hi, res_hi - 15, value)
        if words is not None:
            index = br.word_index & ~(3 << 10) | step << 10
            for j in range(_constant("THC_TNA_WORDS")):
                rv = words.apply(j, index, br.lane_op, br.is_max, br.blank, phv[("res", j)])
                if rv is not None:
                    phv[("res", j)] = rv
        valid -= {("cur", i) for i in range(_constant("THC_TNA_OCTS"))}
        if br.payload != "THC_PAY_MAX":
            valid |= {("res", i) for i in range(_constant("THC_TNA_WORDS"))}
        packet = _emit(phv, valid, order) + behind
        if last:
            out.payload = packet
            return out
        assert (wide, step) in rounds, f"no pass round after step {step} (wide {wide})"
        last, step = rounds[(wide, step)]
        assert step < quarters, "a pass beyond the words' registers"


def walk(job, data: bytes, rng, parallel: bool = True) -> Walk:
    """One worker's DATA of ``job`` (indices, or a vote DATA's sign bits) through the
    passes: its lookup values where the sums go."""
    wide = job.sum_bits >> pass_rules()[0] & 1
    return passes(job, Bridge(wide=wide), data, rng, parallel=parallel)
