"""The controller's job safety (controller/jobs.py, issue 8) on an in-memory switch, everywhere:
the pool is reset before workers go live, live jobs are not changed unless forced, a
restarted controller leaves running jobs alone, bad control input changes nothing, removal
is complete. tests/bmv2/test_switch_safety.py and test_switch_controller.py check the same
rules on BMv2, with packets."""
from __future__ import annotations

import argparse
import functools
import itertools
import json
from dataclasses import replace

import pytest

from controller import cli, counters, forwarding, jobs
from controller.switch import Switch, SwitchError
from controller.testing.memswitch import MemoryDevice, MemorySwitch
from host.wire import protocol as P
from host.wire.jobs import Cluster, ConfigError, Job, Worker

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
             **kw) -> Job:
    workers = []
    for i in range(n_workers):
        k = next(_addr)
        workers.append(Worker(i, f"10.{1 + i}.{k >> 8}.{k & 0xFF}", 20000 + k,
                              f"02:00:00:{i:02x}:{k >> 8:02x}:{k & 0xFF:02x}", i))
    return Job(job_id=job_id, workers=tuple(workers), table=TABLE, granularity=30,
               pool_size=pool_size, pool_base=pool_base, lanes=256, **kw).validate()


def cluster(*js: Job) -> Cluster:
    return Cluster(jobs=js, agg_ip=jobs.SWITCH_AGG_IP, agg_mac=jobs.SWITCH_AGG_MAC)


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


def test_workers_never_go_live_when_the_resets_are_lost(sw, monkeypatch):
    sw.device.cpu_port = False             # simple_switch_grpc without --cpu-port
    monkeypatch.setattr(jobs, "reset_pool", functools.partial(jobs.reset_pool, timeout=0.05))
    with pytest.raises(SwitchError, match="only 0 of 8 slot resets"):
        jobs.install_job(sw, make_job(1))
    assert ops(sw.device.log, "INSERT", "thc_worker") == []
    assert not jobs._job_entries(sw, jobs.WORKER_TABLE, 1)


# ---- live jobs ------------------------------------------------------------------------------

def test_live_job_is_not_reinstalled_or_removed_unless_forced(sw):
    job = make_job(1)
    jobs.install_job(sw, job)
    before, mark = sw.device.state(), len(sw.device.log)
    smaller = replace(job, workers=job.workers[:1])
    with sw.device.sending(job):
        with pytest.raises(jobs.JobLive, match=r"job 1 is live: \d+ packets"):
            jobs.install_job(sw, smaller)
        with pytest.raises(jobs.JobLive, match=r"job 1 is live.*removing it"):
            jobs.remove_job(sw, job.job_id)
        with pytest.raises(jobs.JobLive, match="job 1 is live"):
            jobs.install_cluster(sw, cluster(smaller))
        assert sw.device.log[mark:] == [] and sw.device.state() == before
        jobs.install_job(sw, smaller, force=True)
    assert jobs.installed_jobs(sw)[1]["n_workers"] == 1
    jobs.remove_job(sw, 1, live_window=IDLE)      # idle now: allowed without force
    assert jobs.installed_jobs(sw) == {}


def test_only_the_jobs_to_change_are_watched_and_a_live_pruned_job_is_kept(sw):
    a, b = make_job(1), make_job(2, pool_base=4)
    jobs.install_cluster(sw, cluster(a, b))
    b_state = {t: jobs._job_entries(sw, t, 2) for t in (jobs.JOB_TABLE, jobs.WORKER_TABLE)}
    resets = len(sw.device.slot_resets)
    with sw.device.sending(b):
        jobs.remove_job(sw, a.job_id, live_window=IDLE)   # b's traffic does not block a
        with pytest.raises(jobs.JobLive, match="job 2 is live.*changing or removing it"):
            jobs.install_cluster(sw, cluster(), prune=True)
    assert set(jobs.installed_jobs(sw)) == {2}
    assert {t: jobs._job_entries(sw, t, 2) for t in b_state} == b_state
    assert len(sw.device.slot_resets) == resets


def test_prune_removes_the_jobs_the_cluster_lacks_and_leaves_the_rest(sw):
    a, b = make_job(1), make_job(2, pool_base=4)
    jobs.install_cluster(sw, cluster(a, b))
    epoch = jobs.installed_jobs(sw)[1]["epoch"]
    kept = jobs.install_cluster(sw, cluster(a), live_window=IDLE)
    assert set(jobs.installed_jobs(sw)) == {1, 2}, "without prune, other jobs stay"
    mark = len(sw.device.log)
    assert jobs.install_cluster(sw, cluster(a), prune=True, live_window=IDLE) == kept
    assert set(jobs.installed_jobs(sw)) == {1}
    assert jobs.installed_jobs(sw)[1]["epoch"] == epoch
    assert ops(sw.device.log[mark:], "PACKET_OUT") == []
    assert 2 not in sw.multicast_groups() and not jobs._job_entries(sw, jobs.ADDR_TABLE, 2)
    assert all(b.workers[i].mac not in forwarding.routes(sw) for i in range(2))


# ---- restart --------------------------------------------------------------------------------

def test_restarted_controller_leaves_a_running_job_alone(sw):
    job = make_job(1)
    placed = jobs.install_cluster(sw, cluster(job))
    sw.device.deliver(job, 0)                      # worker 0 is mid-round
    epoch = jobs.installed_jobs(sw)[1]["epoch"]
    sw.close()
    restarted = MemorySwitch(device=sw.device).connect(program=None)
    agg = jobs.AggAddress()
    assert jobs.unchanged(restarted, job, agg)
    assert not jobs.unchanged(restarted, replace(job, table=tuple(reversed(job.table))), agg)
    assert not jobs.unchanged(restarted, replace(job, workers=job.workers[:1]), agg)
    assert not jobs.unchanged(restarted, replace(job, mcast_grp=99), agg)
    mark = len(sw.device.log)
    with sw.device.sending(job):                  # and it keeps running: no force needed
        assert jobs.install_cluster(restarted, cluster(job)) == placed
    assert sw.device.log[mark:] == [], "no write, no reset"
    assert jobs.installed_jobs(restarted)[1]["epoch"] == epoch
    assert counters.job_counters(restarted, placed[1])["packets"] == 1, "no counter clear"


def test_a_session_after_close_cannot_write(sw):
    sw.close()
    with pytest.raises(SwitchError, match="not connected"):
        jobs.install_job(sw, make_job(1))


# ---- bad input changes nothing ----------------------------------------------------------------

def bad_inputs(job: Job, other: Job):
    w = job.workers[0]
    yield jobs.JobNotInstalled, "job 999 is not installed", lambda sw: jobs.remove_job(sw, 999)
    clash = replace(other, workers=(replace(other.workers[0], ip=w.ip, port=w.port),
                                    other.workers[1]))
    yield ConfigError, f"{w.ip}:{w.port} is used by a worker of job {job.job_id}", \
        lambda sw: jobs.install_job(sw, clash)
    mac = replace(other, workers=(replace(other.workers[0], mac=w.mac), other.workers[1]))
    yield ConfigError, f"MAC {w.mac}", lambda sw: jobs.install_job(sw, mac)
    yield ConfigError, f"MAC {w.mac}", lambda sw: jobs.install_cluster(sw, cluster(mac))
    yield ConfigError, "table values must lie in 0..30", \
        lambda sw: jobs.install_job(sw, replace(other, table=(31,) + other.table[1:]))
    yield ConfigError, "overflows", lambda sw: jobs.install_job(sw, replace(other, granularity=40000))
    yield ConfigError, "lanes", lambda sw: jobs.install_job(sw, replace(other, lanes=128))
    yield ConfigError, "slots", \
        lambda sw: jobs.install_job(sw, replace(other, pool_base=P.SWITCH_SLOTS - 2))
    yield ConfigError, "overlaps job", lambda sw: jobs.install_job(sw, replace(other, pool_base=2))
    yield ConfigError, "multicast group", \
        lambda sw: jobs.install_job(sw, replace(other, mcast_grp=job.mcast_grp))
    yield ConfigError, "job index 0 is taken", lambda sw: jobs.install_job(sw, other, job_index=0)
    yield ConfigError, "not a front-panel port", lambda sw: jobs.install_job(sw, replace(
        other, workers=(replace(other.workers[0], switch_port=P.CPU_PORT), other.workers[1])))
    yield ConfigError, "overlap", lambda sw: jobs.install_cluster(
        sw, cluster(job, replace(other, pool_base=job.pool_base)))


@pytest.fixture(scope="module")
def two_jobs():
    """A switch holding ``job``, and ``other`` to install beside it (bad inputs change
    nothing, so the cases share it)."""
    sw = MemorySwitch().connect()
    job, other = make_job(1), make_job(2, pool_base=8)
    jobs.install_job(sw, job)
    yield sw, job, other
    sw.close()


@pytest.mark.parametrize("case", range(13))
def test_bad_control_input_changes_nothing(two_jobs, case):
    sw, job, other = two_jobs
    error, match, act = list(bad_inputs(job, other))[case]
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


# ---- install and remove -----------------------------------------------------------------------

def test_install_is_idempotent(sw):
    job = make_job(1, 3)
    jobs.install_job(sw, job)
    first, cfg = sw.device.state(skip=["thc_job"]), jobs.installed_jobs(sw)[1]
    jobs.install_job(sw, job, live_window=IDLE)
    assert sw.device.state(skip=["thc_job"]) == first
    again = jobs.installed_jobs(sw)[1]
    assert again.pop("epoch") not in (0, cfg.pop("epoch")), "every install draws a new epoch"
    assert again == cfg
    for table in jobs._lut_tables(sw):
        assert len(jobs._job_entries(sw, table, 1)) == 256, table


def test_reinstall_with_fewer_workers_drops_their_entries(sw):
    job = make_job(1, 3)
    jobs.install_job(sw, job)
    jobs.install_job(sw, replace(job, workers=job.workers[:2]), live_window=IDLE)
    assert len(jobs._job_entries(sw, jobs.WORKER_TABLE, 1)) == 2
    assert len(jobs._job_entries(sw, jobs.ADDR_TABLE, 1)) == 2
    assert job.workers[2].mac not in forwarding.routes(sw)
    assert sw.multicast_groups()[1] == {(0, 1), (1, 2)}
    assert jobs.installed_jobs(sw)[1]["n_workers"] == 2
    sw.device.deliver(job, 2)
    assert counters.drops(sw)["worker_outside_job"] == 1


def test_remove_deletes_everything(sw):
    before = sw.device.state()
    job = make_job(1)
    jobs.install_job(sw, job)
    assert sw.device.state() != before
    jobs.remove_job(sw, 1, live_window=IDLE)
    assert sw.device.state() == before
    sw.device.deliver(job, 0)
    assert counters.drops(sw)["unknown_job"] == 1


def test_a_route_shared_with_another_job_survives_its_removal(sw):
    a = make_job(1)
    b = make_job(2, pool_base=4)
    b = replace(b, workers=(replace(b.workers[0], mac=a.workers[0].mac, ip=a.workers[0].ip),
                            b.workers[1]))
    jobs.install_job(sw, a)
    jobs.install_job(sw, b)
    jobs.remove_job(sw, 1, live_window=IDLE)
    routes = forwarding.routes(sw)
    assert routes[a.workers[0].mac] == 0 and a.workers[1].mac not in routes


def test_install_zeroes_the_job_counters_and_counters_read_by_name(sw):
    for name in P.JOB_COUNTERS:                     # left over from a job at index 0
        sw.device.cells[counters.JOB_COUNTERS][counters.job_counter_index(0, name)] = 7
    jobs.install_job(sw, make_job(1))
    assert counters.job_counters(sw, 0) == {name: 0 for name in P.JOB_COUNTERS}
    assert set(counters.drops(sw)) == set(P.DropReason.__members__)
    cells = sw.device.cells[counters.JOB_COUNTERS]
    for name, n in (("packets", 2), ("completions", 1), ("retransmissions", 1), ("pending", 1)):
        cells[counters.job_counter_index(0, name)] = n
    assert counters.job_counters(sw, 0) == {"packets": 5, "completions": 1,
                                            "retransmissions": 1, "pending": 1, "held": 0}
    assert counters.snapshot(sw, jobs.installed_jobs(sw))["jobs"]["1"]["packets"] == 5


def test_second_session_in_one_process_is_refused(monkeypatch):
    monkeypatch.setattr(Switch, "_open", lambda self, files: None)
    first = Switch("127.0.0.1:1").connect(program=None)
    try:
        with pytest.raises(SwitchError, match="already open"):
            Switch("127.0.0.1:2").connect(program=None)
    finally:
        first.close()
    Switch("127.0.0.1:2").connect(program=None).close()


# ---- the command line -------------------------------------------------------------------------

def thc_controller(device: MemoryDevice, monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(cli, "Switch", functools.partial(MemorySwitch, device=device))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(list(argv)))


def test_cli_refuses_a_live_job_and_names_it(sw, monkeypatch, capsys):
    job = make_job(1)
    jobs.install_job(sw, job)
    with sw.device.sending(job):
        assert thc_controller(sw.device, monkeypatch, "remove", "--job", "1") == 1
    err = capsys.readouterr().err
    assert "job 1 is live" in err and "--force" in err
    assert 1 in jobs.installed_jobs(sw)
    with sw.device.sending(job):
        assert thc_controller(sw.device, monkeypatch, "remove", "--job", "1", "--force") == 0
    assert jobs.installed_jobs(sw) == {}


def test_cli_installs_a_cluster_once_and_reads_counters(sw, monkeypatch, capsys, tmp_path):
    config = tmp_path / "cluster.json"
    cluster(make_job(1)).save(config)
    assert thc_controller(sw.device, monkeypatch, "install", "--config", str(config)) == 0
    assert "job 1: index 0" in capsys.readouterr().out
    mark = len(sw.device.log)
    assert thc_controller(sw.device, monkeypatch, "install", "--config", str(config)) == 0
    assert "(unchanged, left alone)" in capsys.readouterr().out
    assert sw.device.log[mark:] == []
    assert thc_controller(sw.device, monkeypatch, "counters", "--json") == 0
    snap = json.loads(capsys.readouterr().out)
    assert set(snap["drops"]) == set(P.DropReason.__members__) and "1" in snap["jobs"]
    assert thc_controller(sw.device, monkeypatch, "remove", "--job", "9999") == 1
    assert "thc controller: job 9999 is not installed" in capsys.readouterr().err


def test_cli_without_a_switch_says_so(monkeypatch, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--grpc-addr", "127.0.0.1:1", "--timeout", "0.5", "counters"])
    assert cli.run(args) == 1
    assert "no P4Runtime server" in capsys.readouterr().err
