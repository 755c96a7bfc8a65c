"""Transport impairments: jitter (random per-packet delay, for kernels without netem) and the
client's timeout naming the aggregator, not a worker, when the aggregator falls silent."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from thc.codec.packing import pack_bits
from thc.net.aggregator import Aggregator
from thc.net.client import AggregationClient, AggregationTimeout
from thc.net.impair import Impairment
from thc.testing.clusters import free_port_block, local_job
from thc.wire import protocol as P


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_jitter_delays_every_packet_within_bounds_and_loses_none():
    clock = Clock()
    imp = Impairment(jitter=0.01, seed=7, clock=clock)
    sent_at, arrived = {}, []
    for i in range(200):
        sent_at[i] = clock.t
        imp.send(lambda x: arrived.append((x, clock.t)), i)
        clock.t += 0.0005
    assert len(arrived) < 200, "a jittered packet went out with no delay at all"
    while (wait := imp.next_release()) is not None:
        clock.t += wait
        imp.release_due()
    assert sorted(x for x, _ in arrived) == list(range(200))
    delays = [t - sent_at[x] for x, t in arrived]
    assert min(delays) >= 0 and max(delays) <= 0.01 + 1e-9
    order = [x for x, _ in arrived]
    assert order != sorted(order), "uniform jitter of 10 ms over 0.5 ms gaps must reorder"
    assert imp.stats["delayed"] == 200


def test_flush_releases_only_due_packets_unless_shutting_down():
    clock = Clock()
    imp = Impairment(jitter=1.0, seed=1, clock=clock)
    out = []
    for i in range(20):
        imp.send(out.append, i)
    imp.flush()
    assert len(out) < 20
    imp.flush(everything=True)
    assert sorted(out) == list(range(20)) and imp.next_release() is None


def test_a_reordered_packet_leaves_through_the_sender_it_was_given():
    """A held packet went out through whichever sender passed it later (and through the
    plain socket at a flush), so a DLCP-marked packet could leave with another's mark."""
    imp = Impairment(reorder=0.5, seed=3)
    out = []
    for i in range(40):
        imp.send(lambda x, mark=i % 2: out.append((mark, x)), i)
    imp.flush()
    assert imp.stats["reordered"] > 0 and sorted(x for _, x in out) == list(range(40))
    assert all(mark == x % 2 for mark, x in out)


def test_jitter_bounds_are_checked():
    with pytest.raises(ValueError, match="jitter"):
        Impairment(jitter=-0.1)
    assert not Impairment().active and Impairment(jitter=0.001).active


def test_sums_exact_with_jitter_on_workers_and_aggregator():
    job = local_job(1, 3, free_port_block(3), pool_size=16)
    n = job.lanes * 96
    agg = Aggregator([job], impair=Impairment(jitter=0.005, seed=99))
    addr = agg.start()
    rng = np.random.default_rng(5)
    idx = rng.integers(0, 16, (job.n_workers, n)).astype(np.uint8)
    out, errors = {}, []

    def worker(w):
        try:
            with AggregationClient(job, w, addr, run=3, deadline=20.0,
                                   impair=Impairment(jitter=0.005, seed=w)) as c:
                out[w] = c.aggregate(pack_bits(idx[w], P.INDEX_BITS))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(job.n_workers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        agg.stop()
    assert not errors, errors
    ref = np.asarray(job.table, dtype=np.uint16)[idx].sum(axis=0)
    for w in range(job.n_workers):
        np.testing.assert_array_equal(out[w], ref)
    assert agg.impair.stats["delayed"] >= n // job.lanes


def test_a_silent_aggregator_is_named_as_the_cause_not_a_worker():
    """One PENDING (worker 1 missing), then silence, as when a switch is killed: the timeout
    must blame the aggregator, not worker 1, which may be fine. The client calls it silence
    after half its deadline without a reply (max_timeout is short): the PENDING, answering
    the first packet, may come up to 1.2 s late without changing the verdict."""
    job = local_job(1, 2, free_port_block(2), pool_size=8)
    fake = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    fake.bind(("127.0.0.1", 0))
    fake.settimeout(5)

    def answer_once():
        data, src = fake.recvfrom(4096)
        h = P.HEADER_STRUCT.unpack_from(data)
        fake.sendto(P.HEADER_STRUCT.pack(P.PktType.PENDING, h[1], h[2], h[3], h[4], 1, h[6],
                                         h[7], 0b01, h[9], job.new_epoch(nonce=0x1234)), src)

    t = threading.Thread(target=answer_once)
    t.start()
    try:
        with AggregationClient(job, 0, fake.getsockname(), run=5, deadline=2.4,
                               max_timeout=0.1, window=1) as c:
            with pytest.raises(AggregationTimeout, match="stopped answering") as e:
                c.aggregate(np.zeros(job.lanes // 2, dtype=np.uint8))
        assert e.value.missing is None
    finally:
        t.join(5)
        fake.close()


def test_the_impairment_flags_build_the_impairment_they_name():
    import argparse
    parser = argparse.ArgumentParser()
    Impairment.add_arguments(parser, "chunks")
    imp = Impairment.from_args(parser.parse_args(["--loss", "0.1", "--dup", "0.2",
                                                  "--reorder", "0.3", "--jitter", "0.01"]), seed=4)
    assert (imp.loss, imp.dup, imp.reorder, imp.jitter, imp.seed) == (0.1, 0.2, 0.3, 0.01, 4)
    assert not Impairment.from_args(parser.parse_args([])).active
