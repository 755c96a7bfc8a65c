"""Sharded software aggregators: the shard map in the job config, the client's routing and
its per-shard restarts and timeouts, and `thc aggregator --shard`. The aggregation semantics
per shard are the conformance suite's (its ``sharded`` harness)."""
from __future__ import annotations

import argparse
import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from thc.codec.packing import pack_bits
from thc.codec.params import THCParams
from thc.collective.allreduce import THCAllReduce
from thc.net import aggregator as agg_cli
from thc.net.aggregator import Aggregator
from thc.net.client import (AggregationClient, AggregationRefused, AggregationTimeout,
                            AggregatorRestarted)
from thc.testing.clusters import free_port_block, local_job
from thc.wire import protocol as P
from thc.wire.jobs import Cluster, ConfigError, Job, Shard
from tests.test_transport import datapath  # noqa: F401 (a fixture)

PARAMS = THCParams(granularity=30, seed=3)


def _sharded(job: Job, n: int, base: int | None = None) -> Job:
    base = free_port_block(n) if base is None else base
    return dataclasses.replace(
        job, shards=tuple(Shard("127.0.0.1", base + i) for i in range(n))).validate()


def _chunks(job, values):
    return np.concatenate([pack_bits(np.full(job.lanes, v, np.uint8), P.INDEX_BITS)
                           for v in values])


def test_shard_map_round_trips_and_bad_maps_are_refused():
    job = _sharded(local_job(1, 2, free_port_block(2)), 3)
    assert job.n_shards == 3 and [job.shard_of(s) for s in range(5)] == [0, 1, 2, 0, 1]
    again = Cluster.from_dict(Cluster(jobs=(job,)).to_dict()).jobs[0]
    assert again == job
    assert "shards" not in local_job(2, 1, free_port_block(1)).to_dict()
    with pytest.raises(ConfigError, match="two shards share an address"):
        dataclasses.replace(job, shards=(Shard("127.0.0.1", 9), Shard("127.0.0.1", 9))).validate()
    w = job.workers[0]
    with pytest.raises(ConfigError, match="a shard has a worker's address"):
        dataclasses.replace(job, shards=(Shard(w.ip, w.port),)).validate()
    with pytest.raises(ConfigError, match="bad job description"):
        Job.from_dict({**job.to_dict(), "shards": [{"address": "x"}]})
    many = tuple(Shard(f"10.{k >> 8 & 255}.{k & 255}.1", 48879) for k in range(P.MAX_SHARDS))
    dataclasses.replace(job, shards=many).validate()
    # A wrong_shard refusal names the count in 16 bits: one more wrapped it to 0 shards.
    with pytest.raises(ConfigError, match="at most 65535"):
        dataclasses.replace(job, shards=many + (Shard("10.255.255.2", 48879),)).validate()


def test_an_aggregator_must_know_which_shard_it_is():
    job = _sharded(local_job(1, 2, free_port_block(2)), 2)
    with pytest.raises(ConfigError, match="--shard 0..1"):
        Aggregator([job])
    with pytest.raises(ConfigError, match="shard 2 is not in job 1's shard map"):
        Aggregator([job], shard=2)
    with pytest.raises(ValueError, match="pass no aggregator address"):
        AggregationClient(job, 0, ("127.0.0.1", 9))
    with pytest.raises(ValueError, match="pass the aggregator's address"):
        AggregationClient(local_job(2, 1, free_port_block(1)), 0)


def test_thc_aggregator_cli_refuses_a_sharded_config_without_shard(tmp_path, capsys):
    job = _sharded(local_job(1, 2, free_port_block(2)), 2)
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(job,)).save(cfg)
    ns = argparse.ArgumentParser()
    agg_cli.add_arguments(ns)
    args = ns.parse_args(["--config", str(cfg), "--listen", "127.0.0.1:0"])
    assert agg_cli.run(args) == 2
    assert "--shard" in capsys.readouterr().err
    # at shard 0's address as shard 1: every chunk sent there would be refused as wrong_shard
    mine, other = job.shards[1], job.shards[0]
    args = ns.parse_args(["--config", str(cfg), "--listen", f"{other.ip}:{other.port}",
                          "--shard", "1"])
    assert agg_cli.run(args) == 2
    assert f"shard map puts shard 1 at {mine.ip}:{mine.port}" in capsys.readouterr().err
    args = ns.parse_args(["--config", str(cfg), "--listen", f"localhost:{mine.port}",
                          "--shard", "1", "--duration", "0.1", "--stats-interval", "0"])
    assert agg_cli.run(args) == 0
    assert "as shard 1" in capsys.readouterr().out


def _allreduce(job, xs, addr_of, ran=None):
    """THC all-reduce of ``xs`` (one per worker thread); ``addr_of(job)``: client's address;
    ``ran``: a set that collects the datapaths the clients' rounds ran in."""
    out, errors = [None] * len(xs), []

    def work(w):
        try:
            with AggregationClient(job, w, addr_of, run=1) as c:
                ar = THCAllReduce.through_aggregator(c, PARAMS,
                                                     generator=torch.Generator().manual_seed(w))
                out[w] = ar(xs[w])
                if ran is not None:
                    ran.add(ar.transport.datapath)
        except Exception as e:  # surfaced below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(w,)) for w in range(len(xs))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors, errors
    return out


def test_sharded_allreduce_equals_the_central_one_bit_for_bit(datapath):
    """Three workers, three shards (not a power of two): every shard aggregates its third of
    the chunks and the estimate is exactly the central aggregator's."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(40_000, generator=g) for _ in range(3)]
    job = local_job(1, 3, free_port_block(3), pool_size=32, granularity=PARAMS.granularity,
                    table=PARAMS.table)
    with Aggregator([job]) as central:
        want = _allreduce(job, xs, central.start())
    sharded = _sharded(job, 3)
    shards = [Aggregator([sharded], shard=i) for i in range(3)]
    try:
        for a, s in zip(shards, sharded.shards):
            a.start(s.ip, s.port)
        ran = set()
        got = _allreduce(sharded, xs, None, ran)
        assert ran == {datapath}
        counts = [a.counters() for a in shards]
    finally:
        for a in shards:
            a.stop()
    for w in range(3):
        torch.testing.assert_close(got[w], want[w], rtol=0, atol=0)
    completions = [c["jobs"][1]["completions"] for c in counts]
    assert min(completions) > 0 and max(completions) - min(completions) <= 2, completions
    assert all(sum(c["drops"].values()) == 0 for c in counts), counts


def test_a_restarted_shard_is_named_and_a_silent_one_times_out(datapath):
    job = _sharded(local_job(1, 1, free_port_block(1), table=list(range(16))), 2)
    first = [Aggregator([job], shard=i, nonce=0x10 + i) for i in range(2)]
    for a, s in zip(first, job.shards):
        a.start(s.ip, s.port)
    restarted = None
    try:
        with AggregationClient(job, 0, run=3, deadline=1.0) as c:
            r = c.reduce(_chunks(job, [1, 2, 3, 4]))
            np.testing.assert_array_equal(r.sums, np.repeat([1, 2, 3, 4], job.lanes))
            assert c.epochs == [job.new_epoch(nonce=0x10), job.new_epoch(nonce=0x11)]
            assert r.datapath == datapath
            first[1].stop()
            restarted = Aggregator([job], shard=1, nonce=0x99)
            restarted.start(job.shards[1].ip, job.shards[1].port)
            with pytest.raises(AggregatorRestarted) as e:
                c.aggregate(_chunks(job, [5, 6]))
            assert e.value.shard == 1 and (e.value.old_epoch & P.NONCE_MASK,
                                           e.value.new_epoch & P.NONCE_MASK) == (0x11, 0x99)
            assert f"shard 1 at 127.0.0.1:{job.shards[1].port}" in str(e.value)
            c.run = 4  # a new run starts cleanly on both shards
            np.testing.assert_array_equal(c.aggregate(_chunks(job, [7, 8])),
                                          np.repeat([7, 8], job.lanes))
            restarted.stop()
            with pytest.raises(AggregationTimeout,
                               match=f"no answer from aggregator shard 1 at 127.0.0.1:"
                                     f"{job.shards[1].port} \\(down, unreachable") as e:
                c.aggregate(_chunks(job, [9, 10]))
            assert "pool" not in str(e.value)   # it answered before: no configuration hint
    finally:
        for a in first + [restarted]:
            a.stop()


def test_shard_maps_that_differ_between_workers_and_shards_fail_at_once(datapath):
    """The shards run with each other's indices (their map differs from the workers'): the
    first chunk is refused as wrong_shard, naming the shard, long before the deadline."""
    job = _sharded(local_job(1, 1, free_port_block(1), table=list(range(16))), 2)
    crossed = [Aggregator([job], shard=1 - i) for i in range(2)]
    for a, s in zip(crossed, job.shards):
        a.start(s.ip, s.port)
    try:
        with AggregationClient(job, 0, run=3, deadline=30.0) as c:
            t0 = time.monotonic()
            with pytest.raises(AggregationRefused, match=r"wrong_shard\): the shard \(shard [01] "
                                                         r"of 2\) does not own this chunk"):
                c.aggregate(_chunks(job, [1, 2]))
            assert time.monotonic() - t0 < 5
    finally:
        for a in crossed:
            a.stop()
    # the shard whose refusal the client raised counted it (the other may have been stopped
    # before its chunk was read)
    assert sum(a.counters()["drops"]["wrong_shard"] for a in crossed) >= 1


def test_bench_ideal_bytes_per_layout():
    """The busiest link per layout, as docs/mininet.md states it for 4 workers and 25M
    elements: sharded about 5.2x fewer bytes than the FP32 ring, central 1.49x."""
    from thc.emu.wirebytes import fp32_wire_bytes, thc_wire_bytes

    numel, p, lanes = 25_000_000, 4, P.max_software_lanes(8)
    fp32 = fp32_wire_bytes(numel, p)["up"]
    central = thc_wire_bytes(numel, lanes, layout="central", p=p)
    sharded = thc_wire_bytes(numel, lanes, layout="sharded", p=p)
    assert sharded["up"] == sharded["down"] == sharded["busiest"]
    assert sharded["busiest"] == pytest.approx(0.75 * (central["up"] + central["down"]))
    assert central["busiest"] == p * central["down"]
    assert fp32 / sharded["busiest"] == pytest.approx(5.2, abs=0.05)
    assert fp32 / central["busiest"] == pytest.approx(1.49, abs=0.01)
    fat = thc_wire_bytes(numel, lanes, layout="central", p=p, agg_bw_factor=p)
    assert fat["busiest"] == max(fat["up"], fat["down"])


def test_the_summed_counters_of_a_sharded_aggregator_keep_its_failed_sends():
    """The shards' sum (what Mininet rows read) kept drops and job counters only."""
    from thc.emu.aggprocs import sum_shard_counters
    job = local_job(1, 2, 30000, pool_size=8, lanes=16)
    a, b = Aggregator([job]), Aggregator([job])
    a.send_errors, b.send_errors = 3, 2
    assert sum_shard_counters([a.counters(), b.counters()])["send_errors"] == 5


def test_a_worker_given_another_shard_map_is_named_as_a_possible_cause(datapath):
    """Worker 1's map lists the shards the other way round: its chunks are refused as
    wrong_shard, which only it hears; worker 0 times out, and its error says that a missing
    worker may hold another shard map, not only that it is gone."""
    job = _sharded(local_job(1, 2, free_port_block(2), table=list(range(16))), 2)
    swapped = dataclasses.replace(job, shards=job.shards[::-1]).validate()
    shards = [Aggregator([job], shard=i) for i in range(2)]
    for a, s in zip(shards, job.shards):
        a.start(s.ip, s.port)
    errors: list = [None, None]

    def work(w, j):
        try:
            with AggregationClient(j, w, run=3, deadline=1.0) as c:
                c.aggregate(_chunks(j, [1, 2]))
        except Exception as e:  # asserted below
            errors[w] = e

    try:
        ts = [threading.Thread(target=work, args=(w, j)) for w, j in ((0, job), (1, swapped))]
        [t.start() for t in ts]
        [t.join() for t in ts]
    finally:
        for a in shards:
            a.stop()
    assert isinstance(errors[1], AggregationRefused) and "wrong_shard" in str(errors[1])
    assert isinstance(errors[0], AggregationTimeout) and errors[0].missing == [1], errors[0]
    assert "given another shard map than this worker's" in str(errors[0]), errors[0]
    assert "switch_port" not in str(errors[0])   # shards are software aggregators


def test_thc_aggregator_refuses_a_shard_index_where_no_job_is_sharded(tmp_path, capsys):
    """The help says --shard is for sharded jobs: with a central cluster file it started as
    'shard 0', a central aggregator under another name."""
    cfg = tmp_path / "central.json"
    Cluster(jobs=(local_job(1, 2, free_port_block(2)),)).save(cfg)
    ns = argparse.ArgumentParser()
    agg_cli.add_arguments(ns)
    args = ns.parse_args(["--config", str(cfg), "--listen", "127.0.0.1:0", "--shard", "0"])
    assert agg_cli.run(args) == 2
    assert "--shard 0: no job of the cluster file has a shard map" in capsys.readouterr().err
