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
from pathlib import Path

from thc.controller.targets import tofino

P4SRC = Path(__file__).resolve().parents[2] / "p4src"
GEN = P4SRC / "generated"
FIELDS = {"idx": (31, 0), "w": (31, 0), "hi": (31, 16), "lo": (15, 0)}
"""Each header here is one 32-bit word; where its fields sit in it."""
REF = r"hdr\.(\w+)\[(\d+)\]\.(\w+)(?:\[(\d+):(\d+)\])?"
EMIT = ("rest", "cur", "res")
"""The ingress deparser's order of the lane headers (the struct's)."""


def _text(name: str) -> str:
    return (GEN / name).read_text()


def state(name: str, file: str = "thc_tna_parse.p4") -> list[tuple[str, int]]:
    """The headers a parser state extracts, in packet order."""
    body = re.search(rf"state {name} \{{(.*?)\n    \}}", _text(file), re.S).group(1)
    return [(m[1], int(m[2])) for m in re.finditer(r"pkt\.extract\(hdr\.(\w+)\[(\d+)\]\)", body)]


def lane_states() -> dict[tuple[int, int], str]:
    """parse_lanes's choice for a DATA: (wide, adding passes before) -> state."""
    return {(int(m[1]), int(m[2])): m[3] for m in re.finditer(
        r"\(THC_PAY_IDX, (\d), (\d)\): (\w+);", _text("thc_tna_parse.p4"))}


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


def lookups() -> list[tuple[int, int, int, int, int, int]]:
    """Each lookup table: (word, h, index header, key hi, key lo, result hi)."""
    out = []
    for m in re.finditer(r"hdr\.res\[(\d+)\]\.w\[(\d+):\d+\] = value;.*?"
                         r"table thc_w(\d+)_lut_(\d).*?hdr\.cur\[(\d+)\]\.idx\[(\d+):(\d+)\]",
                         _text("thc_tna_luts.p4"), re.S):
        assert m[1] == str(int(m[3])), "word NN's lookups write result word NN"
        out.append((int(m[1]), int(m[4]), int(m[5]), int(m[6]), int(m[7]), int(m[2])))
    return out


def _program() -> str:
    return (P4SRC / "thc_tna.p4").read_text()


def _constant(name: str) -> int:
    text = "".join((GEN / f).read_text() for f in ("thc_constants.p4", "thc_tna_constants.p4"))
    return int(re.search(rf"#define {name} (\d+)", text)[1])


def call_order(control: str, prefix: str) -> list[int]:
    """The order in which ``control``'s apply block calls the actions prefix_<n>."""
    body = _program().split(f"control {control}(", 1)[1]
    body = body[body.index("\n    apply {"):]
    return [int(n) for n in re.findall(rf"\b{prefix}_(\d+)\(\);", body)]


def egress_state(recirc: int, is_reply: int, wide: int, payload: str) -> str:
    """Where the egress parser goes after the bridge header: its select's first match."""
    start = _program().split("parser ThcEgressParser(", 1)[1]
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


def pass_rules() -> tuple[int, dict[tuple[int, int], tuple[int, int]], int]:
    """What the program's own statements say: set_job's shift for the job's width, the pass
    round's entries ((wide, step) -> (last, next step), thc_next), and how many quarters
    the words' registers hold. The pass round sets the step into the word index's bits
    above a slot version's (the index is the slot's low bits and the version: THC_REG_SIZE
    values, below those bits)."""
    text = _program()
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
    return {(s, i): int(rng.integers(0, 1 << 32)) for s, n in stacks for i in range(n)}


@dataclass
class Walk:
    """One worker's DATA through the passes: each pass's quarter and result words."""
    passes: list[str] = field(default_factory=list)      # the parser state of each pass
    quarters: list[int] = field(default_factory=list)
    payload: bytes = b""                                  # the RESULT payload, this worker's part


def walk(job, data: bytes, rng, parallel: bool = True) -> Walk:
    """A DATA payload of ``job`` (indices, or a vote DATA's sign bits) through pass 0, the
    egress between passes and every adding pass; undefined bits start random."""
    shift, rounds, quarters = pass_rules()
    stacks = (("rest", _constant("THC_TNA_REST_OCTS")), ("cur", _constant("THC_TNA_OCTS")),
              ("res", _constant("THC_TNA_WORDS")))
    order = [(s, i) for s, n in stacks for i in range(n)]
    phv, valid = _garbage(rng, stacks), set()
    vote = job.aggregation == "vote"
    rest = _extract(data, state("parse_signs" if vote else "parse_idx"), phv, valid)
    assert rest == b"", "pass 0 parses the whole DATA"
    if vote:
        spread = actions("thc_tna_spread.p4", "thc_spread")
        for n in call_order("ThcIngress", "thc_spread"):
            run(phv, valid, spread[n], dict(phv) if parallel else None)
    packet = _emit(phv, valid, order)
    wide = job.sum_bits >> shift & 1
    step, last = 0, 0                                     # pass 0's bridge (auto-initialised)
    values = [tofino.lut_values(job, h) for h in range(2)]
    out = Walk()
    while True:
        # the egress of the pass before: a packet going round, its lanes' blocks next
        if egress_state(1, 0, wide, "THC_PAY_IDX") == "parse_dup":
            n = _constant("THC_TNA_OCTS")
            eg_phv, eg_valid = _garbage(rng, (("dd", n),)), set()
            after = _extract(packet, state("parse_dup_octs", "thc_tna_eg_parse.p4"),
                             eg_phv, eg_valid)
            dup = actions("thc_tna_dup.p4", "thc_dup")
            for k in call_order("ThcEgress", "thc_dup"):
                run(eg_phv, eg_valid, dup[k], dict(eg_phv) if parallel else None)
            packet = _emit(eg_phv, eg_valid, [("dd", i) for i in range(n)]) + after
        name = lane_states()[(wide, step)]
        out.passes.append(name)
        out.quarters.append(step)
        phv, valid = _garbage(rng, stacks), set()
        behind = _extract(packet, state(name), phv, valid)
        for word, h, octet, hi, lo, res_hi in lookups():
            value = values[h][_get(phv[("cur", octet)], hi, lo)]
            phv[("res", word)] = _put(phv[("res", word)], res_hi, res_hi - 15, value)
        valid -= {("cur", i) for i in range(_constant("THC_TNA_OCTS"))}
        valid |= {("res", i) for i in range(_constant("THC_TNA_WORDS"))}
        packet = _emit(phv, valid, order) + behind
        if last:
            out.payload = packet
            return out
        assert (wide, step) in rounds, f"no pass round after step {step} (wide {wide})"
        last, step = rounds[(wide, step)]
        assert step < quarters, "a pass beyond the words' registers"
