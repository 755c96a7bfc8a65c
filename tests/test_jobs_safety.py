"""The controller's job safety (controller/jobs.py) on an in-memory switch
(controller/testing/memswitch.py), everywhere: the pool is reset before workers go live, live
jobs are not changed unless forced, a restarted controller leaves running jobs alone, prune
removes only what the cluster lacks, bad control input changes nothing.
tests/bmv2/test_switch_safety.py checks the same rules on BMv2, with packets."""
from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import pytest

from thc.controller import counters, forwarding, installed, job_entries, jobs, program
from thc.controller.switch import SwitchError
from thc.controller.testing.memswitch import MemorySwitch
from thc.wire import protocol as P
from thc.wire.jobs import (SWITCH_AGG_IP, SWITCH_AGG_MAC, Cluster, ConfigError, Job, Shard,
                          Worker)

TABLE = tuple(range(0, 31, 2))
IDLE = 0.05
"""live_window for jobs that send nothing: nothing moves, however long the watch."""
_addr = itertools.count(1)


@pytest.fixture
def sw():
    s = MemorySwitch().connect()
    yield s
    s.close()


def make_job(job_id: int, n_workers: int = 2, pool_size: int = 4, pool_base: int = 0,
             mac: str | None = None, **kw) -> Job:
    """Workers on switch ports 0, 1, ... with fresh addresses (worker 0's MAC: ``mac``)."""
    workers = []
    for i in range(n_workers):
        k = next(_addr)
        workers.append(Worker(i, f"10.{1 + i}.{k >> 8}.{k & 0xFF}", 20000 + k,
                              (i == 0 and mac) or f"02:00:00:{i:02x}:{k >> 8:02x}:{k & 0xFF:02x}",
                              i))
    return Job(job_id=job_id, workers=tuple(workers), table=TABLE, granularity=30,
               pool_size=pool_size, pool_base=pool_base, lanes=256, **kw).validate()


def cluster(*js: Job) -> Cluster:
    return Cluster(jobs=js, agg_ip=SWITCH_AGG_IP, agg_mac=SWITCH_AGG_MAC)


def ops(events, op: str, table: str | None = None) -> list[int]:
    """Positions of the events of ``op`` (on the table with this short name)."""
    return [i for i, e in enumerate(events) if e.op == op
            and (table is None or str(e.target).rsplit(".", 1)[-1] == table)]


# ---- reset before live ----------------------------------------------------------------------

def test_worker_entries_go_live_only_after_the_whole_pool_was_reset(sw):
    job = make_job(1, pool_size=4)
    index = jobs.install_job(sw, job)
    log = sw.device.log
    workers, resets = ops(log, "INSERT", "thc_worker"), ops(log, "PACKET_OUT")
    cleared = ops(log, "COUNTER_RESET", counters.JOB_COUNTERS)
    assert len(workers) == 2 and len(resets) == 8
    assert max(resets) < min(workers) and max(cleared) < min(workers)
    assert workers == list(range(len(log) - 2, len(log))), "worker entries go in last"
    assert sorted(sw.device.slot_resets) == [(1, s, v) for s in range(4) for v in (0, 1)]
    assert counters.resets(sw, index) == 8


def test_reinstall_takes_the_old_workers_off_first_then_resets_again(sw):
    job = make_job(1)
    jobs.install_job(sw, job)
    sw.device.deliver(job, 0, n=3)
    assert counters.job_counters(sw, 0)["packets"] == 3
    mark = len(sw.device.log)
    jobs.install_job(sw, job, live_window=IDLE)
    events = sw.device.log[mark:]
    assert events[0].op == "DELETE" and events[0].target.endswith("thc_worker")
    assert ops(events, "DELETE", "thc_worker") == [0, 1]
    assert max(ops(events, "PACKET_OUT")) < min(ops(events, "INSERT", "thc_worker"))
    assert len(sw.device.slot_resets) == 16 and counters.resets(sw, 0) == 16
    assert counters.job_counters(sw, 0)["packets"] == 0, "counters zeroed on re-install"


def test_a_reinstall_on_another_pool_resets_the_new_pools_cells(sw):
    """The RESETs clear the cells of the pool the job entry names when they run: a
    re-install onto another pool must write the job entry first, or it clears the old
    pool's cells and its workers meet whatever the new pool's cells hold."""
    job = make_job(1, pool_size=4)
    jobs.install_job(sw, job)
    moved = replace(job, pool_base=64).validate()
    mark = len(sw.device.reset_cells)
    jobs.install_job(sw, moved, live_window=IDLE)
    assert sorted(sw.device.reset_cells[mark:]) == [(64 + s) * 2 + v for s in range(4)
                                                    for v in (0, 1)]


def test_counters_a_target_cannot_zero_are_named(sw):
    """A target that refuses counter writes: the job is installed, and the install says its
    counters go on from an earlier job's (they were silently left before)."""
    job = make_job(1)
    jobs.install_job(sw, job)
    sw.device.deliver(job, 0, n=3)
    sw.device.counter_writes = False
    with pytest.warns(RuntimeWarning, match="did not zero the counters of job index 0"):
        jobs.install_job(sw, job, live_window=IDLE)
    assert counters.job_counters(sw, 0)["packets"] == 3
    assert installed.installed_jobs(sw)[job.job_id]["job_index"] == 0


def test_a_refused_counter_write_stops_the_install_before_its_workers(sw, monkeypatch):
    """A counter write the switch refused (not one it cannot do): the install fails, naming
    it, and the job's workers are not installed (no chunk can complete)."""
    job = make_job(1)
    jobs.install_job(sw, job)
    sw.device.deliver(job, 0, n=3)

    def refused(name, indices):
        raise SwitchError("MODIFY failed for 1 of 8 entries; first: RESOURCE_EXHAUSTED")
    monkeypatch.setattr(sw.device, "reset_counter", refused)
    with pytest.raises(SwitchError, match=r"job 1: the install stopped part-way \(MODIFY "
                                          r"failed for 1 of 8 entries; first: RESOURCE_EX"):
        jobs.install_job(sw, job, live_window=IDLE)
    assert not installed.entries_of(sw, program.WORKER_TABLE, job.job_id)


def test_workers_never_go_live_when_the_resets_are_lost(sw, monkeypatch):
    sw.device.cpu_port = False             # simple_switch_grpc without --cpu-port
    monkeypatch.setattr(jobs, "reset_pool", functools.partial(jobs.reset_pool, timeout=0.05))
    with pytest.raises(SwitchError, match="only 0 of 8 slot resets"):
        jobs.install_job(sw, make_job(1))
    assert ops(sw.device.log, "INSERT", "thc_worker") == []
    assert not installed.entries_of(sw, program.WORKER_TABLE, 1)


def test_workers_never_go_live_when_some_resets_are_lost(sw, monkeypatch):
    """Every other RESET lost: the slot versions they name keep what an earlier install
    left there, so the workers must not go live on a count short of 2 x pool."""
    sent, deliver = itertools.count(), sw.device.packet_out
    monkeypatch.setattr(sw.device, "packet_out",
                        lambda frame: None if next(sent) % 2 else deliver(frame))
    monkeypatch.setattr(jobs, "reset_pool", functools.partial(jobs.reset_pool, timeout=0.05))
    with pytest.raises(SwitchError, match="only 4 of 8 slot resets"):
        jobs.install_job(sw, make_job(1))
    assert ops(sw.device.log, "INSERT", "thc_worker") == []
    assert not installed.entries_of(sw, program.WORKER_TABLE, 1)


def test_resets_still_queued_from_a_job_never_clear_the_job_that_takes_its_pool(sw,
                                                                                 monkeypatch):
    """Job 2's re-install timed out with its RESETs queued on the CPU path (its thc_install
    entry still naming that install). A cluster install then moved job 1 onto job 2's old
    pool and job 2 elsewhere, job 1 written first: the queued RESETs, arriving while job 2
    was rewritten, ran under job 2's old entries and cleared job 1's live slots."""
    one, two = make_job(1, pool_base=0), make_job(2, pool_base=4)
    jobs.install_cluster(sw, cluster(one, two))
    queued, deliver = [], sw.device.packet_out
    monkeypatch.setattr(sw.device, "packet_out", queued.append)
    with monkeypatch.context() as m:
        m.setattr(jobs, "reset_pool", functools.partial(jobs.reset_pool, timeout=0.05))
        with pytest.raises(SwitchError, match="slot resets"):
            jobs.install_job(sw, replace(two, table=TABLE[::-1]).validate(), live_window=IDLE)
    stale = len(queued)
    monkeypatch.setattr(sw.device, "packet_out", deliver)
    write = jobs._write_job

    def catching_up(switch, job, *args):
        if job.job_id == 2:     # the CPU path catches up while job 2 is rewritten
            for frame in queued:
                deliver(frame)
        write(switch, job, *args)
    monkeypatch.setattr(jobs, "_write_job", catching_up)
    drops, mark = counters.drops(sw)["stale_reset"], len(sw.device.reset_cells)
    jobs.install_cluster(sw, cluster(replace(one, pool_base=4).validate(),
                                     replace(two, pool_base=8).validate()), live_window=IDLE)
    ones = {(4 + slot) * 2 + version for slot in range(4) for version in (0, 1)}
    cleared = [cell for (job_id, _s, _v), cell in zip(sw.device.slot_resets[mark:],
                                                      sw.device.reset_cells[mark:])
               if job_id == 2 and cell in ones]
    assert cleared == [] and counters.drops(sw)["stale_reset"] - drops == stale == 8, cleared


# ---- live jobs ------------------------------------------------------------------------------

@pytest.mark.parametrize("cell", P.JOB_COUNTERS)
def test_live_job_is_not_reinstalled_or_removed_unless_forced(sw, cell):
    """Live whatever its packets do: the switch counts each in one cell, by what it did (a
    job whose every packet completes a chunk moves its completions alone)."""
    job = make_job(1)
    jobs.install_job(sw, job)
    before, mark = sw.device.state(), len(sw.device.log)
    smaller = replace(job, workers=job.workers[:1])
    with sw.device.sending(job, cell=cell):
        with pytest.raises(jobs.JobLive, match=r"job 1 is live: \d+ packets"):
            jobs.install_job(sw, smaller)
        with pytest.raises(jobs.JobLive, match=r"job 1 is live.*removing it"):
            jobs.remove_job(sw, job.job_id)
        with pytest.raises(jobs.JobLive, match="job 1 is live"):
            jobs.install_cluster(sw, cluster(smaller))
        assert sw.device.log[mark:] == [] and sw.device.state() == before
        jobs.install_job(sw, smaller, force=True)
    assert installed.installed_jobs(sw)[1]["n_workers"] == 1
    jobs.remove_job(sw, 1, live_window=IDLE)      # idle now: allowed without force
    assert installed.installed_jobs(sw) == {}


def test_only_the_jobs_to_change_are_watched_and_a_live_pruned_job_is_kept(sw):
    a, b = make_job(1), make_job(2, pool_base=4)
    jobs.install_cluster(sw, cluster(a, b))
    b_state = {t: installed.entries_of(sw, t, 2) for t in (program.JOB_TABLE, program.WORKER_TABLE)}
    resets = len(sw.device.slot_resets)
    with sw.device.sending(b):
        jobs.remove_job(sw, a.job_id, live_window=IDLE)   # b's traffic does not block a
        with pytest.raises(jobs.JobLive, match="job 2 is live.*changing or removing it"):
            jobs.install_cluster(sw, cluster(), prune=True)
    assert set(installed.installed_jobs(sw)) == {2}
    assert {t: installed.entries_of(sw, t, 2) for t in b_state} == b_state
    assert len(sw.device.slot_resets) == resets


def test_prune_removes_the_jobs_the_cluster_lacks_and_leaves_the_rest(sw):
    a, b = make_job(1), make_job(2, pool_base=4)
    jobs.install_cluster(sw, cluster(a, b))
    epoch = installed.installed_jobs(sw)[1]["epoch"]
    kept = jobs.install_cluster(sw, cluster(a), live_window=IDLE)
    assert set(installed.installed_jobs(sw)) == {1, 2}, "without prune, other jobs stay"
    mark = len(sw.device.log)
    assert jobs.install_cluster(sw, cluster(a), prune=True, live_window=IDLE) == kept
    assert set(installed.installed_jobs(sw)) == {1}
    assert installed.installed_jobs(sw)[1]["epoch"] == epoch
    assert ops(sw.device.log[mark:], "PACKET_OUT") == []
    assert 2 not in sw.multicast_groups() and not installed.entries_of(sw, program.ADDR_TABLE, 2)
    assert all(b.workers[i].mac not in forwarding.routes(sw) for i in range(2))


# ---- restart --------------------------------------------------------------------------------

def test_restarted_controller_leaves_a_running_job_alone(sw):
    job = make_job(1)
    placed = jobs.install_cluster(sw, cluster(job))
    sw.device.deliver(job, 0)                      # worker 0 is mid-round
    epoch = installed.installed_jobs(sw)[1]["epoch"]
    sw.close()
    restarted = MemorySwitch(device=sw.device).connect(program=None)
    agg = job_entries.AggAddress()
    assert installed.unchanged(restarted, job, agg)
    assert not installed.unchanged(restarted, replace(job, table=tuple(reversed(job.table))), agg)
    assert not installed.unchanged(restarted, replace(job, workers=job.workers[:1]), agg)
    assert not installed.unchanged(restarted, replace(job, mcast_grp=99), agg)
    mark = len(sw.device.log)
    with sw.device.sending(job):                  # and it keeps running: no force needed
        assert jobs.install_cluster(restarted, cluster(job)) == placed
    assert sw.device.log[mark:] == [], "no write, no reset"
    assert installed.installed_jobs(restarted)[1]["epoch"] == epoch
    assert counters.job_counters(restarted, placed[1])["packets"] == 1, "no counter clear"


# ---- bad input changes nothing ----------------------------------------------------------------

def bad_inputs(job: Job, other: Job) -> dict:
    """{case: (error, message, action)}: control input refused with ``job`` installed."""
    w, o = job.workers[0], other.workers

    def worker0(**kw):
        return replace(other, workers=(replace(o[0], **kw), o[1]))

    def install(j, **kw):
        return lambda sw: jobs.install_job(sw, j, **kw)
    return {
        "remove_unknown": (jobs.JobNotInstalled, "job 999 is not installed",
                           lambda sw: jobs.remove_job(sw, 999)),
        "ip_port_taken": (ConfigError, f"{w.ip}:{w.port} is used by a worker of job 1",
                          install(worker0(ip=w.ip, port=w.port))),
        "mac_on_two_hosts": (ConfigError, f"MAC {w.mac}", install(worker0(mac=w.mac))),
        "mac_on_two_hosts_cluster": (ConfigError, f"MAC {w.mac}", lambda sw:
                                     jobs.install_cluster(sw, cluster(worker0(mac=w.mac)))),
        "table_value": (ConfigError, "table values must lie in 0..30",
                        install(replace(other, table=(31,) + other.table[1:]))),
        "sum_overflow": (ConfigError, "overflows", install(replace(other, granularity=40000))),
        "lanes": (ConfigError, "lanes", install(replace(other, lanes=128))),
        "pool_outside_slots": (ConfigError, "slots",
                               install(replace(other, pool_base=P.SWITCH_SLOTS - 2))),
        "pool_overlap": (ConfigError, "overlaps job", install(replace(other, pool_base=2))),
        "pool_overlap_of_one_slot": (ConfigError, "overlaps job", install(
            replace(other, pool_base=job.pool_base + job.pool_size - 1))),
        "pool_one_slot_outside_slots": (ConfigError, "slots", install(
            replace(other, pool_base=P.SWITCH_SLOTS - other.pool_size + 1))),
        "mcast_group_taken": (ConfigError, "multicast group",
                              install(replace(other, mcast_grp=job.mcast_grp))),
        "job_index_taken": (ConfigError, "job index 0 is taken", install(other, job_index=0)),
        # int() wrote a fraction on job 1's index, its lookup entries under its workers
        "job_index_fraction": (ConfigError, "job index 0.5 is not an integer",
                               install(other, job_index=0.5)),
        "job_index_bool": (ConfigError, "job index True is not an integer",
                           install(other, job_index=True)),
        "cpu_port": (ConfigError, "not a front-panel port", install(worker0(
            switch_port=P.CPU_PORT))),
        "pool_overlap_cluster": (ConfigError, "overlap", lambda sw: jobs.install_cluster(
            sw, cluster(job, replace(other, pool_base=job.pool_base)))),
        "cluster_whose_last_job_clashes": (ConfigError, f"MAC {w.mac}", lambda sw:
                                           jobs.install_cluster(sw, cluster(
                                               other, make_job(3, pool_base=16, mac=w.mac)))),
        # unchecked, these would fail part-way, after thousands of writes (or, re-installing,
        # after the job's worker entries were taken off)
        "malformed_mac_reinstall": (ConfigError, "MAC '02:00:00:00:00' is not six hex bytes",
                                    install(replace(job, workers=(
                                        replace(w, mac="02:00:00:00:00"), job.workers[1])))),
        "mcast_group_beyond_bmv2": (ConfigError, r"multicast group 40000 outside 1\.\.32767",
                                    install(replace(other, mcast_grp=40000))),
        "mcast_group_negative": (ConfigError, "multicast group -1 outside",
                                 install(replace(other, mcast_grp=-1))),
        "agg_mac": (ConfigError, "the aggregator: MAC 'not-a-mac'", lambda sw:
                    jobs.install_cluster(sw, replace(cluster(other), agg_mac="not-a-mac"))),
        "switch_port_drop": (ConfigError, "switch_port 511 is not a front-panel port",
                             install(worker0(switch_port=511))),
        "switch_port_text": (ConfigError, "switch_port '3' is not an integer",
                             install(worker0(switch_port="3"))),
        # a loopback testbed's cluster: no round of the job could complete
        "worker_ip_loopback": (ConfigError, "ip 127.0.0.2 is a loopback address",
                               install(worker0(ip="127.0.0.2"))),
        # the switch refuses no chunk as another shard's (the model's wrong_shard)
        "shard_map": (ConfigError, "spread over 2 software aggregator shards",
                      install(replace(other, shards=(Shard("10.9.0.1", 48879),
                                                     Shard("10.9.0.2", 48879))).validate())),
    }


BAD_INPUTS = list(bad_inputs(make_job(1), make_job(2)))


@pytest.fixture(scope="module")
def two_jobs():
    """A switch holding ``job``, and ``other`` to install beside it (bad inputs change
    nothing, so the cases share it)."""
    sw = MemorySwitch().connect()
    job, other = make_job(1), make_job(2, pool_base=8)
    jobs.install_job(sw, job)
    yield sw, job, other
    sw.close()


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_control_input_changes_nothing(two_jobs, case):
    sw, job, other = two_jobs
    error, match, act = bad_inputs(job, other)[case]
    before, mark = sw.device.state(), len(sw.device.log)
    with pytest.raises(error, match=match):
        act(sw)
    assert sw.device.log[mark:] == [] and sw.device.state() == before


def test_removing_a_job_twice_is_refused_the_second_time(sw):
    jobs.install_job(sw, make_job(1))
    jobs.remove_job(sw, 1, live_window=IDLE)
    mark = len(sw.device.log)
    with pytest.raises(jobs.JobNotInstalled, match="job 1 is not installed"):
        jobs.remove_job(sw, 1)
    assert sw.device.log[mark:] == []


# ---- jobs rewritten together --------------------------------------------------------------

def counting(sw) -> dict[int, tuple[range, int]]:
    """{job_id: (slots, multicast group)} of the jobs whose packets count: every worker
    entry in place."""
    return {jid: (range(c["pool_base"], c["pool_base"] + c["pool_size"]), c["mcast_grp"])
            for jid, c in installed.installed_jobs(sw).items()
            if len(installed.worker_entries_of(sw, jid)) == c["n_workers"]}


def assert_apart(live: dict[int, tuple[range, int]]) -> None:
    for a, b in itertools.combinations(sorted(live), 2):
        (slots_a, grp_a), (slots_b, grp_b) = live[a], live[b]
        assert not set(slots_a) & set(slots_b), f"jobs {a} and {b} count on the same slots"
        assert grp_a != grp_b, f"jobs {a} and {b} multicast to group {grp_a}"


@pytest.mark.parametrize("fail", [None, "first", "second"])
def test_jobs_that_swap_pools_never_count_on_the_same_slots(sw, monkeypatch, fail):
    """install_cluster rewrote jobs one at a time: after the first job took the second's
    pool and group, both counted on slots 4..7 until the second was rewritten, and for
    good when that write failed (its results then went to the first job's ports)."""
    a, b = make_job(1, pool_base=0), make_job(2, pool_base=4)
    jobs.install_cluster(sw, cluster(a, b))
    seen = []
    write_job = jobs._write_job

    def lose_the_switch():
        monkeypatch.setattr(sw.device, "write", lambda *a: (_ for _ in ()).throw(
            SwitchError("UNAVAILABLE: connection reset")))

    def watched(sw_, job, *args):
        seen.append(counting(sw_))
        if fail == "first":
            lose_the_switch()
        write_job(sw_, job, *args)
        seen.append(counting(sw_))
        if fail == "second":
            lose_the_switch()
    monkeypatch.setattr(jobs, "_write_job", watched)
    swapped = cluster(replace(a, pool_base=4, mcast_grp=2), replace(b, pool_base=0, mcast_grp=1))
    if fail is None:
        jobs.install_cluster(sw, swapped, live_window=IDLE)
        assert counting(sw) == {1: (range(4, 8), 2), 2: (range(0, 4), 1)}
    else:
        message = (r"job 1: the install stopped part-way.*Jobs \[2\], to be written after it, "
                   r"have no worker entries either" if fail == "first"
                   else r"job 2: the install stopped part-way")
        with pytest.raises(SwitchError, match=message):
            jobs.install_cluster(sw, swapped, live_window=IDLE)
        seen.append(counting(sw))
        assert seen[-1] == ({} if fail == "first" else {1: (range(4, 8), 2)})
    for live in seen:
        assert_apart(live)


@pytest.mark.parametrize("then", ["prune", "remove", "again", "alone"])
def test_a_swap_cut_short_then_undone_keeps_the_live_jobs_group(sw, monkeypatch, then):
    """A swap of two jobs' pools and groups cut short after the first write leaves job 1
    live on group 2 and job 2's stale entry naming group 2 too. Removing job 2 (pruned,
    removed, or rewritten by the install the error advises) deleted group 2: job 1's
    results went nowhere while the install reported it unchanged."""
    a, b = make_job(1, pool_base=0), make_job(2, pool_base=4)
    jobs.install_cluster(sw, cluster(a, b))
    write_job = jobs._write_job

    def cut_before_the_second(sw_, job, *args):
        if job.job_id == 2:
            raise SwitchError("UNAVAILABLE: controller killed")
        write_job(sw_, job, *args)
    monkeypatch.setattr(jobs, "_write_job", cut_before_the_second)
    a2, b2 = replace(a, pool_base=4, mcast_grp=2), replace(b, pool_base=0, mcast_grp=1)
    with pytest.raises(SwitchError, match="controller killed"):
        jobs.install_cluster(sw, cluster(a2, b2), live_window=IDLE)
    monkeypatch.setattr(jobs, "_write_job", write_job)
    assert {c["mcast_grp"] for c in installed.installed_jobs(sw).values()} == {2}
    if then == "prune":
        jobs.install_cluster(sw, cluster(a2), prune=True, live_window=IDLE)
    elif then == "remove":
        jobs.remove_job(sw, 2, live_window=IDLE)
    elif then == "alone":          # job 1 stays, unnamed: its group is still in use
        jobs.install_cluster(sw, cluster(b2), live_window=IDLE)
    else:
        jobs.install_cluster(sw, cluster(a2, b2), live_window=IDLE)
    assert 2 in sw.multicast_groups(), "job 1's results are multicast to a deleted group"
    assert installed.unchanged(sw, a2, jobs.AggAddress.of(cluster(a2)))
    assert counting(sw) == ({1: (range(4, 8), 2), 2: (range(0, 4), 1)}
                            if then in ("again", "alone") else {1: (range(4, 8), 2)})


def test_a_fresh_install_takes_a_leftover_jobs_worker_entries_off(sw):
    """A job id left without its job entry kept its thc_worker entries through a fresh
    install: the old hosts counted as the new job's workers."""
    old = make_job(1)
    jobs.install_job(sw, old)
    job_entries.delete(sw, [sw.table_entry(program.JOB_TABLE, {"job_id": 1})])
    assert 1 in installed.leftovers(sw)
    new = make_job(1)
    jobs.install_cluster(sw, cluster(new), live_window=IDLE)
    assert len(installed.worker_entries_of(sw, 1)) == 2
    sw.device.deliver(old, 0)
    assert counters.drops(sw)["unknown_worker"] == 1
    assert counters.job_counters(sw, 0)["packets"] == 0


def test_a_job_moved_to_another_index_leaves_its_old_one_whole_on_a_tofino(monkeypatch):
    """A Tofino keys its lookup entries on the job's index: moving a job left its old
    entries, and with the tables full (four jobs) the move, the retry the error advised and
    the cluster's install all failed part-way."""
    from thc.controller.switch import BUILD_DIR
    from thc.controller.testing.memswitch import MemoryDevice
    sw = MemorySwitch(device=MemoryDevice(program="thc_tna", build_dir=BUILD_DIR / "tofino")
                      ).connect(program=None)
    try:
        js = [replace(make_job(i + 1, pool_base=8 * i),
                      workers=tuple(replace(w, switch_port=256 + w.id)
                                    for w in make_job(i + 1).workers)) for i in range(4)]
        assert [jobs.install_job(sw, j, live_window=IDLE) for j in js] == [0, 1, 2, 3]
        tables = installed.lut_tables(sw)
        full = {t: len(installed.lut_entries_of(sw, t, 1, 0)) for t in tables[:1]}
        assert jobs.install_job(sw, js[0], job_index=5, live_window=IDLE) == 5
        assert {t: len(installed.lut_entries_of(sw, t, 1, 0)) for t in tables[:1]} == \
            dict.fromkeys(full, 0)
        assert {t: len(installed.lut_entries_of(sw, t, 1, 5)) for t in tables[:1]} == full
        assert installed.unchanged(sw, js[0], jobs.AggAddress.of(cluster(*js)))
        assert jobs.install_cluster(sw, cluster(*js), live_window=IDLE)[1] == 5
        # the move keeps the job's last epoch to differ from, whatever the draw
        last = installed.installed_jobs(sw)[1]["epoch"]
        draws = iter([(last & P.NONCE_MASK) - 1, 6])
        monkeypatch.setattr(P.secrets, "randbelow", lambda n: next(draws))
        jobs.install_job(sw, js[0], job_index=6, live_window=IDLE)
        assert installed.installed_jobs(sw)[1]["epoch"] != last
    finally:
        sw.close()


@pytest.mark.parametrize("how", ["cluster", "job", "remove"])
def test_a_plan_is_refused_when_another_controller_wrote_during_the_live_watch(sw, monkeypatch,
                                                                              how):
    """A controller of another election id installed job 2 on slots 8..11 while this one
    watched job 1 for live workers; this one then wrote its plan, read before the watch
    (job 1 grown to slots 0..15), and reset job 2's slots: two jobs on the same slots."""
    one = make_job(1, pool_size=4)
    jobs.install_job(sw, one, live_window=IDLE)
    grown = replace(one, pool_size=16).validate()
    other = make_job(2, pool_size=4, pool_base=8)
    real = jobs.live_jobs

    def watch_while_another_writes(*args):
        jobs.install_job(sw, other)
        return real(*args)
    monkeypatch.setattr(jobs, "live_jobs", watch_while_another_writes)
    with pytest.raises(SwitchError, match=r"jobs \[2\] changed on the switch while this "
                                          r"controller watched"):
        if how == "cluster":
            jobs.install_cluster(sw, cluster(grown), live_window=IDLE)
        elif how == "job":
            jobs.install_job(sw, grown, live_window=IDLE)
        else:
            jobs.remove_job(sw, 1, live_window=IDLE)
    assert installed.installed_jobs(sw)[1]["pool_size"] == 4
    assert installed.installed_jobs(sw)[2]["pool_base"] == 8


def test_a_remove_takes_the_workers_off_before_anything_else(sw):
    """A (forced) remove of a job whose workers are sending takes their worker entries off
    first: from then on the job's packets drop, instead of adding what its lookups, group
    and routes (deleted one by one, or left half-deleted by a remove cut short) no longer
    give."""
    job = make_job(1)
    jobs.install_job(sw, job)
    mark = len(sw.device.log)
    with sw.device.sending(job):
        jobs.remove_job(sw, job.job_id, force=True)
    events = sw.device.log[mark:]
    workers = ops(events, "DELETE", "thc_worker")
    others = [i for i, e in enumerate(events)
              if e.op in ("DELETE", "GROUP_DELETE") and i not in workers]
    assert len(workers) == 2 and others and max(workers) < min(others)


def test_a_job_whose_group_or_route_changed_on_the_switch_is_written_again(sw):
    """unchanged() compares the multicast group's replicas and the workers' routes: a job
    whose group lost a replica, or whose worker's route points at another port, is not left
    alone by install_cluster (results would not reach that worker: it waits to its deadline
    while the controller reports the job installed)."""
    job = make_job(1)
    jobs.install_cluster(sw, cluster(job))
    agg, w = job_entries.AggAddress(), job.workers[1]
    assert installed.unchanged(sw, job, agg)
    sw.set_multicast_group(job.mcast_grp, [(job.workers[0].switch_port, 1)])
    assert not installed.unchanged(sw, job, agg)
    jobs.install_cluster(sw, cluster(job), live_window=IDLE)
    assert sw.multicast_groups()[job.mcast_grp] == {(v.switch_port, v.id + 1)
                                                    for v in job.workers}
    forwarding.install(sw, {w.mac: w.switch_port + 5})
    assert not installed.unchanged(sw, job, agg)
    jobs.install_cluster(sw, cluster(job), live_window=IDLE)
    assert forwarding.routes(sw)[w.mac.lower()] == w.switch_port


@pytest.mark.parametrize("at", [0.5, 0.9999])
def test_a_reinstall_cut_short_and_retried_keeps_no_old_group_or_route(sw, monkeypatch, at):
    """A re-install that moves the job's group and a worker's MAC, its writes failing after
    ``at`` of them: the old group and route were deleted only after every write, and the
    retry, reading the new ones back as the previous, never deleted them."""
    old = make_job(1, n_workers=3)
    new = replace(old, mcast_grp=9, workers=(replace(old.workers[0], mac="02:aa:00:00:00:01"),
                                              old.workers[1])).validate()
    jobs.install_job(sw, old)
    real, made = sw.device.write, [0]

    def counted(*a):
        made[0] += 1
        return real(*a)
    monkeypatch.setattr(sw.device, "write", counted)
    jobs.install_job(sw, new, live_window=IDLE)
    jobs.install_job(sw, old, live_window=IDLE)
    budget = [int(made[0] / 2 * at)]

    def failing(*a):
        budget[0] -= 1
        if budget[0] < 0:
            raise SwitchError("UNAVAILABLE: connection reset")
        return real(*a)
    monkeypatch.setattr(sw.device, "write", failing)
    with pytest.raises(SwitchError, match="the install stopped part-way"):
        jobs.install_job(sw, new, live_window=IDLE)
    monkeypatch.setattr(sw.device, "write", real)
    jobs.install_job(sw, new, live_window=IDLE)
    assert sorted(sw.multicast_groups()) == [9]
    assert sorted(forwarding.routes(sw)) == sorted(w.mac for w in new.workers)
    jobs.remove_job(sw, 1, live_window=IDLE)
    assert sw.multicast_groups() == {} and forwarding.routes(sw) == {}


def test_jobs_that_share_an_index_are_refused_before_any_write():
    """Two job entries on one index (another controller's, or a hand's) share a Tofino's
    lookup entries: an install that moved one took the other's lookups off with its own."""
    from thc.controller.switch import BUILD_DIR
    from thc.controller.testing.memswitch import MemoryDevice
    sw = MemorySwitch(device=MemoryDevice(program="thc_tna", build_dir=BUILD_DIR / "tofino")
                      ).connect(program=None)
    try:
        a, b = (replace(make_job(i + 1, pool_base=8 * i),
                        workers=tuple(replace(w, switch_port=256 + 2 * i + w.id)
                                      for w in make_job(i + 1).workers)) for i in range(2))
        jobs.install_cluster(sw, cluster(a, b))
        epoch = installed.installed_jobs(sw)[2]["epoch"]
        job_entries.upsert(sw, [job_entries.job_entry(sw, b, 0, epoch)], True)
        before, mark = sw.device.state(), len(sw.device.log)
        for act in (lambda: jobs.install_cluster(sw, cluster(a), live_window=IDLE),
                    lambda: jobs.install_cluster(sw, cluster(b), prune=True, live_window=IDLE)):
            with pytest.raises(ConfigError, match=r"job [12] shares job index 0 with job [12]"):
                act()
        assert sw.device.log[mark:] == [] and sw.device.state() == before
    finally:
        sw.close()
