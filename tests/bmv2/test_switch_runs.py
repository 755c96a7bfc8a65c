"""Runs and epochs on the switch (P4 side of the run/epoch contract, docs/protocol.md)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from thc.controller import counters, installed
from thc.wire import protocol as P
from tests.bmv2.packets import check_result, data, random_indices, round_trip

pytestmark = pytest.mark.bmv2
_ids = itertools.count(800)


def test_replies_carry_the_job_epoch_and_each_install_draws_a_new_one(bmv2, sw):
    job = bmv2.make_job(next(_ids), 2, pool_size=4)
    rng = np.random.default_rng(0)
    epochs = []
    for seq in range(2):
        bmv2.install(job)
        epoch = installed.installed_jobs(sw)[job.job_id]["epoch"]
        assert epoch != 0
        idxs = [random_indices(rng, job) for _ in range(2)]
        got = round_trip(bmv2, job, seq, idxs, run=7)
        for w in range(2):
            check_result(got[w], job, seq, idxs, w)
            hdr = P.Header.unpack(got[w][0])
            assert (hdr.run, hdr.epoch) == (7, epoch)
        epochs.append(epoch)
    assert epochs[0] != epochs[1]


def test_a_new_run_starts_clean_and_an_older_one_is_stale(bmv2, sw):
    """Run 5 leaves a half-filled slot; run 6 reuses it from seq 0 without a reset and gets
    only its own sums; run 5's packets are then dropped as stale_run, and refused to their
    sender (REFUSED naming the job's run)."""
    job = bmv2.make_job(next(_ids), 3, pool_size=4)
    bmv2.install(job)
    rng = np.random.default_rng(1)
    old = [random_indices(rng, job) for _ in range(3)]
    got = round_trip(bmv2, job, 0, old, run=5, workers=[0, 1])
    assert not any(got.values())
    new = [random_indices(rng, job) for _ in range(3)]
    got = round_trip(bmv2, job, 0, new, run=6)
    for w in range(3):
        check_result(got[w], job, 0, new, w)
        assert P.Header.unpack(got[w][0]).run == 6
    before = counters.drops(sw)["stale_run"]
    got = round_trip(bmv2, job, 1, old, run=5, workers=[2])
    assert not got[0] and not got[1], "only the sender hears of its stale run"
    [refused] = got[2]
    hdr = P.Header.unpack(refused)
    assert (hdr.pkt_type, hdr.count, hdr.bitmap, hdr.run) == (
        P.PktType.REFUSED, P.DropReason.stale_run, 6, 5)
    assert counters.drops(sw)["stale_run"] == before + 1


def test_run_zero_is_malformed(bmv2, sw):
    job = bmv2.make_job(next(_ids), 2, pool_size=4)
    bmv2.install(job)
    before = counters.drops(sw)["malformed"]
    bmv2.endpoint(job, 0).send(data(job, 0, 0, np.zeros(job.lanes, np.uint8), run=0))
    assert bmv2.endpoint(job, 0).recv_all() == []
    assert counters.drops(sw)["malformed"] == before + 1
