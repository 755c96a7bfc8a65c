"""Two jobs on one BMv2 switch: no interference, and no worker reaches another job's slots."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from thc.controller import counters
from tests.bmv2.packets import check_result, data, random_indices, round_trip

pytestmark = pytest.mark.bmv2
_ids = itertools.count(600)
OTHER_TABLE = [0, 2, 3, 5, 7, 9, 12, 13, 17, 18, 21, 23, 25, 27, 28, 30]


def test_interleaved_jobs_with_the_same_slots_do_not_interfere(bmv2):
    rng = np.random.default_rng(20)
    a = bmv2.make_job(next(_ids), 3, pool_size=4)
    b = bmv2.make_job(next(_ids), 2, pool_size=4, table=OTHER_TABLE)
    bmv2.install(a)
    bmv2.install(b)
    assert a.pool_base != b.pool_base
    ia = {s: [random_indices(rng, a) for _ in range(3)] for s in range(4)}
    ib = {s: [random_indices(rng, b) for _ in range(2)] for s in range(4)}
    # both jobs use slots 0..3 at the same time, every packet interleaved
    for seq in range(4):
        for w in range(3):
            bmv2.endpoint(a, w).send(data(a, w, seq, ia[seq][w]))
            if w < 2:
                bmv2.endpoint(b, w).send(data(b, w, seq, ib[seq][w]))
    for job, chunks in ((a, ia), (b, ib)):
        for w in range(job.n_workers):
            got = bmv2.endpoint(job, w).recv_all()
            by_seq = {}
            for d in got:
                by_seq.setdefault(int.from_bytes(d[8:12], "big"), []).append(d)
            assert sorted(by_seq) == [0, 1, 2, 3]
            for seq, ds in by_seq.items():
                check_result(ds, job, seq, chunks[seq], w)


def test_worker_of_one_job_cannot_touch_the_other_jobs_slots(bmv2, sw):
    rng = np.random.default_rng(21)
    a = bmv2.make_job(next(_ids), 2, pool_size=4)
    b = bmv2.make_job(next(_ids), 2, pool_size=4, table=OTHER_TABLE)
    bmv2.install(a)
    bmv2.install(b)
    ib = [random_indices(rng, b) for _ in range(2)]
    bmv2.endpoint(b, 0).send(data(b, 0, 0, ib[0]))          # b's slot 0 half full
    before = counters.drops(sw)
    attacker = bmv2.endpoint(a, 1)
    # a's worker 1 claims to be b's worker 1, 0, then an id outside b, then slot outside b
    attacker.send(data(b, 1, 0, np.full(b.lanes, 15, np.uint8), job_id=b.job_id))
    attacker.send(data(b, 0, 0, np.full(b.lanes, 15, np.uint8), job_id=b.job_id))
    attacker.send(data(b, 2, 0, np.full(b.lanes, 15, np.uint8), job_id=b.job_id))
    attacker.send(data(b, 1, 0, np.full(b.lanes, 15, np.uint8), job_id=b.job_id,
                       slot=b.pool_size))
    assert attacker.recv_all() == []
    after = counters.drops(sw)
    changed = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert changed == {"unknown_worker": 3, "worker_outside_job": 1}
    # b's slot is untouched: completing it gives exactly b's sums
    got = round_trip(bmv2, b, 0, ib, workers=[1])
    for w in range(2):
        check_result(got[w], b, 0, ib, w)
    assert not bmv2.endpoint(a, 0).recv_all()
