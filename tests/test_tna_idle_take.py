"""thc_tna.p4's idle take (docs/switch.md, "The run jump and idle rules"): pass 0's
thc_job_seen_op (stage 1) copies thc_check's (stage 4) checks before the run, so that only a
packet thc_check hands to the run check reads the job's last-heard time, and takes an idle
job there and then. The two tables' entries are matched here as a TCAM matches them (the
first entry that matches wins) over a grid of every key's edges: pool sizes, slots at and past
the pool, seqs of either version, every type a worker sends (DATA, MAX, FLUSH), lane kind,
vote and width, a known worker or not, offset bit 31, the configuration tag's or another's
(a RESET, from the CPU port, clears the
time in the one table and the run in the other). The entries are read from the program's
text (tests/tna/interp.py)."""
from __future__ import annotations

import itertools
import re
import shutil

import numpy as np
import pytest

if shutil.which("cpp") is None:
    pytest.skip("cpp (the C preprocessor) is not installed: reading thc_tna.p4 needs it for "
                "its #includes and macros", allow_module_level=True)

from tests.tna.interp import Program
from tests.tna.p4text import P4SRC, preprocess

RUN_ACTIONS = ("thc_job_run_idle", "thc_job_run_check")


def _first(table: dict, keys: dict[str, np.ndarray]) -> np.ndarray:
    """The action name of the first entry matching each row of ``keys`` (the default where
    none does)."""
    n = len(next(iter(keys.values())))
    names = [a for _, a, _ in table["entries"]] + [table["default"][0]]
    pick = np.full(n, len(names) - 1)
    for i, (cells, _, _) in reversed(list(enumerate(table["entries"]))):
        hit = np.ones(n, bool)
        for name, cell in zip(table["key_names"], cells):
            if cell is not None:
                value, mask = cell
                hit &= (keys[name] & mask) == (value & mask)
        pick[hit] = i
    return np.array(names)[pick]


def _grid(prog: Program) -> dict[str, np.ndarray]:
    c = {k: v[0] for k, v in prog.consts.items()}
    rows = []
    types = (c["THC_DATA"], c["THC_MAX"], c["THC_FLUSH"])
    lanes = sorted({c[k] for k in c if k.startswith("THC_IN_")} | {7})
    for pool in (0, 3) + tuple(1 << b for b in range(10)):
        for slot in sorted({0, max(pool - 1, 0), pool, 2 * pool - 1 if pool else 1, 0xffff}):
            for seq in {slot, slot + pool, slot + 1, slot + 2 * pool}:
                for pkt, vote, wide, lane, version, known, off31, cfg in itertools.product(
                        types, (0, 1), (0, 1), lanes, (0, 1), ((1, 4, 1), (0, 4, 1), (0, 4, 4)),
                        (0, 1), (0, 1, 0x8000)):
                    rows.append((pkt, vote, wide, lane, pool, slot, seq & 0xffff, version,
                                 *known, off31, cfg))
    a = np.array(rows, dtype=np.int64).T
    pkt, vote, wide, lane, pool, slot, seq16, version, hit, n, w, off31, cfg = a
    return {"drop_reason": np.zeros_like(pkt), "job_hit": np.ones_like(pkt),
            "pkt_type": pkt, "vote": vote, "wide": wide, "lanes_in": lane, "pool_size": pool,
            "slot": slot, "seq16": seq16, "version": version, "slotx": seq16 ^ slot,
            "worker_hit": hit, "room8": np.maximum(n - w, 0),
            "room16": np.maximum(pool - slot, 0), "offset31": off31, "cfg_diff": cfg,
            "install_hit": np.zeros_like(pkt)}   # thc_install is looked up for RESETs only


def _keyed(prog: Program, table: str) -> dict:
    """The table with each key named as _grid names it: its @name, else its field's name."""
    t = dict(prog.tables[table])
    t["key_names"] = [name or expr[1].rsplit(".", 1)[-1]
                      for name, expr in zip(t["key_names"], t["keys"])]
    return t


def disagreements(text: str | None = None) -> list[str]:
    """Packets for which thc_job_seen_op runs its check but thc_check does not reach the run
    check, or the reverse, each named by its keys (the first 5)."""
    prog = Program(preprocess(text), raw=text)
    keys = _grid(prog)
    seen = _first(_keyed(prog, "thc_job_seen_op"), keys)
    ran = seen == "thc_job_seen_check"
    keys["seen"] = np.zeros_like(keys["pkt_type"])   # not read
    check = _first(_keyed(prog, "thc_check"), keys)
    reach = np.isin(check, RUN_ACTIONS)
    bad = np.flatnonzero(ran != reach)
    return [", ".join(f"{k} {int(v[i])}" for k, v in keys.items() if k != "seen")
            + f": seen table {seen[i]}, thc_check {check[i]}" for i in bad[:5]]


def test_the_idle_take_reads_only_packets_the_run_check_sees():
    assert disagreements() == []


SEEN_BROKEN = {
    "the MAX-without-lanes row gone": (
        r"^ *\(0, 1, THC_MAX, _, THC_IN_NONE, [_, ]*\): NoAction\(\);\n", ""),
    "the FLUSH-with-a-body row gone": (
        r"^ *\(0, 1, THC_FLUSH, _, THC_IN_NONE, [_, ]*\): NoAction\(\);\n", ""),
    "a vote job's DATA with indices taken": (
        r"^ *\(0, 1, THC_DATA, 1, THC_IN_IDX, [_, ]*\): NoAction\(\);\n", ""),
    "a THC job's DATA with signs taken": (
        r"^ *\(0, 1, THC_DATA, 0, THC_IN_SIGNS, [_, ]*\): NoAction\(\);\n", ""),
    "offset bit 31 not read": (
        r"(0 &&& \(0xffff - \(P - 1\)\)), 0(, \\\n.*\n.*0 &&& \(0xffff - \(P - 1\)\)), 0,",
        r"\1, _\2, _,"),
    "the configuration tag not read": (
        r"(0 &&& P, 0, 1, 0 &&& \(0xffff - \(P - 1\)\), 0, \\\n\s+_), 0\)", r"\1, _)"),
    "version 1's slots up to twice the pool": (
        r"(P &&& P, 1, 1, 0 &&& \(0xffff - )\(P - 1\)\)", r"\1(P + P - 1))"),
    "pools 8 to 256 left out": (
        r"THC_SEEN_POOL\(8\)\n?\s*THC_SEEN_POOL\(16\) THC_SEEN_POOL\(32\) THC_SEEN_POOL\(64\)"
        r" THC_SEEN_POOL\(128\)\n\s*THC_SEEN_POOL\(256\) ", ""),
}
"""Broken copies of the seen table, most of which the fuzz and the idle scenarios miss (they
send no such lanes or offsets to an idle job)."""


@pytest.mark.parametrize("name", sorted(SEEN_BROKEN))
def test_the_comparison_catches_a_broken_seen_table(name):
    pattern, repl = SEEN_BROKEN[name]
    text, k = re.subn(pattern, repl, (P4SRC / "thc_tna.p4").read_text(), flags=re.M)
    assert k == 1, f"{name}: the pattern no longer matches the program"
    assert disagreements(text), f"{name}: not caught"
