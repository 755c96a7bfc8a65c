"""The adding passes' registers and bridge as thc_tna.p4 writes them, read from its text:
the THC_WORD control (its parameters, bound to the arguments of every word's apply in
generated/thc_tna_words_apply.p4; thc_word_op's const entries, first match wins; its
RegisterActions, checked against WORD_RAS), and what thc_go_round_again writes into the
bridge header between passes. tests/tna/passes.py runs them; anything of another shape
fails loudly instead of being read wrong.
"""
from __future__ import annotations

import re
from functools import lru_cache

from tests.tna.lanes import (GEN, check_deparser, check_egress, constant, program_text,
                             uncommented)
from tests.tna.p4text import PASS1
from thc.controller.targets import tofino

WORD_RAS = {
    "thc_sum_ra": ("if (op == THC_OP_WRITE) { value = r.w; } else { value = value + r.w; } "
                   "rv = value;"),
    "thc_read": "rv = value;",
    "thc_clear": "value = 0; rv = value;",
    "thc_max": "if (op == THC_OP_WRITE || r.w > value) { value = r.w; } rv = value;",
}
"""What each RegisterAction of a word does, as THC_WORD writes it."""
SLOT_ORDER = ("thc_job_heard_op.apply();", "thc_ack_slot();", "thc_detail_index();",
              "thc_nonce_detail_op.apply();", "thc_seq_detail_op.apply();",
              "thc_op_detail_op.apply();", "thc_ack0_new.apply();", "thc_ack1_new.apply();")
assert {s.split("(")[0].removesuffix(".apply") for s in SLOT_ORDER} == set(PASS1)
SLOT_STATE = tuple(re.escape(s) for s in SLOT_ORDER)
"""The adding passes' slot-state statements (p4text.PASS1, which tests/tna/interp.py runs),
in the program's order."""
BRANCH = (*SLOT_STATE,
          r"thc_current_op\.apply\(\);",
          r"thc_passes_op\.apply\(\);",
          r'#include "generated/thc_tna_luts_apply\.p4"',
          r'#include "generated/thc_tna_words_apply\.p4"',
          r"if \(meta\.p1\.payload != THC_PAY_MAX && meta\.p1\.hdr_only == 0\) \{\s*"
          r'#include "generated/thc_tna_res_valid\.p4"\s*\}',
          r'#include "generated/thc_tna_cur_invalid\.p4"',
          r"if \(meta\.p1\.last == 0\) \{\s*thc_next\.apply\(\);\s*\}",
          r"else if \(meta\.p1\.reply == 1\) \{\s*thc_dscp_last\.apply\(\);\s*"
          r"meta\.bridge\.is_reply = 1;\s*if \(meta\.p1\.mcast_grp != 0\) \{\s*"
          r"ig_tm_md\.mcast_grp_a = meta\.p1\.mcast_grp;\s*\} else \{\s*"
          r"ig_tm_md\.ucast_egress_port = meta\.p1\.in_port;\s*\}\s*"
          r"meta\.p1\.setInvalid\(\);\s*\}",
          r"else \{\s*meta\.p1\.setInvalid\(\);\s*ig_dprsr_md\.drop_ctl = 1;\s*\}")
"""The adding passes' branch, all of it, in this order: the slot state, the last pass's check
that its use is the current one and its count of the use's last passes
(pass0.TnaEngine._last_pass), lookups, words, this pass's sums made valid where it has sums,
its indices dropped, the pass round; the last pass sends to pass 0's multicast group, or to
the port pass 0 heard the packet on, or drops it (consumed). passes.passes and
pass0.TnaEngine run it so; a statement anywhere else in it would run on a Tofino and not
here, so the check refuses one."""
INCLUDED = {
    "thc_tna_luts_apply.p4": lambda words, octs: [f"thc_w{w:02d}_lut_{h}.apply();"
                                                 for w in range(words) for h in (0, 1)],
    "thc_tna_res_valid.p4": lambda words, octs: [f"hdr.res[{w}].setValid();"
                                                for w in range(words)],
    "thc_tna_cur_invalid.p4": lambda words, octs: [f"hdr.cur[{o}].setInvalid();"
                                                  for o in range(octs)],
}
"""The generated files the branch includes, line by line (the words' applies: Words)."""


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("\\\n", "\n"))


def statements(name: str) -> list[str]:
    """A generated file's lines, its comments and blank lines left out."""
    return [line.strip() for line in uncommented((GEN / name).read_text()).splitlines()
            if line.strip()]


@lru_cache(maxsize=None)
def check_branch(text: str | None = None) -> None:
    body = uncommented(program_text(text)).split("if (meta.p1.isValid()) {", 1)[1]
    body = body.split("} else if (hdr.udp.isValid()", 1)[0]
    at = 0
    for part in BRANCH:
        at = re.compile(r"\s*").match(body, at).end()
        m = re.compile(part).match(body, at)
        assert m, (f"the adding passes' branch changed: {part!r} does not follow the step "
                   f"before; there: {body[at:at + 120]!r}")
        at = m.end()
    assert not body[at:].strip(), f"the adding passes' branch goes on: {body[at:at + 120]!r}"
    words, octs = constant("THC_TNA_WORDS"), constant("THC_TNA_OCTS")
    for name, want in INCLUDED.items():
        assert sorted(statements(name)) == sorted(want(words, octs)), \
            f"generated/{name} is not one statement a word or index block"
    check_deparser(text)
    check_egress(text)
    check_unread(text)


def check_unread(text: str | None = None) -> None:
    """The parts the reading takes as given, held to their text: each word's operation table
    does nothing by default and is all its control applies; the adding passes' parser state
    is picked by (payload, width, step) of the pass's own bridge; the lane headers' fields
    as lanes.FIELDS places them; every lookup keyed on the job's lookup index (NO_LUT for a
    MAX); a pass round in queue 0; one entry a worker count, worker and pool size in the
    slot state's tables (most of the fuzz's interleavings run at most 5 workers and pools
    up to 4); and the ports the controller names (CPU, recirculation)."""
    src = uncommented(program_text(text))
    macro = _flat(src.split("#define THC_WORD(", 1)[1].split("#undef THC_WORD", 1)[0])
    word_op = re.search(r"table thc_word_op \{(.*?) const entries", macro)[1]
    tail = macro.split("table thc_word_op", 1)[1].split("const entries", 1)[1]
    assert "default_action" not in word_op and re.match(
        r" = \{[^}]*\} const default_action = NoAction; size = \d+; \}", tail), \
        "thc_word_op's default action is no longer NoAction"
    assert re.search(r"apply \{ thc_word_op\.apply\(\); \} \}", macro), \
        "THC_WORD's apply is more than thc_word_op"
    parse = uncommented((GEN / "thc_tna_parse.p4").read_text())
    assert "state parse_lanes {\n        transition select(meta.p1.payload, meta.p1.wide, " \
        "meta.p1.step) {" in parse, "parse_lanes' keys changed"
    for header, fields in (("thc_oct_h", "bit<32> idx;"), ("thc_word_h", "bit<32> w;"),
                           ("thc_dup_h", "bit<16> hi; bit<16> lo;")):
        body = re.search(rf"header {header} \{{(.*?)\}}", src, re.S)[1]
        assert " ".join(body.split()) == fields, f"{header} changed: {body!r}"
    keys = re.findall(r"key = \{ (\S+): exact", (GEN / "thc_tna_luts.p4").read_text())
    assert keys and set(keys) == {"meta.p1.lut_job"}, f"lookup keys {set(keys)}"
    for action in ("thc_recirculate", "thc_answer_round"):
        body = re.search(rf"action {action}\(\) \{{(.*?)\}}", src, re.S)[1]
        assert "ig_tm_md.qid = 0;" in body and "++ THC_TNA_RECIRC_PORT;" in body, \
            f"{action} no longer sends the pass round in queue 0"
    for macro_name, want in (("THC_FULL", range(1, tofino.CLOSED_BIT + 1)),
                             ("THC_DUP", range(tofino.CLOSED_BIT)),
                             ("THC_POOL", [1 << k for k in range(10)]),
                             ("THC_SEEN_POOL", [1 << k for k in range(10)])):
        got = sorted(int(n) for n in re.findall(rf"\b{macro_name}\((\d+)\)", src))
        assert got == list(want), f"{macro_name} entries for {got}"
    ports = {m[1]: int(m[2]) for m in re.finditer(
        r"const bit<\d+> THC_TNA_(\w+)_PORT = (\d+);", (GEN / "thc_tna_constants.p4").read_text())}
    assert (ports["CPU"], ports["RECIRC"] >> 3 << 3) == (tofino.CPU_PORT, tofino.FRONT_PANEL), \
        f"the program's ports {ports} are not the controller's (CPU port, 64-71)"


class Words:
    """Each word's register, one 32-bit cell an index, and how a pass applies it."""

    def __init__(self, consts: dict[str, int], text: str | None = None):
        self.text, self.consts = text, consts
        macro = program_text(text).split("#define THC_WORD(", 1)[1].split("#undef THC_WORD", 1)[0]
        flat = _flat(macro)
        for ra, body in WORD_RAS.items():
            got = re.search(rf"\) {ra} = {{ void apply\(inout bit<32> value, out bit<32> rv\) "
                            rf"{{ (.*?) }} }};", flat)
            assert got and got[1] == _flat(body), f"THC_WORD's {ra}: {got and got[1]}"
        sig = re.search(r"control NAME\((.*?)\) \{", flat)[1]
        params = [p.split()[-1] for p in sig.split(",")]
        calls = [re.fullmatch(r"thc_w(\d+)\.apply\((.*?)\);", line)
                 for line in statements("thc_tna_words_apply.p4")]
        assert all(calls), "generated/thc_tna_words_apply.p4 holds more than the words' applies"
        assert sorted(int(c[1]) for c in calls) == list(range(constant("THC_TNA_WORDS"))), \
            "every word applied once"
        self.args = {}
        for j, args in (c.groups() for c in calls):
            bound = dict(zip(params, [a.strip() for a in args.split(",")], strict=True))
            assert bound.pop("r") == f"hdr.res[{int(j)}]", "word NN adds result word NN"
            self.args[int(j)] = bound
        assert len({tuple(a.items()) for a in self.args.values()}) == 1, \
            "every word applies with the same bridge fields"
        self.fields = {}
        for param, expr in self.args[0].items():
            m = re.fullmatch(r"meta\.p1\.(\w+)", expr)
            assert m, f"a word's argument {expr!r} is not a bridge field"
            self.fields[param] = m[1]
        self.index = re.search(r"action thc_word_sum\(\) \{ r\.w = thc_sum_ra\.execute\((\w+)\);",
                               flat)[1]
        table = re.search(r"table thc_word_op \{ key = \{ (.*?) \} actions = \{ (.*?) \} "
                          r"const entries = \{ (.*?) \}", flat)
        self.keys = [k.split(":")[0].strip() for k in table[1].split(";") if k.strip()]
        acts = {m[1]: m[2] for m in re.finditer(
            r"action (thc_word_\w+)\(\) \{ r\.w = (\w+)\.execute\((\w+)\); \}", flat)}
        rows = [r.strip() for r in table[3].split(";") if r.strip()]
        self.entries = []
        for row in rows:
            m = re.fullmatch(r"\((.*)\): (thc_word_\w+)\(\)", row)
            assert m, f"thc_word_op entry {row!r}"
            cells = [c.strip() for c in m[1].split(",")]
            assert len(cells) == len(self.keys) and all("&&&" not in c for c in cells), row
            self.entries.append(([None if c == "_" else int(c) if c.isdigit() else consts[c]
                                  for c in cells], acts[m[2]]))
        self.cells: dict[tuple[int, int], int] = {}

    def action(self, p1: dict) -> str | None:
        """The RegisterAction every word runs in a pass with bridge ``p1`` (None: NoAction)."""
        key = [p1.get(self.fields[k], 0) for k in self.keys]
        return next((a for cells, a in self.entries
                     if all(c is None or c == v for c, v in zip(cells, key))), None)

    def apply(self, word: int, p1: dict, r: int, ra: str | None):
        """Word ``word``'s RegisterAction ``ra`` (action()) on input ``r``: its output."""
        if ra is None:
            return None
        op, index = p1.get(self.fields["op"], 0), p1.get(self.fields[self.index], 0)
        write = op == self.consts["THC_OP_WRITE"]
        value = self.cells.get((word, index), 0)
        if ra == "thc_sum_ra":
            value = r if write else (value + r) & 0xFFFFFFFF
        elif ra == "thc_clear":
            value = 0
        elif ra == "thc_max" and (write or r > value):
            value = r
        self.cells[(word, index)] = value
        return value


ROUND_FIXED = ("ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port[8:7] ++ THC_TNA_RECIRC_PORT;",
               "ig_tm_md.qid = 0;", "meta.bridge.setInvalid();")
"""What thc_go_round_again does besides the bridge fields: to its pipe's recirculation port,
in queue 0, and only meta.p1 (the next pass's bridge) deparsed."""


@lru_cache(maxsize=None)
def round_statements(text: str | None = None) -> tuple[tuple, ...]:
    """thc_go_round_again's writes to the bridge: (field, hi, lo, source), source a
    parameter name, a number or a constant's name."""
    body = re.search(r"action thc_go_round_again\((.*?)\) \{(.*?)\n    \}", program_text(text),
                     re.S)
    out, fixed = [], set()
    for line in uncommented(body[2]).strip().splitlines():
        line = line.strip()
        if line in ROUND_FIXED:
            assert line not in fixed, f"thc_go_round_again: {line!r} twice"
            fixed.add(line)
            continue
        m = re.fullmatch(r"meta\.p1\.(\w+)(?:\[(\d+):(\d+)\])? = (\w+);", line)
        assert m, f"thc_go_round_again: {line!r}"
        out.append((m[1], m[2] and int(m[2]), m[3] and int(m[3]), m[4]))
    assert fixed == set(ROUND_FIXED), f"thc_go_round_again lacks {set(ROUND_FIXED) - fixed}"
    return tuple(out)


def go_round(p1: dict, params: dict[str, int], consts: dict[str, int],
             text: str | None = None) -> dict:
    """The bridge the next pass reads: thc_go_round_again(params) applied to ``p1``."""
    p1 = dict(p1)
    for name, hi, lo, src in round_statements(text):
        v = params[src] if src in params else int(src) if src.isdigit() else consts[src]
        if hi is None:
            p1[name] = v
        else:
            mask = ((1 << (hi - lo + 1)) - 1) << lo
            p1[name] = p1.get(name, 0) & ~mask | v << lo & mask
    return p1
