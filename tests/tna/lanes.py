"""The Tofino program's lanes as its text says: the generated parser states of every pass
(p4src/generated/thc_tna_parse.p4, thc_tna_eg_parse.p4), the vote spread and the egress
doubling actions and the order their controls call them, the words' lookups, the egress
parser's select, thc_next's entries, the program's constants; and the PHV helpers that
run them (an action's statements, extracts, deparse order: rest, then cur, then res;
egress: its doubled block in front of what it did not parse). Read once per process;
nothing here needs a compiler. tests/tna/passes.py runs a packet through them.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

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
def program_text(text: str | None = None) -> str:
    """The program's text: the file's, or a (broken) copy's."""
    return text or (P4SRC / "thc_tna.p4").read_text()


def uncommented(text: str) -> str:
    """P4 text without its // comments."""
    return re.sub(r"//[^\n]*", "", text)


DEPARSE = ("pkt.emit(meta.bridge);", "pkt.emit(meta.p1);", "pkt.emit(hdr);")
"""ThcIngressDeparser, all of it: pass 0's and the last pass's bridge header for egress, the
next pass's, then the packet's headers in tna_headers_t's order."""
HEADERS = ("ethernet", "ipv4", "udp", "thc", *EMIT)


@lru_cache(maxsize=None)
def check_deparser(text: str | None = None) -> None:
    """The ingress deparser and the header struct as :data:`DEPARSE` and :data:`EMIT` read
    them; and the annotation behind the interpreter's zeroed metadata."""
    src = uncommented(program_text(text))
    body = re.search(r"control ThcIngressDeparser\(.*?\) \{\s*apply \{(.*?)\}\s*\}", src, re.S)
    assert body and body[1].split() == list(DEPARSE), \
        f"ThcIngressDeparser changed: {body and body[1].split()}"
    struct = re.search(r"struct tna_headers_t \{(.*?)\}", src, re.S)[1]
    names = [line.split()[-1].rstrip(";") for line in struct.strip().splitlines()]
    assert names == list(HEADERS), f"tna_headers_t's order changed: {names}"
    assert re.search(r"^@pa_auto_init_metadata\s+struct metadata_t \{", src, re.M), \
        "metadata_t lost @pa_auto_init_metadata: the interpreter starts its fields at 0"


EGRESS_APPLY = ("if (hdr.dd[0].isValid()) { thc_dup_0(); thc_dup_1(); thc_dup_2(); } "
                "if (hdr.bridge.recirc == 0) { if (hdr.bridge.is_reply == 1) { "
                "if (eg_intr_md.egress_rid != 0) { "
                "hdr.thc.worker_id = (bit<8>)(eg_intr_md.egress_rid - 1); } "
                "meta.passes = (bit<8>)hdr.bridge.passes; thc_want_op.apply(); "
                "if (meta.passes != meta.want) { thc_withhold_op.apply(); } "
                "else { thc_worker_addr.apply(); } } hdr.bridge.setInvalid(); }")
"""ThcEgress's apply block. Replies run all of it from their bytes (tests/tna/pass0.py); a
packet going round does not (passes.py doubles as its thc_dup actions do), so the block is
also held to its text: a change to it must change passes.py too."""


@lru_cache(maxsize=None)
def check_egress(text: str | None = None) -> None:
    src = uncommented(program_text(text))
    body = src.split("control ThcEgress(", 1)[1].split("control ThcEgressDeparser(", 1)[0]
    body = body.split("apply {", 1)[1].rsplit("}", 2)[0]
    assert " ".join(body.split()) == EGRESS_APPLY, f"ThcEgress's apply changed: {body!r}"


@lru_cache(maxsize=None)
def constant(name: str) -> int:
    text = "".join((GEN / f).read_text() for f in ("thc_constants.p4", "thc_tna_constants.p4"))
    return int(re.search(rf"#define {name} (\d+)", text)[1])


@lru_cache(maxsize=None)
def call_order(control: str, prefix: str, text: str | None = None) -> list[int]:
    """The order in which ``control``'s apply block calls the actions prefix_<n>."""
    body = program_text(text).split(f"control {control}(", 1)[1]
    body = body[body.index("\n    apply {"):]
    return [int(n) for n in re.findall(rf"\b{prefix}_(\d+)\(\);", body)]


@lru_cache(maxsize=None)
def egress_state(recirc: int, is_reply: int, wide: int, payload: str,
                 text: str | None = None) -> str:
    """Where the egress parser goes after the bridge header: its select's first match."""
    start = program_text(text).split("parser ThcEgressParser(", 1)[1]
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
def pass_rules(text: str | None = None) -> tuple[int, tuple, tuple, int]:
    """What the program's own statements say: set_job's shift for the job's width,
    thc_next's keys (bridge fields) and entries (cells, thc_go_round_again's arguments by
    name), and the words' register size (a slot version's index takes THC_REG_SIZE values,
    bits 9:0, so that the pass round can put each pass in a quarter above them)."""
    text = program_text(text)
    index = re.search(r"thc_word_hash\.get\(\{meta\.slot_idx\[(\d+):0\], "
                      r"hdr\.thc\.version\[0:0\]\}\)", text)
    assert index and 1 << int(index[1]) + 2 == constant("THC_REG_SIZE") == 1 << 10, \
        "the words' index of a slot version must take THC_REG_SIZE values, bits 9:0"
    wide = re.search(r"meta\.bridge\.wide = meta\.wide;", text)
    shift = re.search(r"meta\.wide = \(bit<1>\)\(sum_bits >> (\d+)\);", text)
    params = re.search(r"action thc_go_round_again\((.*?)\)", text)[1]
    params = [p.split()[-1] for p in params.split(",")]
    nxt = re.search(r"table thc_next \{(.*?)\n    \}", text, re.S).group(1)
    keys = tuple(re.findall(r"meta\.p1\.(\w+): exact;", nxt))
    entries = tuple((tuple(int(c) for c in m[1].split(",")),
                     dict(zip(params, (int(a) for a in m[2].split(",")), strict=True)))
                    for m in re.finditer(r"\(([\d, ]+)\): thc_go_round_again\(([\d, ]+)\);", nxt))
    size = re.search(r"Register<bit<32>, thc_index_t>\(THC_REG_SIZE \* (\d+)\) thc_sum;", text)
    assert wide and shift and keys and entries and size, "set_job, thc_next or thc_sum changed"
    return int(shift[1]), keys, entries, int(size[1]) * constant("THC_REG_SIZE")


@lru_cache(maxsize=None)
def consts(text: str | None = None) -> dict[str, int]:
    """The program's own numeric constants (THC_PAY_*, THC_TNA_NO_LUT), and the generated
    ones (THC_OP_*)."""
    src = program_text(text) + (GEN / "thc_constants.p4").read_text()
    return {m[1]: int(m[2], 0) for m in re.finditer(
        r"const bit<\d+> (\w+) = (0x[0-9A-Fa-f]+|\d+);", src)}


def get_bits(v: int, hi: int, lo: int) -> int:
    return v >> lo & ((1 << (hi - lo + 1)) - 1)


def put_bits(v: int, hi: int, lo: int, x: int) -> int:
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
        phv[dst] = put_bits(phv[dst], dhi, dlo, get_bits((before or phv)[src], shi, slo))


def extract(data: bytes, headers, phv: dict, valid: set) -> bytes:
    for k, h in enumerate(headers):
        phv[h] = int.from_bytes(data[4 * k:4 * k + 4], "big")
        valid.add(h)
    return data[4 * len(headers):]


def emit(phv: dict, valid: set, order) -> bytes:
    return b"".join(phv[h].to_bytes(4, "big") for h in order if h in valid)


def garbage(rng, stacks) -> dict:
    keys = [(s, i) for s, n in stacks for i in range(n)]
    return dict(zip(keys, rng.integers(0, 1 << 32, len(keys)).tolist()))
