"""Run ids and epochs on the host side: the helpers, the client's checks, agreement over Gloo."""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import socket
import threading
import time

import numpy as np
import pytest

from thc.codec.packing import pack_bits
from thc.net.aggregator import Aggregator
from thc.net.client import AggregationClient, AggregatorRestarted
from thc.testing.clusters import free_port_block, local_job
from thc.wire import protocol as P
from thc.wire.jobs import Shard
from tests import procs
from tests.test_transport import datapath  # noqa: F401 (a fixture)


def test_run_ids_are_nonzero_32_bit_integers():
    for bad in (0, -1, P.SEQ_MOD, True, 1.5, "3"):
        with pytest.raises(ValueError, match="run id"):
            P.check_run(bad)
    assert P.check_run(P.SEQ_MOD - 1) == P.SEQ_MOD - 1


def test_clock_run_ids_skip_zero_and_grow_in_serial_order():
    assert P.run_from_clock(0.05) == 1
    assert P.run_from_clock(123.4) == 1234
    wrap = P.SEQ_MOD / 10
    assert P.run_from_clock(wrap) == 1
    assert P.seq_newer(P.run_from_clock(wrap + 1), P.run_from_clock(wrap - 1))


def test_run_from_env():
    assert P.run_from_env({}) is None
    assert P.run_from_env({"THC_RUN": "0x10"}) == 16
    assert P.run_from_env({"THC_RUN": "08"}) == 8   # a zero-padded decimal, not octal
    assert P.run_from_env({"THC_RUN": " 08\n"}) == P.run_from_env({"THC_RUN": "8\n"}) == 8
    for bad in ("0", "00", "abc", str(P.SEQ_MOD)):
        with pytest.raises(ValueError, match="THC_RUN"):
            P.run_from_env({"THC_RUN": bad})
    assert P.run_from_env({"THC_RUN": "7", "TORCHELASTIC_RESTART_COUNT": "2"}) == 9
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT='²' is not a count"):
        P.run_from_env({"THC_RUN": "7", "TORCHELASTIC_RESTART_COUNT": "²"})
    # restarts past 2^32 - 1 skip run 0 and stay distinct (two got run 1 before)
    top = P.SEQ_MOD - 2
    runs = [P.after_restarts(top, {"TORCHELASTIC_RESTART_COUNT": str(k)}) for k in range(5)]
    assert runs == [P.SEQ_MOD - 2, P.SEQ_MOD - 1, 1, 2, 3]


def test_epochs_are_nonzero_and_fresh():
    epochs = {P.new_epoch() for _ in range(50)}
    assert 0 not in epochs and len(epochs) > 45
    job = local_job(1, 1, free_port_block(1))
    installed = [Aggregator([job]).counters()["epochs"][job.job_id] for _ in range(20)]
    assert all(e >> P.EPOCH_TAG_SHIFT == job.config_tag and e & P.NONCE_MASK
               for e in installed) and len(set(installed)) > 15


def test_client_without_a_run_id_says_how_to_get_one(monkeypatch):
    monkeypatch.delenv("THC_RUN", raising=False)
    job = local_job(1, 2, free_port_block(2))
    with AggregationClient(job, 0, ("127.0.0.1", 9)) as c:
        with pytest.raises(ValueError, match="no run id.*THC_RUN"):
            c.aggregate(np.zeros(job.lanes // 2, np.uint8))
    monkeypatch.setenv("THC_RUN", "77")
    with AggregationClient(job, 0, ("127.0.0.1", 9)) as c:
        assert c.run == 77


def _chunk(job, value):
    return pack_bits(np.full(job.lanes, value, np.uint8), P.INDEX_BITS)


def test_restarted_aggregator_raises_naming_address_and_epochs():
    job = local_job(1, 1, free_port_block(1), table=list(range(16)))
    first = Aggregator([job], nonce=0x11)
    addr = first.start()
    with AggregationClient(job, 0, addr, run=3, deadline=2.0) as c:
        np.testing.assert_array_equal(c.aggregate(_chunk(job, 5)), 5)
        first.stop()
        with Aggregator([job], nonce=0x22) as second:
            second.start(*addr)
            with pytest.raises(AggregatorRestarted) as e:
                c.aggregate(_chunk(job, 6))
        assert (e.value.old_epoch, e.value.new_epoch) == (job.new_epoch(nonce=0x11),
                                                          job.new_epoch(nonce=0x22))
        assert f"{addr[0]}:{addr[1]}" in str(e.value) and "run 3" in str(e.value)
        # A new run starts cleanly on the restarted aggregator.
        with Aggregator([job], nonce=0x33) as third:
            third.start(*addr)
            c.run = 4
            np.testing.assert_array_equal(c.aggregate(_chunk(job, 7)), 7)


def test_a_strangers_result_with_the_real_epoch_is_ignored(datapath):
    """Issue case 2: a RESULT from a socket that is not the aggregator, with the job's real
    epoch, run and fields, and sums no two workers can make, is ignored and counted."""
    job = local_job(1, 2, free_port_block(2), table=list(range(16)))
    with Aggregator([job], nonce=0x77) as agg:
        addr = agg.start()
        out = {}
        # no retransmission within the round (a late one's RESULT would be ignored too)
        with AggregationClient(job, 0, addr, run=5, timeout=5.0, max_timeout=5.0) as c:
            t = threading.Thread(target=lambda: out.update(s=c.aggregate(_chunk(job, 2))))
            t.start()
            rogue = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            forged = P.Header(P.PktType.RESULT, 0, job.job_id, 0, 0, 2, 0, 0, 3, 5,
                              job.new_epoch(nonce=0x77))
            rogue.sendto(forged.pack() + bytes([99]) * P.payload_bytes(
                P.PktType.RESULT, job.lanes), c.sock.getsockname())
            rogue.close()
            time.sleep(0.2)  # let the forgery arrive first: it must not end the round
            with AggregationClient(job, 1, addr, run=5) as c1:
                c1.aggregate(_chunk(job, 3))
            t.join(10)
            # ignored, or dropped unread when it beat the round's first packet
            assert c.stats.ignored + c.stats.drained == 1
        np.testing.assert_array_equal(out["s"], 5)


def _agree(rank, world, port, q, env, seats):
    import os

    import torch.distributed as dist

    from thc.collective.worker import agree_run
    os.environ.pop("THC_RUN", None)
    if env.get(rank) is not None:
        os.environ["THC_RUN"] = env[rank]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        q.put((rank, agree_run(seat=seats[rank] if seats else None)))
    except ValueError as e:
        q.put((rank, str(e)))
    dist.destroy_process_group()


def _agreed(env: dict, seats: list | None = None) -> dict:
    """Each of three gloo ranks' agree_run(), ``THC_RUN`` set per rank from ``env`` (and its
    ``seats``, where given): its run id or its error's message."""
    q = procs.queue()
    port = free_port_block(1, tcp=True)
    ps = [procs.start(_agree, r, 3, port, q, env, seats) for r in range(3)]
    try:
        return dict(q.get(timeout=50) for _ in ps)
    finally:
        [p.join(30) for p in ps]


def test_workers_agree_on_rank_0s_run_over_gloo():
    runs = _agreed({})
    assert len(set(runs.values())) == 1 and runs[0] != 0
    assert _agreed({0: "77", 1: "77", 2: "77"}) == {0: 77, 1: 77, 2: 77}


@pytest.mark.parametrize("bad", [1, 0])
def test_a_run_id_that_does_not_parse_on_one_rank_fails_on_every_rank_at_once(bad):
    """Rank 1 raised before the collective and its peers waited in it until the group's
    timeout; every rank now names the rank, rank 0 too, and that rank says what is wrong."""
    out = _agreed({bad: "12x"})
    assert "THC_RUN" in out[bad] and "'12x'" in out[bad], out
    for rank in {0, 1, 2} - {bad}:
        assert out[rank] == f"rank {bad}'s THC_RUN is not a run id (that rank says why)", out


@pytest.mark.parametrize("given", [1, 2])
def test_a_run_id_set_on_some_ranks_only_fails_on_every_rank_at_once(given):
    """THC_RUN on rank 1 only: rank 1 took it without a collective and the others waited in
    a broadcast it never joined, until the group's timeout (30 minutes by default), whose
    error named neither THC_RUN nor the difference. Every rank now says which rank holds
    which id, well within the group's timeout (60 s here)."""
    start = time.monotonic()
    out = _agreed({given: "12345"})
    assert time.monotonic() - start < 45
    held = ", ".join(f"rank {r}: {'12345' if r == given else 'none'}" for r in range(3))
    for rank in range(3):
        assert held in out[rank], out
        assert "THC_RUN" in out[rank]


def _seats(jobs, ids=(0, 1, 2)):
    from thc.collective.worker import job_seat
    return [job_seat(w, job) if job is not None else None for w, job in zip(ids, jobs)]


def test_ranks_that_are_one_worker_or_hold_unlike_jobs_fail_at_once():
    """Two ranks given one worker id, or a rank given another cluster file (another table,
    or a shard map where the others send to one aggregator), went on to their rounds: with
    unlike shard maps the chunks go to unlike aggregators, and every round times out naming
    as missing a worker that is sending. Every rank now names the ranks at the run's
    agreement."""
    job = local_job(1, 3, free_port_block(3))
    other = dataclasses.replace(job, table=tuple(2 * v for v in range(16))).validate()
    sharded = dataclasses.replace(job, shards=(Shard("127.0.0.1", 1), Shard("127.0.0.1", 2)))
    ok = _agreed({0: "77", 1: "77", 2: "77"}, _seats([job] * 3))
    assert ok == {0: 77, 1: 77, 2: 77}
    out = _agreed({}, _seats([job] * 3, ids=(0, 1, 0)))
    assert set(out.values()) == {"ranks 0, 2 are all worker 0 of job 1: give each rank a "
                                 "worker id of its own"}, out
    for jobs, named in [([job, other, job], f"rank 1: job 1, configuration tag "
                         f"{other.config_tag:#06x}, 1 aggregator;"),
                        ([job, job, sharded], "rank 2: job 1, configuration tag "
                         f"{job.config_tag:#06x}, 2 aggregators)"),
                        ([job, None, job], "rank 1: a job of another number of workers")]:
        out = _agreed({}, _seats(jobs))
        for rank in range(3):
            assert "the ranks hold unlike jobs" in out[rank] and named in out[rank], out


def _client_of(rank, port, q, clusters, run=None):
    import os

    import torch.distributed as dist

    from thc.collective.worker import worker_client
    os.environ.pop("THC_RUN", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=len(clusters), timeout=datetime.timedelta(seconds=60))
    try:
        with worker_client(clusters[rank], rank, run=run) as c:
            q.put((rank, c.run))
    except (ValueError, RuntimeError) as e:
        q.put((rank, str(e)))
    dist.destroy_process_group()


def _clients_of(clusters, run=None) -> dict:
    """Each rank's worker_client of ``clusters[rank]`` over gloo: its run or its error."""
    q = procs.queue()
    port = free_port_block(1, tcp=True)
    ps = [procs.start(_client_of, r, port, q, clusters, run) for r in range(len(clusters))]
    try:
        return dict(q.get(timeout=50) for _ in ps)
    finally:
        [p.join(30) for p in ps]


def test_worker_clients_of_unlike_cluster_files_fail_at_once():
    """A rank given a shard map its peers lack sends its chunks to other aggregators, and
    every round times out naming as missing a worker that is sending. worker_client agrees
    the run with every rank's seat, and every rank names the one that differs."""
    from thc.wire.jobs import Cluster
    job = local_job(1, 3, free_port_block(3))
    sharded = dataclasses.replace(job, shards=(Shard("127.0.0.1", 1), Shard("127.0.0.1", 2)))
    out = _clients_of([Cluster((job,)), Cluster((job,)), Cluster((sharded,))])
    for rank in range(3):
        assert "the ranks hold unlike jobs" in str(out[rank]) and \
            "rank 2: job 1, configuration tag" in str(out[rank]), out


def test_a_rank_left_alone_in_the_run_agreement_names_the_likely_cause():
    """Given its run id, a rank whose job has another number of workers than the group has
    ranks cannot tell that its peers agree runs over the group, and skips the agreement;
    a peer whose job is of the group's size waits there until that rank stops. Its error
    says what torch's cannot: which ranks skip the agreement, and what to give them."""
    from thc.wire.jobs import Cluster
    base = free_port_block(3)
    out = _clients_of([Cluster((local_job(1, 2, base),)), Cluster((local_job(1, 3, base),))],
                      run=5)
    assert out[1] == 5, out
    assert "the run agreement over the process group's 2 ranks failed" in out[0] and \
        "another number of workers than the group has ranks" in out[0], out


def test_torchrun_restarts_run_as_newer_runs():
    """torchrun keeps THC_RUN across its restarts: the restart count makes each one newer."""
    first = P.run_from_env({"THC_RUN": "100"})
    again = P.run_from_env({"THC_RUN": "100", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert again == 102 and P.seq_newer(again, first)
    assert P.run_from_env({"THC_RUN": str(P.SEQ_MOD - 1), "TORCHELASTIC_RESTART_COUNT": "1"}) == 1
    with pytest.raises(ValueError, match="not a count"):
        P.run_from_env({"THC_RUN": "5", "TORCHELASTIC_RESTART_COUNT": "x"})


@pytest.mark.parametrize("datapath", ["python", "compiled"])
def test_a_failed_round_ends_the_run_so_a_retry_cannot_get_stale_sums(datapath):
    """A round that timed out leaves this worker's contributions (and completed chunks) in
    the slots of its sequence numbers: a retry under the same run would be answered from
    them (a short or stale sum, no error). The client refuses; a new run sums exactly."""
    from thc.net import fastclient
    from thc.net.client import RunFailed
    if datapath == "compiled" and fastclient.CLIENT_UNAVAILABLE:
        pytest.skip(f"compiled client: {fastclient.CLIENT_UNAVAILABLE}")
    job = local_job(1, 2, free_port_block(2), table=list(range(16)))
    with Aggregator([job]) as agg:
        addr = agg.start()
        with AggregationClient(job, 0, addr, run=8, deadline=0.5, datapath=datapath) as c0:
            with pytest.raises(TimeoutError):
                c0.aggregate(_chunk(job, 1))  # worker 1 never comes
            with pytest.raises(RunFailed, match="run 8 failed.*new run"):
                c0.aggregate(_chunk(job, 4))
            out = {}
            c0.run = 9
            with AggregationClient(job, 1, addr, run=9, datapath=datapath) as c1:
                t = threading.Thread(target=lambda: out.update(s=c0.aggregate(_chunk(job, 4))))
                t.start()
                np.testing.assert_array_equal(c1.aggregate(_chunk(job, 6)), 10)
                t.join(10)
            np.testing.assert_array_equal(out["s"], 10)


def test_an_install_whose_epoch_lacks_the_jobs_tag_is_refused():
    """Every engine installs through the model's rule: an epoch whose high bits are not the
    job's configuration tag would make every client refuse the job's replies."""
    from thc.wire.jobs import ConfigError
    from thc.wire.model import Model
    job = local_job(1, 1, free_port_block(1))
    other = local_job(1, 1, free_port_block(1), pool_size=32)
    Model().install(job, job.new_epoch(nonce=5))
    with pytest.raises(ConfigError, match="does not carry the job's configuration tag"):
        Model().install(job, other.new_epoch(nonce=5))
    assert job.new_epoch(nonce=5) & P.NONCE_MASK == 5 and job.new_epoch(nonce=5) > 0
    assert len({job.new_epoch(previous=job.new_epoch(nonce=7)) for _ in range(50)}) > 40


def test_no_reinstall_draws_one_of_the_jobs_last_15_epochs_again(monkeypatch):
    """A switch tells RESETs queued from an earlier install by its epoch (thc_install): a
    nonce drawn anew at each install came back two installs later (here, draws that
    alternate), and the RESETs of that install counted as the new one's. Stepped in plain
    order, epochs a few places apart differed in low bits only."""
    job = local_job(1, 1, free_port_block(1))
    draws = itertools.cycle([5, 9, P.NONCE_STEP - 1])
    monkeypatch.setattr(P.secrets, "randbelow", lambda n: next(draws) % n)
    chain = [job.new_epoch(nonce=P.NONCE_MASK - 3)]
    for _ in range(200):
        chain.append(job.new_epoch(chain[-1]))
    assert all(len(set(chain[i:i + 16])) == 16 for i in range(len(chain) - 15))
    assert {P.epoch_tag(e) for e in chain} == {job.config_tag}
    assert 0 not in {e & P.NONCE_MASK for e in chain}
    # a Tofino keys a worker's record on run ^ epoch: steps of a few places (these draws)
    # must not give epochs that differ in low bits alone, as two runs' ids often do (runs
    # 1001 and 1007 xor to 6); random steps do so no more often than random epochs
    assert min(a ^ b for i, a in enumerate(chain) for b in chain[i + 1:i + 16]) >= 1 << 8


def test_an_install_with_no_epoch_left_to_draw_is_refused():
    """Every epoch a re-install can step to is one to avoid: an error, not an endless draw."""
    job = local_job(1, 1, free_port_block(1))
    last = job.new_epoch(nonce=9)
    place = P.nonce_place(9)
    reachable = {job.new_epoch(nonce=P.nonce_at(place + k)) for k in range(1, P.NONCE_STEP + 1)}
    with pytest.raises(ValueError, match="no epoch of tag .* left to draw"):
        job.new_epoch(last, avoid=reachable)
    assert job.new_epoch(last, avoid=reachable - {max(reachable)}) == max(reachable)


def test_a_client_given_its_run_joins_no_collective_and_an_agreed_one_agrees_once(monkeypatch):
    """Jobs given their own run ids in one torch world (or a world whose other ranks are not
    THC workers) must not meet in a collective; a client whose id came from THC_RUN agrees
    it over the group once, however many transports (a hook's reducers) it serves."""
    import torch.distributed as dist

    from thc.collective.transports import AggregatorTransport
    job = local_job(1, 2, free_port_block(2))
    gathers = []
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1, tcp=True)}",
                            rank=0, world_size=1)
    try:
        real = dist.all_gather
        monkeypatch.setattr(dist, "all_gather",
                            lambda *a, **k: gathers.append(1) or real(*a, **k))
        with AggregationClient(job, 0, ("127.0.0.1", 9), run=5) as c:
            AggregatorTransport(c)
            AggregatorTransport(c)
            assert gathers == [] and c.run == 5
        monkeypatch.setenv("THC_RUN", "77")
        with AggregationClient(job, 0, ("127.0.0.1", 9)) as c:
            AggregatorTransport(c)
            AggregatorTransport(c)
            assert gathers == [1] and c.run == 77
        monkeypatch.delenv("THC_RUN")
        with AggregationClient(job, 0, ("127.0.0.1", 9)) as c:   # rank 0's clock, once
            AggregatorTransport(c)
            agreed = c.run
            AggregatorTransport(c)
            assert gathers == [1, 1] and c.run == agreed is not None
    finally:
        dist.destroy_process_group()


def test_a_transport_whose_deferred_run_agreement_was_never_made_refuses_its_rounds():
    """Built under run_agreement_deferred() (a DDP hook's factory), a transport agrees its
    client's run when agree_run() is called; one never called would run its rounds with the
    run unchecked. Its rounds are refused, naming the call, until it is made."""
    import torch

    from thc.collective.transports import AggregatorTransport, run_agreement_deferred
    job = local_job(1, 1, free_port_block(1))
    with AggregationClient(job, 0, ("127.0.0.1", 9), run=5) as c:
        with run_agreement_deferred():
            t = AggregatorTransport(c)
        for call in (lambda: t.max(torch.zeros(4)), lambda: t.sum(torch.zeros(2), 4, None)):
            with pytest.raises(RuntimeError, match="call agree_run"):
                call()
        t.agree_run()   # given, and no group: nothing to agree, the rounds may go
        assert c.run == 5 and c.run_settled


def test_every_nonce_of_16_bits_but_zero_may_be_given():
    """An install's nonce is the epoch's low 16 bits: 0xFFFF is one (the order
    :func:`P.nonce_at` steps in reaches it), 0 and anything wider are not."""
    job = local_job(1, 1, free_port_block(1))
    assert job.new_epoch(nonce=P.NONCE_MASK) & P.NONCE_MASK == P.NONCE_MASK
    assert P.NONCE_MASK in {P.nonce_at(k) for k in range(P.NONCE_MASK)}
    for bad in (0, P.NONCE_MASK + 1, True):
        with pytest.raises(ValueError, match="an install's nonce is 1..0xffff"):
            job.new_epoch(nonce=bad)
