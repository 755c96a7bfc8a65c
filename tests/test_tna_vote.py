"""A vote job on the Tofino program, run on paper: the generated parser state, the three
spread actions of pass 0 and the words' lookups (p4src/generated/thc_tna_*.p4) are read
as text and executed here on random sign payloads, with the controller's entries for the
job (controller/targets/tofino.py); the counts must be the +1 votes of every lane
(protocol.json: the first lane in the high bit of the first byte).

Bits the program leaves undefined (index header bits that no spread writes) hold random
garbage, different for every worker: the entries must not depend on them. No compiler is
needed; the compiled program's fit is in p4src/build/tofino/REPORT.json.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from thc.controller.targets import tofino
from thc.wire import protocol as P
from thc.wire.jobs import Job, Worker

P4SRC = Path(__file__).resolve().parents[1] / "p4src"
GEN = P4SRC / "generated"
SLICE = r"hdr\.(\w+)\[(\d+)\]\.\w+\[(\d+):(\d+)\]"


def _state(name: str) -> str:
    text = (GEN / "thc_tna_parse.p4").read_text()
    return re.search(rf"state {name} \{{(.*?)\}}", text, re.S).group(1)


def sign_words() -> list[tuple[str, int]]:
    """The header each sign word of a vote DATA is extracted into, in packet order."""
    return [(m[0], int(m[1])) for m in re.findall(r"pkt\.extract\(hdr\.(\w+)\[(\d+)\]\)",
                                                   _state("parse_signs"))]


def spread_actions() -> list[list[tuple]]:
    """Each spread action: its statements, ('set', dst, hi, lo, src, hi, lo) or
    ('valid', dst), in order."""
    text = (GEN / "thc_tna_spread.p4").read_text()
    actions = []
    for body in re.findall(r"action thc_spread_\d+\(\) \{(.*?)\n    \}", text, re.S):
        stmts = []
        for line in body.strip().splitlines():
            if m := re.fullmatch(rf"\s*{SLICE} = {SLICE};", line):
                d, s = (m[1], int(m[2])), (m[5], int(m[6]))
                stmts.append(("set", d, int(m[3]), int(m[4]), s, int(m[7]), int(m[8])))
            elif m := re.fullmatch(r"\s*hdr\.(\w+)\[(\d+)\]\.setValid\(\);", line):
                stmts.append(("valid", (m[1], int(m[2]))))
            else:
                raise AssertionError(f"unexpected statement in a spread action: {line!r}")
        actions.append(stmts)
    return actions


def lookups() -> list[tuple[int, int, int, int, int, int]]:
    """Each lookup table: (word, h, index header, key hi, key lo, result hi)."""
    text = (GEN / "thc_tna_luts.p4").read_text()
    out = []
    for m in re.finditer(r"hdr\.res\[(\d+)\]\.w\[(\d+):\d+\] = value;.*?"
                         r"table thc_w(\d+)_lut_(\d).*?hdr\.cur\[(\d+)\]\.idx\[(\d+):(\d+)\]",
                         text, re.S):
        assert m[1] == str(int(m[3])), "word NN's lookups write result word NN"
        out.append((int(m[1]), int(m[4]), int(m[5]), int(m[6]), int(m[7]), int(m[2])))
    return out


def _bits(v: int, hi: int, lo: int) -> int:
    return v >> lo & ((1 << (hi - lo + 1)) - 1)


def _deposit(v: int, hi: int, lo: int, x: int) -> int:
    mask = ((1 << (hi - lo + 1)) - 1) << lo
    return v & ~mask | x << lo & mask


def run_pass0(signs: bytes, rng, sequential: bool) -> bytes:
    """A vote DATA's payload as pass 0 sends it round: parse, spread, emit."""
    phv = {(s, i): int(rng.integers(0, 1 << 32)) for s, n in (("rest", 16), ("cur", 16),
                                                               ("res", 32)) for i in range(n)}
    valid = set()
    for m, hdr in enumerate(sign_words()):
        phv[hdr] = int.from_bytes(signs[4 * m:4 * m + 4], "big")
        valid.add(hdr)
    for action in spread_actions():
        before = dict(phv)          # the hardware reads every source at the stage's start
        for st in action:
            if st[0] == "valid":
                valid.add(st[1])
                continue
            _, dst, dhi, dlo, src, shi, slo = st
            if dst not in valid:
                continue            # P4: a write to a field of an invalid header does nothing
            value = _bits((phv if sequential else before)[src], shi, slo)
            phv[dst] = _deposit(phv[dst], dhi, dlo, value)
    order = [("rest", i) for i in range(16)] + [("cur", i) for i in range(16)] \
        + [("res", i) for i in range(32)]
    return b"".join(phv[h].to_bytes(4, "big") for h in order if h in valid)


def add_pass(cur: bytes, job: Job, counts: np.ndarray) -> None:
    """One adding pass: every word's two lookups keyed on the pass's index headers."""
    values = [tofino.lut_values(job, h) for h in range(2)]
    for word, h, octet, hi, lo, res_hi in lookups():
        key = _bits(int.from_bytes(cur[4 * octet:4 * octet + 4], "big"), hi, lo)
        value = values[h][key]
        lane = 4 * word + (2 if res_hi == 15 else 0)
        counts[lane] += value >> 8
        counts[lane + 1] += value & 0xFF


def test_the_program_reads_sign_words_and_spreads_every_index_header():
    words, actions = sign_words(), spread_actions()
    assert len(words) * 32 == P.LANES
    assert len(actions) == 3
    written = {st[1] for a in actions for st in a if st[0] == "set"}
    assert len(written) == P.LANES // 8, "every index header of the packet"
    assert len(lookups()) == 2 * 32


@pytest.mark.parametrize("n_workers", [1, 5, 31])
def test_a_vote_job_counts_every_lanes_plus_ones(n_workers):
    workers = tuple(Worker(i, f"10.0.0.{i + 1}", 20000 + i, f"02:00:00:00:00:{i + 1:02x}", 256 + i)
                    for i in range(n_workers))
    job = Job.vote(6, workers).validate()
    rng = np.random.default_rng(n_workers)
    signs = rng.integers(0, 256, (n_workers, P.LANES // 8), dtype=np.uint8)
    signs[0] = 0xFF                                        # one worker votes +1 everywhere
    counts = np.zeros(P.LANES, dtype=np.int64)
    for w in range(n_workers):
        payload = run_pass0(signs[w].tobytes(), rng, sequential=False)
        assert len(payload) == P.LANES // 2
        half = len(payload) // 2
        last, first = np.zeros(128, np.int64), np.zeros(128, np.int64)
        add_pass(payload[half:], job, last)                # pass 1: lanes 128-255
        add_pass(payload[:half], job, first)               # pass 2: lanes 0-127
        counts += np.concatenate([first, last])
    np.testing.assert_array_equal(counts, np.unpackbits(signs, axis=1).sum(axis=0))


def test_the_spread_means_the_same_read_in_order_or_all_at_once():
    """bf-p4c runs an action's statements at once, P4 in order: the spread reads each sign
    word before any statement overwrites it, so both give the same packet."""
    rng = np.random.default_rng(7)
    signs = rng.integers(0, 256, P.LANES // 8, dtype=np.uint8).tobytes()
    at_once = run_pass0(signs, np.random.default_rng(1), sequential=False)
    in_order = run_pass0(signs, np.random.default_rng(1), sequential=True)
    assert at_once == in_order
