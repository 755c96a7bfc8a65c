"""The worker-side helper every worker program uses: the client of a rank from a cluster file
(job chosen by aggregation, address from the flags or the cluster, run agreed), the flags it
reads, and the run agreement that keeps torch out of workers without a process group."""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from thc.collective import worker
from thc.testing.clusters import free_port_block, local_job
from thc.wire.jobs import Cluster, Job, Shard


@pytest.fixture
def cluster_file(tmp_path):
    base = free_port_block(4)
    thc = local_job(1, 2, base)
    vote = Job.vote(2, thc.workers, pool_base=thc.pool_size, pool_size=16)
    path = tmp_path / "cluster.json"
    Cluster(jobs=(thc, vote), agg_ip="127.0.0.9", agg_port=4321).save(path)
    return path


def test_the_client_of_a_rank_takes_the_job_by_aggregation_and_the_clusters_address(
        cluster_file):
    with worker.worker_client(cluster_file, 1, aggregation="vote", run=5) as c:
        assert (c.job.job_id, c.worker_id, c.aggregator, c.run) == (2, 1, ("127.0.0.9", 4321), 5)
    with worker.worker_client(cluster_file, 0, "10.1.2.3:99", run=6) as c:
        assert (c.job.job_id, c.aggregator) == (1, ("10.1.2.3", 99))
    with pytest.raises(ValueError, match="no max job"):
        worker.worker_client(cluster_file, 0, aggregation="max", run=5)


def test_a_sharded_job_sends_where_its_shard_map_says():
    shards = (Shard("127.0.0.1", 7001), Shard("127.0.0.1", 7002))
    job = dataclasses.replace(local_job(1, 2, free_port_block(2)), shards=shards)
    with worker.worker_client(Cluster(jobs=(job,)), 0, "10.1.2.3:99", run=5) as c:
        assert c.aggregators == [("127.0.0.1", 7001), ("127.0.0.1", 7002)]


def test_the_flags_reach_the_client(cluster_file):
    parser = argparse.ArgumentParser()
    worker.add_arguments(parser, process_group=False, deadline=12.0)
    args = parser.parse_args(["--rank", "1", "--config", str(cluster_file), "--run-id", "0x10",
                              "--window", "3", "--rto", "0.05", "--loss-bound", "0.25"])
    with worker.client_from_args(args) as c:
        assert (c.worker_id, c.run, c.window, c.timeout, c.deadline, c.loss_bound) == \
            (1, 16, 3, 0.05, 12.0, 0.25)
    with worker.client_from_args(args, deadline=1.0, window=2) as c:
        assert (c.deadline, c.window) == (1.0, 2)
    for bad in (["--run-id", "0"], ["--loss-bound", "1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_a_run_id_given_as_a_flag_survives_torchruns_restarts(cluster_file, monkeypatch):
    """torchrun restarts a group with the same argv: a fixed ``--run-id`` was refused at
    once as a reused run. Its restart count is added, as to THC_RUN. (``--run`` was no name
    for it: torchrun takes it as an abbreviation of its own ``--run-path``.)"""
    parser = argparse.ArgumentParser()
    worker.add_arguments(parser, process_group=False)
    args = parser.parse_args(["--rank", "1", "--config", str(cluster_file), "--run-id", "16"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    with worker.client_from_args(args) as c:
        assert c.run == 18


@pytest.mark.parametrize("program", ["thc.app.train", "thc.bench.dlcp_worker",
                                     "thc.bench.allreduce_worker"])
def test_torchrun_passes_every_worker_flag_on(program):
    """torchrun parses the argv after ``-m program`` too, and takes a flag that abbreviates
    its own (``--run`` for ``--run-path``, ``--master`` for ``--master-addr``) or fails on it
    as ambiguous. Every flag of the worker programs must reach them untouched."""
    import importlib

    from torch.distributed.run import get_args_parser
    parser = argparse.ArgumentParser()
    importlib.import_module(program).add_arguments(parser)
    torchrun = get_args_parser()
    torchrun.exit_on_error = False
    flags = [o for a in parser._actions for o in a.option_strings
             if o.startswith("--") and o != "--help"]
    assert "--run-id" in flags and "--rendezvous" in flags
    for flag in flags:
        argv = [flag, "1"]
        try:
            got = torchrun.parse_args(["-m", program, *argv]).training_script_args
        except (argparse.ArgumentError, SystemExit) as e:
            pytest.fail(f"torchrun refuses {program}'s {flag}: {e}")
        assert got == argv, flag


def test_the_run_is_agreed_where_none_is_given(cluster_file, tmp_path, monkeypatch):
    monkeypatch.setenv("THC_RUN", "77")
    with worker.worker_client(cluster_file, 0) as c:
        assert c.run == 77
    monkeypatch.delenv("THC_RUN")
    alone = tmp_path / "alone.json"
    Cluster(jobs=(local_job(3, 1, free_port_block(1)),)).save(alone)
    with worker.worker_client(alone, 0) as c:
        assert c.run is not None
    with pytest.raises(ValueError, match="no run id"):
        worker.worker_client(cluster_file, 0)


def test_a_worker_without_a_process_group_never_imports_torch(cluster_file):
    """The smoke worker's path: build the client, agree a run alone, all without torch."""
    code = ("import sys\n"
            "from thc.collective import worker\n"
            "from thc.wire.jobs import Cluster\n"
            "from thc.testing.clusters import local_job, free_port_block\n"
            "c = worker.worker_client(Cluster(jobs=(local_job(1, 1, free_port_block(1)),)), 0)\n"
            "c.close()\n"
            "assert c.run and 'torch' not in sys.modules, sorted(m for m in sys.modules "
            "if m.startswith('torch'))[:3]\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "THC_RUN"})
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_worker_alone_needs_no_rendezvous_and_a_group_without_one_is_told_so():
    """``python -m thc.app.train`` by hand (world 1, no torchrun) failed in torch with
    "MASTER_ADDR expected"; a group of two without --master failed the same way."""
    code = ("import argparse, torch.distributed as dist\n"
            "from thc.collective import worker\n"
            "p = argparse.ArgumentParser(); worker.add_arguments(p)\n"
            "import sys; worker.init_group(p.parse_args(sys.argv[1:]))\n"
            "t = __import__('torch').ones(3); dist.all_reduce(t)\n"
            "print(dist.get_world_size(), t.tolist()); dist.destroy_process_group()\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, timeout=120)
    assert alone.returncode == 0 and alone.stdout.split("\n")[0] == "1 [1.0, 1.0, 1.0]", \
        alone.stderr[-2000:]
    two = subprocess.run([sys.executable, "-c", code, "--world", "2"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert two.returncode == 1 and "--world 2: give every worker --rendezvous IP:PORT" in two.stderr


def test_a_rank_outside_its_world_is_refused_before_the_rendezvous(capsys):
    """``--rank 3 --world 2`` reached torch, which failed on that rank only while its
    peers waited out their group's timeout (600 s) without a word."""
    parser = argparse.ArgumentParser()
    worker.add_arguments(parser)
    args = parser.parse_args(["--rank", "3", "--world", "2", "--rendezvous", "127.0.0.1:9"])
    with pytest.raises(SystemExit, match=r"--rank 3 is outside a world of 2 workers"):
        worker.init_group(args)


@pytest.mark.parametrize("env, argv, said", [
    ({"RANK": "abc"}, [], "from RANK"), ({"WORLD_SIZE": "two"}, [], "from WORLD_SIZE"),
    ({}, ["--world", "0"], "at least 1"), ({}, ["--rank", "-1"], "at least 0"),
    ({}, ["--rto", "0"], "above 0"), ({}, ["--deadline", "nan"], "not a finite number"),
    ({}, ["--window", "0"], "at least 1")])
def test_worker_flags_and_their_environment_are_checked_as_flags(monkeypatch, capsys, env,
                                                                 argv, said):
    """RANK=abc raised a bare ValueError while the parser was built; --rto 0 and
    --window 0 reached the client, which failed in every worker with a traceback."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    worker.add_arguments(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_a_rendezvous_no_one_answers_is_said_while_waiting_and_named_at_its_end():
    """A worker whose rendezvous never answered printed nothing for its whole timeout, then
    torch's traceback; and torch's store, connecting again after its timeout, kept a
    rendezvous of 5 s waiting 9 to 15 s: the timeout now bounds it."""
    import time

    from thc.collective.watchdog import EXIT_CODE
    from thc.collective.worker import RENDEZVOUS_GRACE
    timeout = 4
    code = ("import argparse, sys\n"
            "from thc.collective import worker\n"
            "p = argparse.ArgumentParser(); worker.add_arguments(p)\n"
            f"worker.init_group(p.parse_args(sys.argv[1:]), timeout={timeout})\n")
    p = subprocess.Popen([sys.executable, "-c", code, "--world", "2", "--rank", "1",
                          "--rendezvous", "127.0.0.1:1"], stderr=subprocess.PIPE, text=True)
    first = p.stderr.readline().strip()
    joined = time.monotonic()
    rest = p.stderr.read()
    p.wait(timeout=120)
    waited = time.monotonic() - joined
    assert first == "rank 1 of 2: joining the process group at 127.0.0.1:1", first
    last = rest.strip().splitlines()[-1]
    if p.returncode == 1:   # torch's own error came first
        assert last.startswith("rank 1 of 2: no process group formed at 127.0.0.1:1 "
                               "(DistNetworkError: "), last
    else:
        assert p.returncode == EXIT_CODE, rest[-2000:]
        assert last == (f"thc: rank 1 of 2: no process group formed at 127.0.0.1:1 within its "
                        f"timeout, {timeout} s; ending the process")
    assert waited < timeout + RENDEZVOUS_GRACE + 1.5, waited
