"""The generated parts of the Tofino program (p4src/thc_tna.p4): its word instances, their
apply calls in both passes, and the parser states that extract each pass's lanes.

A word is four 8-bit lanes. Pass 0 adds the last PASS0_WORDS words of a packet (after the
slot state, in the stages left), pass 1 the first WORDS; the first PASS0_WORDS word
registers serve both passes (docs/switch.md, "Tofino"). gen_p4.py writes these files with
the BMv2 program's.
"""
from __future__ import annotations

WORD_LANES = 4
WORDS = 40
"""Words pass 1 adds (lanes 0 .. 4 * WORDS - 1)."""
PASS0_WORDS = 24
"""Words pass 0 adds (the packet's last lanes), in the word registers 0 .. PASS0_WORDS - 1."""
EARLY_WORDS = 4
"""Words of pass 1 whose two lookups share a stage (ThcEarlyWord), so that their registers
can take the stage after the first: the other words take a stage per lookup."""
RECIRC_PORT = 68
"""The recirculation port of a Tofino-1 pipe (low 7 bits of the port number)."""
CPU_PORT = 320
"""Tofino-1's PCIe CPU port (pipe 2, port 64, on a four-pipe part): where packet-outs enter."""

HALF = 20
"""Header stacks hold at most 32 (their validity bits share a container): words in halves."""

WORD_DECL = "{control}() thc_w{j:02d};\n"
WORD_APPLY = ("thc_w{j:02d}.apply(hdr.{res}, {halves}{index}, "
              "{src}.lane_op, {src}.is_max, {src}.blank, {run});\n")


def check(spec: dict) -> None:
    lanes = spec["lanes"]
    if (WORDS + PASS0_WORDS) * WORD_LANES != lanes:
        raise SystemExit(f"gen_tna: {WORDS} + {PASS0_WORDS} words of {WORD_LANES} lanes do "
                         f"not make protocol.json's {lanes} lanes")
    if spec["max_lanes"] > WORDS - EARLY_WORDS or WORDS % 8 or PASS0_WORDS % 8:
        raise SystemExit("gen_tna: the max lanes ride pass 1's words (not the early ones); "
                         "payload headers hold "
                         "two words (indices) or eight (sign bits)")


def constants(header: str) -> str:
    return "".join([header, "// Sizes of the Tofino program (thc_tna.p4): words of four lanes in two passes\n",
            f"#define THC_TNA_WORDS {WORDS}\n",
            f"#define THC_TNA_PASS0_WORDS {PASS0_WORDS}\n",
            f"#define THC_TNA_HALF {HALF}\n",
            f"const bit<7> THC_TNA_RECIRC_PORT = {RECIRC_PORT};\n",
            f"const bit<9> THC_TNA_CPU_PORT = {CPU_PORT};\n"])


def word(stack: str, j: int) -> str:
    """Word j of the result stack, kept in halves."""
    return f"{stack}_a[{j}]" if j < HALF else f"{stack}_b[{j - HALF}]"


def _apply(j: int, src: str, index: str, run: str) -> str:
    halves = f"thc_w{j:02d}_hi, thc_w{j:02d}_lo, " if early(j) else ""
    return WORD_APPLY.format(j=j, halves=halves, src=src, index=index, run=run,
                             res=word("res", j))


def early(j: int) -> bool:
    return j >= WORDS - EARLY_WORDS


LUT_DECL = """    @name("thc_w{j:02d}.thc_lut_set_{h}")
    action thc_w{j:02d}_lut_set_{h}(bit<16> value) {{ {dst} = value; }}
    @name("thc_w{j:02d}.thc_lut_{h}")
    table thc_w{j:02d}_lut_{h} {{
        key = {{ hdr.thc.job_id: exact @name("job_id"); {key}: exact @name("idx"); }}
        actions = {{ thc_w{j:02d}_lut_set_{h}; }}
        default_action = thc_w{j:02d}_lut_set_{h}(0);
        size = THC_LUT_SIZE;
    }}
"""


def _luts() -> tuple[str, str]:
    """Each word's two lookup tables (thc.p4's names under the word), declared and applied
    in the ingress control; a word of pass 1 only looks up when its indices are there."""
    decl, apply = [], []
    for j in range(WORDS):
        o, second = divmod(j, 2)
        idx = f"hdr.cur[{o}].idx"
        if early(j):
            decl.append(f"    bit<16> thc_w{j:02d}_hi = 0;\n    bit<16> thc_w{j:02d}_lo = 0;\n")
        for h in range(2):
            bit = 31 - 16 * second - 8 * h
            if early(j):
                dst = f"thc_w{j:02d}_{'hi' if h == 0 else 'lo'}"
            else:
                dst = f"hdr.{word('res', j)}.w[{31 - 16 * h}:{16 - 16 * h}]"
            decl.append(LUT_DECL.format(j=j, h=h, dst=dst, key=f"{idx}[{bit}:{bit - 7}]"))
        apply.append(f"if (hdr.cur[{o}].isValid()) {{ thc_w{j:02d}_lut_0.apply(); "
                     f"thc_w{j:02d}_lut_1.apply(); }}\n")
    return "".join(decl), "".join(apply)


def _extract(stack: str, n: int) -> str:
    names = [word(stack, i) if stack == "res" else f"{stack}[{i}]" for i in range(n)]
    return "".join(f"        pkt.extract(hdr.{name});\n" for name in names)


def _each(fmt: str, stack: str, n: int) -> str:
    return "".join(fmt.format(word(stack, i) if stack else i) for i in range(n))


def _state(name: str, body: str) -> str:
    return f"    state {name} {{\n{body}        transition accept;\n    }}\n"


def _pragmas() -> str:
    """The words of pass 1 only look their halves up when pass 0's carried indices are
    gone."""
    pairs = [(f"hdr.rest[{i}]", f"thc_w{j:02d}_{half}") for i in range(WORDS // 2)
             for j in range(WORDS - EARLY_WORDS, WORDS) for half in ("hi", "lo")]
    return "".join(f'@pa_mutually_exclusive("ingress", "{a}", "{b}")\n' for a, b in pairs)


def files(spec: dict, header: str) -> dict[str, str]:
    """File name -> text of the Tofino program's generated files."""
    check(spec)
    octs, votes = WORDS // 2, WORDS // 8
    parse = "".join([
        _state("p0_data", _extract("rest", octs) + _extract("cur", PASS0_WORDS // 2)),
        _state("p0_vote", _extract("rest", votes) + _extract("cur", PASS0_WORDS // 8)),
        _state("p1_data", _extract("cur", octs)),
        _state("p1_vote", _extract("cur", votes)),
        _state("parse_max", _extract("res", spec["max_lanes"])),
    ])
    return {
        "thc_tna_constants.p4": constants(header),
        "thc_tna_luts.p4": header + "// The words' lookup tables (thc_tna.p4's ingress).\n"
                           + _luts()[0],
        "thc_tna_luts_apply.p4": header + "// The words' lookups, first in ingress.\n"
                                 + _luts()[1],
        "thc_tna_pragmas.p4": header + "// PHV that no packet uses twice (thc_tna.p4's ingress):"
                              " index octs or sign-bit halfwords; pass 0's carried indices or"
                              " pass 1's early words.\n" + _pragmas(),
        "thc_tna_parse.p4": header + "// Parser states of thc_tna.p4: each pass's lanes.\n"
                            + parse,
        "thc_tna_words.p4": header + "// The word instances of thc_tna.p4.\n"
                            + "".join(WORD_DECL.format(
                                j=j, control="ThcEarlyWord" if j >= WORDS - EARLY_WORDS else "ThcWord")
                                for j in range(WORDS)),
        "thc_tna_words_apply0.p4": header + "// Words of both passes (this pass's slot state).\n"
                                   + "".join(_apply(j, "meta", "meta.word_index", "meta.run_words") for j in range(PASS0_WORDS)),
        "thc_tna_words_apply1.p4": header + "// Words of pass 1 only (pass 0's decisions).\n"
                                   + "".join(_apply(j, "meta.p1", "meta.p1.word_index", "meta.p1.recirc")
                                             for j in range(PASS0_WORDS, WORDS)),
        "thc_tna_res_valid0.p4": header + "// Pass 0's sums.\n"
                                 + _each("hdr.{}.setValid();\n", "res", PASS0_WORDS),
        "thc_tna_res_valid1.p4": header + "// Pass 1's sums.\n"
                                 + _each("hdr.{}.setValid();\n", "res", WORDS),
        "thc_tna_payload_invalid.p4": header + "// A reply without lanes.\n"
                                      + _each("hdr.rest[{}].setInvalid();\n", "", octs)
                                      + _each("hdr.{}.setInvalid();\n", "res", WORDS),
        "thc_tna_cur_invalid.p4": header + "// Indices this pass has looked up.\n"
                                  + _each("hdr.cur[{}].setInvalid();\n", "", octs),
    }
