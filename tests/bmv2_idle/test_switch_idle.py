"""The switch's run idle rule against its clock (docs/protocol.md, runs): a run older than the
job's takes it only once the job's run has been idle for the run idle time, every packet of
the job's run keeps it live, and a run that took the job leaves the older run's slot uses as
they were for when that run takes it back."""
from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from thc.controller import counters
from thc.wire import protocol as P
from tests.bmv2.packets import check_result, random_indices, round_trip
from tests.bmv2_idle.conftest import IDLE_S

pytestmark = pytest.mark.bmv2
_ids = itertools.count(900)


def _refused_by(got, job_run):
    assert len(got) == 1, f"the older run took the job: {len(got)} replies, not a REFUSED"
    hdr = P.Header.unpack(got[0])
    assert (hdr.pkt_type, hdr.count, hdr.bitmap) == (
        P.PktType.REFUSED, P.DropReason.stale_run, job_run)


def _until(t):
    time.sleep(max(0.0, t - time.monotonic()))


def _heard(h, job, rng, seq) -> float:
    """Worker 0 of run 500 sends ``seq`` (its peer does not: no reply); when it was sent."""
    sent = time.monotonic()
    assert not any(round_trip(h, job, seq, [random_indices(rng, job)] * 2, run=500,
                              workers=[0]).values())
    return sent


def _older_run_refused_then_taking(h, job, rng, seq, heard):
    """Run 7 is refused 1.5 s before the job has been idle for the run idle time since
    ``heard``, and takes the job 1 s after: both workers get the exact sums."""
    idxs = [random_indices(rng, job) for _ in range(2)]
    _until(heard + IDLE_S - 1.5)
    before = counters.drops(h.sw)["stale_run"]
    _refused_by(round_trip(h, job, seq, idxs, run=7, workers=[1])[1], 500)
    assert counters.drops(h.sw)["stale_run"] == before + 1
    _until(heard + IDLE_S + 1.0)
    got = round_trip(h, job, seq, idxs, run=7)
    for w in range(2):
        check_result(got[w], job, seq, idxs, w)
        assert P.Header.unpack(got[w][0]).run == 7
    assert counters.drops(h.sw)["stale_run"] == before + 1


def _job(h):
    job = h.make_job(next(_ids), 2, pool_size=4)
    h.install(job)
    return job


def test_an_older_run_takes_the_job_only_after_the_run_idle_time(idle_switch):
    """Run 7, older than the job's run 500, takes the job only once it has been idle for the
    run idle time (a clock in other units, or another threshold, fails one side)."""
    job, rng = _job(idle_switch), np.random.default_rng(3)
    _older_run_refused_then_taking(idle_switch, job, rng, 1,
                                   _heard(idle_switch, job, rng, 0))


def test_every_packet_of_the_jobs_run_keeps_it_live(idle_switch):
    """The idle time counts from the job's run's last packet, not from when it took the job:
    a packet of run 500 part way keeps run 7 out past the idle time from the first."""
    job, rng = _job(idle_switch), np.random.default_rng(4)
    first = _heard(idle_switch, job, rng, 0)
    _until(first + IDLE_S - 1.5)
    _older_run_refused_then_taking(idle_switch, job, rng, 2,
                                   _heard(idle_switch, job, rng, 1))


def test_a_run_back_in_the_job_finds_its_uses_acknowledged_by_its_own_workers_only(
        idle_switch):
    """Run 6 completes seq 0; run 5 takes the idle job and completes seq 4, the other version
    of the same slot; run 6 takes it back (newer by one, within the run jump). Run 5's packets
    acknowledge nothing of run 6's use, so worker 0's seq 8 waits for worker 1 (PENDING naming
    worker 0 alone as holding seq 0's result) and worker 1's resent seq 0 still gets its sums.
    A switch that took run 5's packets as acknowledgements started seq 8 over seq 0's sums
    and refused worker 1's resend."""
    h = idle_switch
    job, rng = _job(h), np.random.default_rng(5)
    first = [random_indices(rng, job) for _ in range(2)]
    got = round_trip(h, job, 0, first, run=6)
    for w in range(2):
        check_result(got[w], job, 0, first, w)
    time.sleep(IDLE_S + 1.0)
    other = [random_indices(rng, job) for _ in range(2)]
    got = round_trip(h, job, 4, other, run=5)
    for w in range(2):
        check_result(got[w], job, 4, other, w)
        assert P.Header.unpack(got[w][0]).run == 5
    got = round_trip(h, job, 8, [random_indices(rng, job)] * 2, run=6, workers=[0])
    assert len(got[0]) == 1, "seq 8 started a new use over seq 0's instead of waiting"
    hdr = P.Header.unpack(got[0][0])
    assert (hdr.pkt_type, hdr.seq, hdr.count, hdr.bitmap, hdr.run) == (
        P.PktType.PENDING, 8, 0, 0b01, 6)
    got = round_trip(h, job, 0, first, run=6, workers=[1])
    assert not got[0]
    check_result(got[1], job, 0, first, 1)
