"""A packet's adding passes in thc_tna.p4, run on paper: pass 0's parser (and a vote DATA's
spread), the egress between passes (a 16-bit job's block doubled), each pass's parser
state, lookups with the controller's entries, words (tests/tna/words.py) and deparse order,
and the pass round, all as tests/tna/lanes.py and words.py read them from the program.
Without registers, a worker's walk places its lookup values where the sums go: summing
the workers' walks as 32-bit words is what the registers hold after the last worker
(tests/test_tna_lanes.py); with them, tests/tna/pass0.py answers as the switch would.
A pass writes its result words (lookups, words) before it sets them valid: bf-p4c keeps a
header's validity in a bit of its own and writes its containers whatever that bit says,
and so does this reading (lanes.run, for the vote spread, reads P4's stricter rule, which
the spread meets by setting each header valid first).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tests.tna.lanes import (actions, call_order, constant, consts, egress_state, emit, extract,
                             garbage, get_bits, lane_states, lookups, pass_rules, put_bits,
                             run, state)
from tests.tna.words import check_branch, go_round
from thc.controller.targets import tofino


@dataclass
class Walk:
    """A packet through the adding passes: each pass's parser state and quarter, and the
    payload the last pass sends (without registers: one worker's lookup values) and the
    bridge header it read (None where a pass was lost before it)."""
    passes: list[str] = field(default_factory=list)      # the parser state of each pass
    quarters: list[int] = field(default_factory=list)
    payload: bytes = b""
    last: dict | None = None


def passes(job, p1: dict, data: bytes, rng, words=None, parallel: bool = True,
           until: int | None = None) -> Walk:
    """A packet of ``job`` through pass 0's parser (and a vote DATA's spread), the egress
    between passes and every adding pass, from the bridge header ``p1`` pass 0 wrote, with
    the words' registers if given (tests/tna/words.py) and the pass round the program
    writes; undefined bits start random. ``data``: the DATA's indices or sign bits, a MAX's
    lanes, or none. ``until``: the passes that come round before one is lost (the words
    hold what they added; no last pass)."""
    text = words.text if words is not None else None
    shift, next_keys, next_entries, size = pass_rules(text)
    c = consts(text)
    check_branch(text)
    pay = {v: k for k, v in c.items() if k.startswith("THC_PAY_")}[p1.get("payload", 0)]
    stacks = (("rest", constant("THC_TNA_REST_OCTS")), ("cur", constant("THC_TNA_OCTS")),
              ("res", constant("THC_TNA_WORDS")))
    order = [(s, i) for s, n in stacks for i in range(n)]
    phv, valid = garbage(rng, stacks), set()
    if pay == "THC_PAY_IDX":
        vote = job.aggregation == "vote"
        rest = extract(data, state("parse_signs" if vote else "parse_idx"), phv, valid)
        assert rest == b"", "pass 0 parses the whole DATA"
        if vote:
            spread = actions("thc_tna_spread.p4", "thc_spread")
            for n in call_order("ThcIngress", "thc_spread", text):
                run(phv, valid, spread[n], dict(phv) if parallel else None)
        packet = emit(phv, valid, order)
    else:
        packet = data if pay == "THC_PAY_MAX" else b""
    assert p1.get("wide", 0) == job.sum_bits >> shift & 1
    values = [tofino.lut_values(job, h) for h in range(2)]
    out = Walk()
    while True:
        wide, step = p1.get("wide", 0), p1.get("step", 0)
        # the egress of the pass before: a packet going round, its lanes' blocks next
        if egress_state(1, 0, wide, pay, text) == "parse_dup":
            n = constant("THC_TNA_OCTS")
            eg_phv, eg_valid = garbage(rng, (("dd", n),)), set()
            after = extract(packet, state("parse_dup_octs", "thc_tna_eg_parse.p4"),
                             eg_phv, eg_valid)
            dup = actions("thc_tna_dup.p4", "thc_dup")
            for k in call_order("ThcEgress", "thc_dup", text):
                run(eg_phv, eg_valid, dup[k], dict(eg_phv) if parallel else None)
            packet = emit(eg_phv, eg_valid, [("dd", i) for i in range(n)]) + after
        name = {"THC_PAY_IDX": lane_states().get((wide, step)),
                "THC_PAY_MAX": "parse_max"}.get(pay)
        out.passes.append(name)
        out.quarters.append(p1.get("word_index", 0) >> 10)
        phv, valid = garbage(rng, stacks), set()
        behind = extract(packet, state(name), phv, valid) if name else packet
        # check_branch: the lookups, the words, the sums made valid, the indices dropped
        if p1.get("lut_job", 0) != c["THC_TNA_NO_LUT"]:
            for word, h, octet, hi, lo, res_hi in lookups():
                value = values[h][get_bits(phv[("cur", octet)], hi, lo)]
                phv[("res", word)] = put_bits(phv[("res", word)], res_hi, res_hi - 15, value)
        if words is not None:
            assert p1.get("word_index", 0) < size, "a pass beyond the words' registers"
            ra = words.action(p1)
            for j in range(constant("THC_TNA_WORDS")):
                rv = words.apply(j, p1, phv[("res", j)], ra)
                if rv is not None:
                    phv[("res", j)] = rv
        if pay != "THC_PAY_MAX" and not p1.get("hdr_only", 0):
            valid |= {("res", i) for i in range(constant("THC_TNA_WORDS"))}
        valid -= {("cur", i) for i in range(constant("THC_TNA_OCTS"))}
        packet = emit(phv, valid, order) + behind
        if p1.get("last", 0):
            out.payload, out.last = packet, p1
            return out
        if until is not None and len(out.passes) >= until:
            return out
        key = tuple(p1.get(k, 0) for k in next_keys)
        args = next((a for cells, a in next_entries if cells == key), None)
        assert args is not None, f"no pass round after step {step} (wide {wide}): no reply"
        p1 = go_round(p1, args, c, text)


def walk(job, data: bytes, rng, parallel: bool = True) -> Walk:
    """One worker's DATA of ``job`` (indices, or a vote DATA's sign bits) through the
    passes: its lookup values where the sums go."""
    p1 = {"payload": consts()["THC_PAY_IDX"], "wide": job.sum_bits >> pass_rules()[0] & 1}
    return passes(job, p1, data, rng, parallel=parallel)
