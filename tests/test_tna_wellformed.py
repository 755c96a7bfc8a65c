"""The Tofino program's checks that need no job are one ternary table (thc_wellformed),
whose entries p4src/gen_tna.py derives from protocol.json; thc.p4 writes the same checks as
a chain of conditions (its step 1). Here the generated entries, read as text and matched as
a TCAM does (the first entry that matches wins), must give every packet the drop reason the
chain gives it. The checks that need the job (payload lengths, offsets) come after
unknown_job, in thc_check, as in thc.p4 and the model.
"""
from __future__ import annotations

import itertools
import random
import re
from pathlib import Path

import pytest

from thc.controller.testing.variant import generator
from thc.wire import protocol as P

P4SRC = Path(__file__).resolve().parents[1] / "p4src"
gen_tna = generator().gen_tna

T = {t.name: int(t) for t in P.PktType}
TO_AGGREGATOR = {T["DATA"], T["MAX"], T["FLUSH"], T["RESET"]}
HDR_LEN = 36            # UDP length of a header-only THC datagram
KEYS = gen_tna.WELLFORMED_KEYS


def chain(p: dict) -> str | None:
    """thc.p4's step 1 in its order: the first check that fails names the drop."""
    if not p["thc_valid"]:
        return "MALFORMED"
    if p["parser_err"] != 0 or p["udp_length"] < HDR_LEN:
        return "MALFORMED"
    if p["pkt_type"] not in T.values() or p["version"] > 1:
        return "MALFORMED"
    if p["pkt_type"] not in TO_AGGREGATOR:
        return "WRONG_DIRECTION"
    if p["pkt_type"] == T["RESET"] and p["ingress_port"] != gen_tna.CPU_PORT:
        return "NOT_FROM_CPU"
    if p["pkt_type"] != T["RESET"] and p["run"] == 0:
        return "MALFORMED"
    return None


def entries() -> list[tuple[list, str]]:
    text = (P4SRC / "generated" / "thc_tna_wellformed.p4").read_text()
    out = []
    for cells, action in re.findall(r"^\s*\((.*)\): (\w+\(\w+\));$", text, re.M):
        key = []
        for cell in (c.strip() for c in cells.split(",")):
            if cell == "_":
                key.append(None)
            elif cell in ("true", "false"):
                key.append((int(cell == "true"), 1))
            elif "&&&" in cell:
                v, m = cell.split("&&&")
                key.append((int(v, 0), int(m, 0)))
            else:
                key.append((int(cell, 0), None))
        assert action.startswith("thc_set_drop"), "no sender is verified yet: drop, never answer"
        out.append((key, re.search(r"THC_DROP_(\w+)", action)[1]))
    return out


def tcam(table, p: dict) -> str | None:
    for key, reason in table:
        if all(c is None or (p[k] & c[1] if c[1] is not None else p[k]) == c[0]
               for k, c in zip(KEYS, key)):
            return reason
    return None


def packets(n: int, seed: int):
    rng = random.Random(seed)
    edges = {"thc_valid": [0, 1], "parser_err": [0, 1, 0x8000],
             "udp_length": [0, 35, 36, 37, 68, 164, 0xFFFF],
             "pkt_type": list(range(11)) + [0xFF],
             "version": [0, 1, 2, 0x80], "ingress_port": [0, gen_tna.CPU_PORT, 321, 511],
             "run": [0, 1, 0xFFFFFFFF]}
    bits = dict(zip(KEYS, gen_tna.WELLFORMED_BITS))
    for _ in range(n):
        yield {k: rng.choice(edges[k]) if rng.random() < 0.8 else rng.getrandbits(bits[k])
               for k in KEYS}


def test_the_table_gives_every_packet_the_chains_drop_reason():
    table = entries()
    assert len(table) > 30
    for p in packets(50_000, 1):
        assert tcam(table, p) == chain(p), p


@pytest.mark.parametrize("bits", [4, 8, 9])
def test_complement_covers_exactly_the_values_left_out(bits):
    rng = random.Random(bits)
    for size in (0, 1, 2, 5):
        excluded = set(rng.sample(range(1 << bits), size))
        cover = gen_tna.complement(excluded, bits)
        for v in range(1 << bits):
            hits = sum((v & m) == value for value, m in cover)
            assert hits == (0 if v in excluded else 1), (v, excluded)


@pytest.mark.parametrize("n", [0, 1, 36, 37, 255, 256])
def test_below_covers_exactly_the_smaller_values(n):
    cover = gen_tna.below(n, 9)
    for v in range(1 << 9):
        assert sum((v & m) == value for value, m in cover) == (v < n), (v, n)


def test_a_wrong_entry_order_is_caught():
    """The reference check can fail: the table with a NOT_FROM_CPU entry first answers
    some packet differently from the chain."""
    table = entries()
    k = next(i for i, (_, reason) in enumerate(table) if reason == "NOT_FROM_CPU")
    moved = [table[k]] + table[:k] + table[k + 1:]
    assert any(tcam(moved, p) != chain(p) for p in itertools.islice(packets(50_000, 2), 50_000))


def test_the_controller_and_the_generator_share_the_tofino_programs_shape():
    """The controller keeps copies of the generator's constants (it cannot import p4src):
    the lanes a word adds and the CPU port must be the generator's."""
    from thc.controller.targets import tofino
    assert (tofino.WORD_LANES, tofino.CPU_PORT) == (gen_tna.WORD_LANES, gen_tna.CPU_PORT)
