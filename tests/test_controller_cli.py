"""``thc controller`` without a switch: its flags checked before any session, the election
ids its actions take, and a push refused while a job is live, on the in-memory switch
(controller/testing/memswitch.py) standing in for the P4Runtime server."""
from __future__ import annotations

import argparse
import os
import re

import pytest

from thc.controller import cli, jobs
from thc.controller.testing.memswitch import MemoryDevice, MemorySwitch
from thc.lifetime import Terminated
from thc.wire.jobs import SWITCH_AGG_IP, SWITCH_AGG_MAC, Cluster
from tests.test_jobs_safety import make_job


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="thc controller")
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv,message", [
    (["--election-id", "99999999999999999999999,0", "jobs"], "--election-id: an integer in"),
    (["--election-id=-1", "jobs"], "--election-id: HIGH,LOW"),
    (["--election-id", "0,0", "jobs"], "0,0 is no election id"),
    (["--device-id=-1", "jobs"], "--device-id: an integer in 0..2^64-1"),
    (["--timeout=-1", "jobs"], "--timeout: must be above 0"),
    (["remove", "--job", "0"], "--job: must be at least 1, not 0"),
    (["remove", "--job", str(10 ** 30)], "--job: a job id is 1..65535, not 1" + "0" * 30),
    (["l2", "add", "02:00:00:00:00:05", "-5"], "argument port: must be at least 0, not -5")])
def test_bad_session_flags_are_refused_before_any_session(argv, message, capsys):
    """An election id protobuf cannot hold failed inside p4runtime-shell's setup, whose
    stream threads then kept the process from exiting; a negative timeout read as no
    server."""
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["l2", "add"], "l2 add takes MAC and PORT, given none"),
    (["l2", "add", "02:00:00:00:00:05"], "l2 add takes MAC and PORT, given MAC"),
    (["l2", "del"], "l2 del takes MAC, given none"),
    (["l2", "del", "02:00:00:00:00:05", "7"], "l2 del takes MAC, given MAC and PORT"),
    (["l2", "list", "02:00:00:00:00:05"], "l2 list takes no MAC or PORT, given MAC"),
    (["l2", "add", "02:00:00:00:00:05", str(10 ** 30)],
     f"l2 add: port {10 ** 30} is not a front-panel port of a bmv2 switch"),
    (["l2", "add", "02:00:00:00:00:05", "511"], "l2 add: port 511 is not a front-panel port"),
    (["l2", "add", "02:00:00:00:00:05", "255"], "l2 add: port 255 is not a front-panel port "
                                                "of a bmv2 switch (0..510, not the CPU port 255)"),
    (["--target", "tofino", "l2", "add", "02:00:00:00:00:05", "320"],
     "l2 add: port 320 is not a front-panel port of a tofino switch (ports 0..63 of a pipe: "
     "0..63, 128..191, 256..319, 384..447)"),
    (["--target", "tofino", "l2", "add", "02:00:00:00:00:05", "68"],
     "l2 add: port 68 is not a front-panel port of a tofino switch"),
    (["--target", "tofino", "l2", "add", "02:00:00:00:00:05", "512"],
     "l2 add: port 512 is not a front-panel port of a tofino switch"),
    (["l2", "add", "zz", "3"], "l2 add: MAC 'zz' is not six hex bytes")])
def test_l2_takes_what_its_op_reads_before_any_session(argv, message, monkeypatch, capsys):
    """A missing MAC or PORT was found only once connected (without a switch: "no P4Runtime
    server"), and a MAC given to ``list`` or a PORT to ``del`` was ignored. A port no host
    sits at failed at the switch, or was written. These are usage errors: status 2, as
    argparse's."""
    def connected(*a, **k):
        raise AssertionError("a session started")
    monkeypatch.setattr(cli, "Switch", connected)
    assert cli.run(_parse(*argv)) == 2
    assert f"thc controller: {message}" in capsys.readouterr().err


def test_the_switch_options_stand_before_the_action_or_after_it(capsys):
    """``install --dry-run`` was an argparse error (unrecognized arguments) without a word
    that the options go before the action."""
    before = _parse("--target", "tofino", "--dry-run", "--grpc-addr", "10.1.1.1:9559",
                    "install", "--config", "c.json")
    after = _parse("install", "--config", "c.json", "--target", "tofino", "--dry-run",
                   "--grpc-addr", "10.1.1.1:9559")
    assert vars(before) == vars(after)
    assert (after.target, after.dry_run, after.grpc_addr) == ("tofino", True, "10.1.1.1:9559")
    plain = _parse("jobs")
    assert (plain.target, plain.dry_run, plain.timeout) == ("bmv2", False, 5.0)
    assert _parse("--timeout", "7", "jobs", "--target", "tofino").timeout == 7.0
    assert _parse("jobs", "--timeout", "7").timeout == 7.0
    with pytest.raises(SystemExit):
        _parse("jobs", "--timeout=-1")
    assert "argument --timeout: must be above 0" in capsys.readouterr().err   # not unrecognized

class _Recorded(MemorySwitch):
    """A MemorySwitch on one shared device that records the election id of each session."""

    device_: MemoryDevice
    elections: list

    def __init__(self, grpc_addr, device_id, election_id, timeout=5.0, require_primary=True):
        super().__init__(grpc_addr, device_id, election_id, timeout, require_primary,
                         device=self.device_)
        self.elections.append((election_id, require_primary))


@pytest.fixture
def recorded(monkeypatch):
    device = MemoryDevice(program=None)
    switch = type("Recorded", (_Recorded,), {"device_": device, "elections": []})
    monkeypatch.setattr(cli, "Switch", switch)
    MemorySwitch(device=device).connect()       # the thc program pushed
    return switch


def test_readers_never_take_a_writers_place(recorded):
    """Reading actions took the writers' default id (1,0): one run while an install held it
    failed ("Election id already exists"), and a reader given a higher id preempted the
    install. Readers now default to (0, pid), below any writer."""
    assert cli.run(_parse("jobs")) == 0
    assert cli.run(_parse("counters")) == 0
    assert cli.run(_parse("l2", "list")) == 0
    assert recorded.elections == [((0, os.getpid()), False)] * 3
    assert cli.run(_parse("--election-id", "3,4", "jobs")) == 0
    assert recorded.elections[-1] == ((3, 4), False)


def test_an_empty_forwarding_table_is_said_to_be_empty(recorded, capsys):
    """``l2 list`` printed nothing at all, which reads like a command that did not run."""
    assert cli.run(_parse("l2", "list")) == 0
    assert capsys.readouterr().out.splitlines() == ["l2_forward: no entries"]


def test_a_push_is_refused_while_a_job_is_live(recorded, tmp_path, capsys, monkeypatch):
    """`install --push` (and `push`) removes every job: a push watches every installed job
    first, and refuses a live one as `install` alone does."""
    monkeypatch.setattr(jobs, "LIVE_WINDOW", 0.2)
    live = make_job(9)
    sw = MemorySwitch(device=recorded.device_).connect(program=None)
    jobs.install_job(sw, live)
    other = make_job(12, pool_base=8)
    config = tmp_path / "other.json"
    Cluster(jobs=(other,), agg_ip=SWITCH_AGG_IP, agg_mac=SWITCH_AGG_MAC).save(config)
    before = recorded.device_.state()
    with recorded.device_.sending(live):
        for argv in (["install", "--config", str(config), "--push"], ["push"]):
            assert cli.run(_parse(*argv)) == 1
            err = capsys.readouterr().err
            assert "job 9 is live" in err and "pushing a program, which removes every job" in err
            assert recorded.device_.state() == before
        assert cli.run(_parse("push", "--force")) == 0
    assert jobs.installed_jobs(sw) == {}
    assert cli.run(_parse("install", "--config", str(config), "--push")) == 0   # nothing live


def test_an_install_that_prunes_says_which_jobs_it_removed(recorded, tmp_path, capsys):
    """`install --prune` deleted a job not in the config and printed only the kept ones."""
    both, kept = tmp_path / "both.json", tmp_path / "kept.json"
    one, two = make_job(1), make_job(2, pool_base=8)
    Cluster(jobs=(one, two), agg_ip=SWITCH_AGG_IP, agg_mac=SWITCH_AGG_MAC).save(both)
    Cluster(jobs=(two,), agg_ip=SWITCH_AGG_IP, agg_mac=SWITCH_AGG_MAC).save(kept)
    assert cli.run(_parse("install", "--config", str(both))) == 0
    capsys.readouterr()
    assert cli.run(_parse("install", "--config", str(kept))) == 0   # without --prune: kept
    assert "removed" not in capsys.readouterr().out
    assert cli.run(_parse("install", "--config", str(kept), "--prune")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("job 2: index ") and out[0].endswith("(unchanged, left alone)")
    assert out[1:] == ["job 1: removed (not in the config; --prune)"]
    sw = MemorySwitch(device=recorded.device_).connect(program=None)
    assert sorted(jobs.installed_jobs(sw)) == [2]


@pytest.mark.parametrize("action", ["install", "remove"])
@pytest.mark.parametrize("stop", [(KeyboardInterrupt, (), "interrupted"),
                                  (Terminated, (143,), "terminated (SIGTERM)")])
def test_ctrl_c_mid_writes_names_the_job_it_left_part_way(recorded, tmp_path, capsys,
                                                          monkeypatch, action, stop):
    """Ctrl-C (or SIGTERM) between an install's (a remove's) writes ended in ``thc:
    interrupted`` alone, with job 5 half-written: it names the job, and `jobs` shows what
    remains."""
    kind, args, words = stop
    config = tmp_path / "cluster.json"
    Cluster(jobs=(make_job(5), make_job(6, pool_base=8)), agg_ip=SWITCH_AGG_IP,
            agg_mac=SWITCH_AGG_MAC).save(config)
    if action == "remove":
        assert cli.run(_parse("install", "--config", str(config))) == 0
        Cluster(jobs=(make_job(6, pool_base=8),), agg_ip=SWITCH_AGG_IP,
                agg_mac=SWITCH_AGG_MAC).save(config)   # job 6 unchanged: left alone
    capsys.readouterr()
    writes = []
    real = MemorySwitch.write_entries

    def cut(self, op, entities, ignore=()):
        if len(writes) == 3:
            raise kind(*args)
        writes.append(op)
        return real(self, op, entities, ignore)
    monkeypatch.setattr(MemorySwitch, "write_entries", cut)
    argv = ("install", "--config", str(config)) if action == "install" else ("remove",
                                                                              "--job", "5")
    with pytest.raises(kind):
        cli.run(_parse(*argv))
    err = capsys.readouterr().err
    assert err.startswith(f"thc controller: {words} while "
                          + {"install": "installing", "remove": "removing"}[action])
    assert err.count("\n") == 1
    assert ("job(s) 5, 6 may be half-written" if action == "install" else "removing job 5: "
            "entries of it may remain") in err, err
    monkeypatch.setattr(MemorySwitch, "write_entries", real)
    assert cli.run(_parse("jobs")) == 0
    assert re.search(r"^job 5: .*NOT (installed|serving)", capsys.readouterr().out, re.M), writes


def test_a_cluster_file_nested_too_deeply_is_a_config_error(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    assert cli.run(_parse("install", "--config", str(deep))) == 1
    assert "nested too deeply for a cluster file" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--sum-bits", "12"], "--sum-bits takes widths from"),
    (["--workers", "40", "--sum-bits", "8"], "--workers 40 --pool 256 --sum-bits 8:"),
    (["--lanes-sweep", "7"], "--lanes-sweep 7:"),
])
def test_bench_switch_refuses_what_it_cannot_run_before_any_switch(argv, message, monkeypatch,
                                                                   capsys):
    """Usage errors end at once with exit 2 and the flag named, BMv2 present or not."""
    from thc.controller import bench, toolchain

    monkeypatch.setattr(toolchain, "bmv2_missing", lambda program: None)
    monkeypatch.setattr(toolchain, "p4c_missing", lambda: None)
    monkeypatch.setattr(bench, "bench_thc", lambda *a: pytest.fail("a switch was started"))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(argv)) == 2
    assert message in capsys.readouterr().err
