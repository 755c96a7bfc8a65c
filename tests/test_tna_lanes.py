"""Every lane of a DATA lands in its place of the RESULT on the Tofino program, run on paper
(tests/tna/passes.py): 8-bit jobs in two adding passes, 16-bit jobs in four with each index
byte doubled by the egress between them, each pass in a quarter of the words' registers of
its own. The sums must be protocol.json's RESULT: the lanes in order, big-endian, the
job's width. No compiler is needed.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.tna import passes
from thc.codec.packing import pack_bits
from thc.controller.targets import tofino
from thc.wire import protocol as P
from thc.wire.jobs import Job, Worker

TABLE = (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)


def _job(n: int, **kw) -> Job:
    workers = tuple(Worker(i, f"10.0.0.{i + 1}", 20000 + i, f"02:00:00:00:00:{i + 1:02x}",
                           256 + i) for i in range(n))
    return Job(job_id=3, workers=workers, table=TABLE, granularity=30, **kw).validate()


def aggregate(job: Job, payloads: list[bytes], seed: int, parallel: bool = True):
    """The RESULT payload the switch sends: every worker's walk, summed as the words add."""
    rng = np.random.default_rng(seed)
    walks = [passes.walk(job, p, rng, parallel) for p in payloads]
    words = sum(np.frombuffer(w.payload, ">u4").astype(np.uint64) for w in walks)
    total = (words % (1 << 32)).astype(">u4").tobytes()
    return walks, np.frombuffer(total, P.sum_dtype(job.sum_bits)).astype(np.int64)


def _indices(rng, n: int) -> np.ndarray:
    idx = rng.integers(0, 16, (n, P.LANES))
    idx[0] = 15                                            # the largest sums occur
    return idx


def _data(idx: np.ndarray) -> list[bytes]:
    return [pack_bits(row.astype(np.uint8), P.INDEX_BITS).tobytes() for row in idx]


@pytest.mark.parametrize("n_workers,sum_bits", [(1, 8), (8, 8), (9, 16), (31, 16)])
def test_every_lane_sums_into_its_place(n_workers, sum_bits):
    job = _job(n_workers)
    assert job.sum_bits == sum_bits
    rng = np.random.default_rng(n_workers)
    idx = _indices(rng, n_workers)
    walks, sums = aggregate(job, _data(idx), seed=n_workers)
    assert len(sums) == P.LANES
    np.testing.assert_array_equal(sums, np.asarray(TABLE)[idx].sum(axis=0))
    assert len(walks[0].payload) == P.payload_bytes(P.PktType.RESULT, P.LANES, sum_bits)


def test_a_16_bit_job_takes_four_adding_passes_each_in_a_quarter_of_its_own():
    job8, job16 = _job(8), _job(9)
    rng = np.random.default_rng(0)
    w8 = passes.walk(job8, _data(_indices(rng, 1))[0], rng)
    w16 = passes.walk(job16, _data(_indices(rng, 1))[0], rng)
    assert w8.passes == ["parse_idx8_1", "parse_idx8_0"] and w8.quarters == [0, 1]
    assert w16.passes == [f"parse_idx16_{k}" for k in (3, 2, 1, 0)]
    assert w16.quarters == [0, 1, 2, 3]


def test_the_doubling_reads_what_p4_reads():
    """The hardware reads an action's sources at the stage's start, P4 in statement order:
    the egress's doubling is written so that both give the same packet."""
    job = _job(12)
    rng = np.random.default_rng(5)
    payloads = _data(_indices(rng, 3))
    _, hardware = aggregate(job, payloads, seed=1)
    _, p4 = aggregate(job, payloads, seed=1, parallel=False)
    np.testing.assert_array_equal(hardware, p4)


def test_a_16_bit_lookup_returns_one_lane_of_its_byte():
    job = _job(20)
    values = [tofino.lut_values(job, h) for h in range(2)]
    assert values[0][0x3A] == TABLE[3] and values[1][0x3A] == TABLE[0xA]
    assert max(max(v) for v in values) == 30
