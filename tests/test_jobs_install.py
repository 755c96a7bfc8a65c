"""Install, remove, counters and ``thc controller`` on the in-memory switch, everywhere
(tests/bmv2/test_switch_controller.py checks the same on BMv2, with packets)."""
from __future__ import annotations

import argparse
import functools
import json
from dataclasses import replace

import pytest

from thc.controller import cli, counters, forwarding, installed, job_entries, jobs, program
from thc.controller.switch import Switch, SwitchError
from thc.controller.testing.memswitch import MemoryDevice, MemorySwitch
from thc.wire import protocol as P
from thc.wire.jobs import ConfigError
from tests.test_jobs_safety import IDLE, cluster, make_job


@pytest.fixture
def sw():
    s = MemorySwitch().connect()
    yield s
    s.close()


# ---- install and remove -----------------------------------------------------------------------

def test_install_is_idempotent(sw):
    job = make_job(1, 3)
    jobs.install_job(sw, job)
    epochs = ["thc_job", program.INSTALL_TABLE]
    first, cfg = sw.device.state(skip=epochs), installed.installed_jobs(sw)[1]
    jobs.install_job(sw, job, live_window=IDLE)
    assert sw.device.state(skip=epochs) == first
    again = installed.installed_jobs(sw)[1]
    assert installed.install_epochs(sw, 1) == [again["epoch"]]
    assert again.pop("epoch") not in (0, cfg.pop("epoch")), "every install draws a new epoch"
    assert again == cfg
    for table in installed.lut_tables(sw):
        entries = sw.device.entries[sw.tables.get(table, "table").preamble.id]
        assert sorted(dict(key)[1] for key in entries) == [1] * 256, table


@pytest.mark.parametrize("target", ["bmv2", "tofino"])
def test_worker_entries_key_on_the_switch_port(target):
    """Both programs know a worker by its ingress port too: a host on another port sending
    with its addresses is no worker."""
    from thc.controller.switch import BUILD_DIR
    build = BUILD_DIR if target == "bmv2" else BUILD_DIR / "tofino"
    device = MemoryDevice(program="thc" if target == "bmv2" else "thc_tna", build_dir=build)
    sw = MemorySwitch(device=device).connect(program=None)
    job = make_job(1, 2)
    first = 0 if target == "bmv2" else 256   # the Tofino's CPU port's pipe
    job = replace(job, workers=tuple(replace(w, switch_port=first + 3 + 2 * w.id)
                                     for w in job.workers))
    jobs.install_job(sw, job)
    entries = installed.entries_of(sw, program.WORKER_TABLE, 1)
    assert len(entries) == 2
    fid = sw.field_id(program.WORKER_TABLE, program.WORKER_PORT_KEY)
    assert sorted(sw.match_values(e)[fid] for e in entries) == [first + 3, first + 5]
    device.deliver(job, 1)
    assert counters.drops(sw).get("unknown_worker", 0) == 0
    moved = replace(job.workers[1], switch_port=first + 4)
    device.deliver(replace(job, workers=(job.workers[0], moved)), 1)
    assert counters.drops(sw).get("unknown_worker", 0) == 1


@pytest.mark.parametrize("target", ["bmv2", "tofino"])
def test_a_program_from_before_the_port_key_is_refused_before_any_write(target, tmp_path,
                                                                          monkeypatch, capsys):
    """A switch still running a build whose worker table has no port key took the job, the
    install entry and every lookup entry, then failed at the worker entries; ``install``
    from the command line failed reading the installed jobs in the new shape."""
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2

    from thc.controller.switch import BUILD_DIR
    build = BUILD_DIR if target == "bmv2" else BUILD_DIR / "tofino"
    name = "thc" if target == "bmv2" else "thc_tna"
    info = text_format.Parse((build / f"{name}.p4info.txt").read_text(), p4info_pb2.P4Info())
    table = next(t for t in info.tables if t.preamble.name.endswith(program.WORKER_TABLE))
    keep = [f for f in table.match_fields if f.name != program.WORKER_PORT_KEY]
    del table.match_fields[:]
    table.match_fields.extend(keep)
    old = tmp_path / "old"
    old.mkdir()
    for f in build.iterdir():
        if f.is_file():
            (old / f.name).write_bytes(f.read_bytes())
    (old / f"{name}.p4info.txt").write_text(text_format.MessageToString(info))
    device = MemoryDevice(program=name, build_dir=old)
    sw = MemorySwitch(device=device).connect(program=None)
    job = make_job(1, 2)
    if target == "tofino":
        job = replace(job, workers=tuple(replace(w, switch_port=256 + 3 + w.id)
                                         for w in job.workers))
    with pytest.raises(ConfigError, match="from before the port key"):
        jobs.install_job(sw, job)
    assert device.log == []
    cfg = tmp_path / "cluster.json"
    cluster(job).save(cfg)
    monkeypatch.setattr(cli, "Switch", lambda *a, **k: MemorySwitch(device=device))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--target", target, "install", "--config", str(cfg)])) == 1
    assert "from before the port key" in capsys.readouterr().err
    assert device.log == []


def test_reinstall_with_fewer_workers_drops_their_entries(sw):
    job = make_job(1, 3)
    jobs.install_job(sw, job)
    jobs.install_job(sw, replace(job, workers=job.workers[:2]), live_window=IDLE)
    assert len(installed.entries_of(sw, program.WORKER_TABLE, 1)) == 2
    assert len(installed.entries_of(sw, program.ADDR_TABLE, 1)) == 2
    assert job.workers[2].mac not in forwarding.routes(sw)
    assert sw.multicast_groups()[1] == {(0, 1), (1, 2)}
    assert installed.installed_jobs(sw)[1]["n_workers"] == 2
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


def test_a_route_shared_with_another_job_survives_a_reinstall_without_it(sw):
    """Job 1 re-installed with worker 0 on another MAC takes the old MAC's route off only
    where no other job's worker sits behind it: job 2's host shares it."""
    a = make_job(1)
    b = make_job(2, pool_base=4)
    b = replace(b, workers=(replace(b.workers[0], mac=a.workers[0].mac, ip=a.workers[0].ip,
                                    port=a.workers[0].port + 1), b.workers[1]))
    jobs.install_cluster(sw, cluster(a, b))
    moved = replace(a, workers=(replace(a.workers[0], mac="02:ab:00:00:00:01"), a.workers[1]))
    jobs.install_job(sw, moved, live_window=IDLE)
    routes = forwarding.routes(sw)
    assert routes[a.workers[0].mac] == a.workers[0].switch_port
    assert routes["02:ab:00:00:00:01"] == a.workers[0].switch_port
    assert installed.unchanged(sw, b, jobs.AggAddress.of(cluster(b)))


def test_results_leave_from_the_clusters_aggregator_mac(sw):
    """Every worker's address entry carries the cluster's ``agg_mac``, the source of the
    results it is sent: the default's hid an entry written with the default regardless."""
    job = make_job(1)
    own = replace(cluster(job), agg_mac="02:00:00:00:00:aa")
    jobs.install_cluster(sw, own)
    entries = installed.entries_of(sw, program.ADDR_TABLE, 1)
    assert len(entries) == 2
    assert [sw.param_values(e)["agg_mac"] for e in entries] == [0x0200000000AA] * 2
    assert installed.unchanged(sw, job, jobs.AggAddress.of(own))
    assert not installed.unchanged(sw, job, jobs.AggAddress.of(cluster(job)))


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
    assert counters.snapshot(sw, installed.installed_jobs(sw))["jobs"]["1"]["packets"] == 5


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
    assert 1 in installed.installed_jobs(sw)
    with sw.device.sending(job):
        assert thc_controller(sw.device, monkeypatch, "remove", "--job", "1", "--force") == 0
    assert installed.installed_jobs(sw) == {}


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


def test_jobs_that_swap_multicast_groups_keep_both(sw):
    """A later job's write deleted its previous group, which an earlier job of the same
    install had just taken: the swap left one job with no group, and its workers no results."""
    a, b = make_job(1), make_job(2, pool_base=8)
    jobs.install_cluster(sw, cluster(a, b))
    a2, b2 = replace(a, mcast_grp=2), replace(b, mcast_grp=1)
    jobs.install_cluster(sw, cluster(a2, b2), live_window=IDLE)
    groups = sw.multicast_groups()
    assert groups[2] == {(w.switch_port, w.id + 1) for w in a.workers}
    assert groups[1] == {(w.switch_port, w.id + 1) for w in b.workers}
    c = make_job(3, pool_base=16, mcast_grp=2)   # takes a2's group while a2 moves to 7
    jobs.install_cluster(sw, cluster(c, replace(a2, mcast_grp=7), b2), live_window=IDLE)
    assert {1, 2, 7} <= set(sw.multicast_groups())


def test_a_group_a_swap_cut_short_left_is_listed_and_deleted_by_the_next_install(
        sw, monkeypatch, capsys):
    """The swap stops after the first job is rewritten: its old group is kept for the second
    job, about to take it. Given another group by the next install, the second job left that
    group on the switch, named by no job and by no listing."""
    a, b = make_job(1), make_job(2, pool_base=8)
    jobs.install_cluster(sw, cluster(a, b))
    a2, b2 = replace(a, mcast_grp=2), replace(b, mcast_grp=1)
    write = jobs._write_job

    def first_only(sw_, job, *args):
        if job.job_id == 2:
            raise SwitchError("the switch stopped answering")
        return write(sw_, job, *args)
    monkeypatch.setattr(jobs, "_write_job", first_only)
    with pytest.raises(SwitchError, match="stopped answering"):
        jobs.install_cluster(sw, cluster(a2, b2), live_window=IDLE)
    monkeypatch.setattr(jobs, "_write_job", write)
    assert sw.multicast_groups().keys() == {1, 2}
    b3 = replace(b, mcast_grp=3)
    jobs.install_job(sw, b3, job_entries.AggAddress.of(cluster(a2, b3)), live_window=IDLE)
    assert installed.stray_groups(sw) == [1]
    assert thc_controller(sw.device, monkeypatch, "jobs") == 0
    assert "multicast group 1: named by no job" in capsys.readouterr().out
    jobs.install_cluster(sw, cluster(a2, b3), live_window=IDLE)
    assert installed.stray_groups(sw) == [] and sw.multicast_groups().keys() == {2, 3}


def test_a_program_compiled_for_other_slots_is_refused(sw, monkeypatch):
    """A stale program with fewer slots took a job beyond its registers: that job's
    workers were never answered, and nothing was counted."""
    from p4.config.v1 import p4info_pb2
    info = p4info_pb2.P4Info()
    info.CopyFrom(sw.p4info)
    reg = next(r for r in info.registers if r.preamble.name.endswith(".thc_run"))
    reg.size = 256
    monkeypatch.setattr(sw, "p4info", info)
    mark = len(sw.device.log)
    with pytest.raises(ConfigError, match="register thc_run holds 256 entries, protocol.json "
                                          "gives 1024"):
        jobs.install_job(sw, make_job(1))
    assert sw.device.log[mark:] == []


def test_an_install_that_fails_part_way_says_what_it_left(sw, monkeypatch):
    def refused(group, replicas):
        raise SwitchError(f"multicast group {group}: OUT_OF_RANGE")
    monkeypatch.setattr(sw, "set_multicast_group", refused)
    with pytest.raises(SwitchError, match=r"job 1: the install stopped part-way \(multicast "
                                          r"group 1: OUT_OF_RANGE\).*install the job again"):
        jobs.install_job(sw, make_job(1))
    assert installed.entries_of(sw, program.WORKER_TABLE, 1) == []


def test_jobs_lists_a_half_installed_job_as_not_serving(sw, monkeypatch, capsys):
    """An install that stopped after the job entry (here: its slot resets) left a job that
    `jobs` listed as a healthy one."""
    def lost(*a, **k):
        raise SwitchError("only 0 of 8 slot resets reached the data plane")
    with monkeypatch.context() as m:
        m.setattr(jobs, "reset_pool", lost)
        with pytest.raises(SwitchError, match="stopped part-way"):
            jobs.install_job(sw, make_job(1))
    assert thc_controller(sw.device, monkeypatch, "jobs") == 0
    assert "(NOT serving: 0 of 2 worker entries; install it again)" in capsys.readouterr().out
    jobs.install_job(sw, make_job(1), live_window=IDLE)
    assert thc_controller(sw.device, monkeypatch, "jobs") == 0
    assert "NOT serving" not in capsys.readouterr().out


def test_resets_of_an_install_that_timed_out_do_not_count_for_the_next(sw, monkeypatch):
    """The switch's packet-out path stalls through an install, whose resets time out, and
    catches up (one RESET a counter read) only once the next install has sent its own: the
    stalled RESETs come first. Counted as the next install's, they let its workers in while
    its own RESETs were still to clear their slots; they carry the earlier install's epoch
    and are dropped (stale_reset)."""
    dev, queued = sw.device, []
    packet_out, read_counter = dev.packet_out, dev.read_counter
    job = make_job(1, 2)
    first = 2 * job.pool_size

    def late(name):
        catching_up[0] |= len(queued) > first
        if catching_up[0] and queued:
            packet_out(queued.pop(0))
        return read_counter(name)
    catching_up = [False]
    monkeypatch.setattr(dev, "packet_out", queued.append)
    monkeypatch.setattr(dev, "read_counter", late)
    monkeypatch.setattr(jobs.reset_pool, "__defaults__", (0.2,))
    with pytest.raises(SwitchError, match=r"only 0 of 8 slot resets .* within 0.2s.*may still "
                                          r"be queued.*stale_reset"):
        jobs.install_job(sw, job)
    monkeypatch.setattr(jobs.reset_pool, "__defaults__", (5.0,))
    jobs.install_job(sw, job, live_window=IDLE, force=True)
    live = max(i for i, e in enumerate(dev.log)
               if e.op == "INSERT" and e.target.endswith(program.WORKER_TABLE.split(".")[-1]))
    assert not queued and not [e for e in dev.log[live:] if e.op == "PACKET_OUT"]
    assert counters.drops(sw)["stale_reset"] == first
    assert len(dev.slot_resets) == first


@pytest.mark.parametrize("again", ["install_job", "install_cluster"])
def test_an_install_draws_no_epoch_the_switch_still_names(sw, monkeypatch, again):
    """An install cut short between its job entry (epoch e2) and its thc_install entry left
    the install before's (e1), whose RESETs may still be queued. The next install avoided
    e2 alone: drawing e1 (1 in 65535), it counted those RESETs as its own. So does a
    cluster install."""
    job = make_job(1, 2)
    # e1 at place 0x300; e2 at 0x200; then, past e2, a step onto e1 and one onto 0x201
    e1, e2 = P.nonce_at(0x300), P.nonce_at(0x200)
    draws = iter([e1 - 1, 0xFF, 0])
    monkeypatch.setattr(P.secrets, "randbelow", lambda n: next(draws))
    jobs.install_job(sw, job)
    assert installed.installed_jobs(sw)[1]["epoch"] == job.new_epoch(nonce=e1)
    job_entries.upsert(sw, [job_entries.job_entry(sw, job, 0, job.new_epoch(nonce=e2))],
                       exists=True)
    if again == "install_job":
        jobs.install_job(sw, job, live_window=IDLE, force=True)
    else:
        jobs.install_cluster(sw, cluster(job), live_window=IDLE, force=True)
    assert installed.installed_jobs(sw)[1]["epoch"] == job.new_epoch(nonce=P.nonce_at(0x201))


def test_a_cluster_install_retried_after_a_failure_draws_no_epoch_the_switch_named(
        sw, monkeypatch):
    """Job 1 cut short between its job entry (e2) and its thc_install entry (e1, RESETs
    queued). A cluster install that failed writing another job first had taken job 1's
    install entry off already: the retry drew e1."""
    job, other = make_job(1, 2), make_job(3, 2, pool_base=8)
    e1, e2 = P.nonce_at(0x300), P.nonce_at(0x200)
    draws = iter([e1 - 1, 5, 0xFF, 0])
    monkeypatch.setattr(P.secrets, "randbelow", lambda n: next(draws))
    jobs.install_job(sw, job)
    job_entries.upsert(sw, [job_entries.job_entry(sw, job, 0, job.new_epoch(nonce=e2))],
                       exists=True)
    write = jobs._write_job

    def failing(switch, j, *args):
        if j.job_id == 3:
            raise SwitchError("write failed")
        write(switch, j, *args)
    with monkeypatch.context() as m:
        m.setattr(jobs, "_write_job", failing)
        with pytest.raises(SwitchError, match="write failed"):
            jobs.install_cluster(sw, cluster(other, job), live_window=IDLE, force=True)
    jobs.install_cluster(sw, cluster(other, job), live_window=IDLE, force=True)
    assert installed.installed_jobs(sw)[1]["epoch"] == job.new_epoch(nonce=P.nonce_at(0x201))


@pytest.mark.parametrize("change", [{"granularity": 31}, {"granularity": 100}])
def test_a_change_the_entries_do_not_hold_installs_an_epoch_of_the_new_tag(sw, change):
    """The switch entries hold no granularity: install_cluster kept the job as it was, with
    an epoch of the old configuration's tag, and every worker of the new file refused it."""
    job = make_job(1, 2)
    jobs.install_cluster(sw, cluster(job), live_window=IDLE)
    new = replace(job, **change).validate()
    jobs.install_cluster(sw, cluster(new), live_window=IDLE)
    assert P.epoch_tag(installed.installed_jobs(sw)[1]["epoch"]) == new.config_tag != job.config_tag


def test_an_epoch_without_the_jobs_tag_is_replaced_by_the_next_install(sw):
    """A switch installed before epochs had tags (a random epoch) is installed anew."""
    job = make_job(1, 2)
    jobs.install_cluster(sw, cluster(job), live_window=IDLE)
    old = installed.installed_jobs(sw)[1]
    job_entries.upsert(sw, [job_entries.job_entry(sw, job, old["job_index"], 0x00010001)], True)
    assert P.epoch_tag(installed.installed_jobs(sw)[1]["epoch"]) == 1 != job.config_tag
    jobs.install_cluster(sw, cluster(job), live_window=IDLE)
    assert P.epoch_tag(installed.installed_jobs(sw)[1]["epoch"]) == job.config_tag
