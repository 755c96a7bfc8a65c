"""THC all-reduces where a worker fails, or refuses its input, part-way through a round: every
worker raises, names the cause, leaves no peer waiting, and the next round runs."""
from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist

from thc.codec.params import THCParams
from thc.collective.allreduce import THCAllReduce
from thc.net.aggregator import Aggregator
from thc.net.client import AggregationClient
from thc.testing.clusters import free_port_block, free_tcp_port, local_job
from tests.allreduce_cases import PARAMS, _vectors, workers_through_aggregator
from tests.oom import NoMemory
from tests.procs import gloo_pair
from tests.test_codec_kernels import DEV, kernels
from tests.test_graphed import join_gloo


def test_a_nan_on_one_worker_fails_every_worker_and_none_waits():
    """The worker with NaN in its gradient still sends its MAX packets, marked: its peers
    refuse the round too, at once, and nobody is left waiting for a sum."""
    xs = _vectors(3, 5000, seed=4)
    xs[1][123] = float("nan")
    got = workers_through_aggregator(3, PARAMS, lambda w, ar: ar(xs[w]))
    assert "NaN or Inf" in str(got[1])
    for w in (0, 2):
        assert isinstance(got[w], ValueError) and "mark of a worker" in str(got[w]), got[w]


def _nan_worker(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        x[2000] = float("inf")
    try:
        THCAllReduce.through_torch_distributed(params=PARAMS)(x)
        q.put((rank, "returned"))
    except ValueError as e:
        q.put((rank, str(e)))
    dist.destroy_process_group()


def test_torch_distributed_a_bad_worker_fails_its_peer_too():
    res = gloo_pair(_nan_worker, port=free_port_block(1))
    assert "NaN or Inf" in res[0]
    assert "mark of a worker" in res[1]


def _norms_join_fails_worker(rank, port, q):
    """Three rounds of four pieces over Gloo; in round 1 rank 1 runs out of memory joining
    its pieces' norms, before its MAX round, and goes on."""
    from datetime import timedelta

    import thc.collective.allreduce as allreduce_module
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=10))
    ar = THCAllReduce.through_torch_distributed(None, THCParams(seed=3, slice_size=256),
                                                pipeline_elements=256, generator=rank)
    fail = []
    allreduce_module.torch = NoMemory("cat", fail)
    out = []
    for rnd in range(3):
        if rank == 1 and rnd == 1:
            fail.append(True)
        try:
            out.append(float(ar(torch.full((1024,), float(rnd + 1))).mean()))
        except Exception as e:  # noqa: BLE001 - each round's outcome is the result
            out.append(f"{type(e).__name__}: {e}")
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_worker_failing_between_its_prepare_and_its_max_round_still_sends_its_marks():
    """Joining the pieces' norms ran outside the failures that send a marked MAX round: the
    peer waited in that round, and the failed worker's next round began with the size
    agreement, which paired with it (unlike lengths: Gloo aborted a process). Its marks go
    out: both refuse the round, and the next one is summed."""
    res = gloo_pair(_norms_join_fails_worker)
    assert res[0][0] == pytest.approx(1.0, abs=0.1) and res[1][0] == res[0][0], res
    assert "out of memory" in res[1][1], res
    assert "the mark of a worker that failed before its sums" in res[0][1], res
    assert res[0][2] == pytest.approx(3.0, abs=0.2) and res[1][2] == res[0][2], res


def _refusing_worker(rank, port, q):
    """Worker 1 hands in bad layer positions, then a bool tensor, then positions torch
    cannot read (a RuntimeError); worker 0 good input."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256),
                                                generator=rank)
    x = torch.ones(1024)
    calls = [(x, torch.full((1024,), 2.0) if rank else None),
             (x.bool() if rank else x, None), (x, [object()] * 1024 if rank else None),
             (x.to_sparse() if rank else x, None), (x.numpy() if rank else x, None),
             ([1.0, [2.0]] if rank else x, None),
             (np.broadcast_to(np.float32(0), (1 << 20, 1 << 20)) if rank else x, None),
             (torch.empty(1024, device="meta") if rank else x, None),
             (x.half().numpy() if rank else x.half(), None),
             (torch.empty(1024, device="meta", dtype=torch.bfloat16) if rank else
              x.bfloat16(), None),
             (torch.nested.nested_tensor([x[:512], x[512:]]) if rank else x, None),
             (x.reshape(2, 512).numpy() if rank else x.reshape(2, 512), None), (x, None)]
    out = []
    for tensor, position in calls:
        try:
            out.append(float(ar(tensor, position).mean()))
        except (TypeError, ValueError, RuntimeError) as e:
            out.append(str(e))
    q.put((rank, (out, ar.round)))
    dist.destroy_process_group()


def test_a_worker_refusing_its_input_ends_its_peers_round_too():
    """Bad layer positions (checked after the MAX round) or a dtype THC cannot average (cast
    silently) must not leave the peer waiting in a collective: the refusing worker's round
    goes out marked, every worker refuses it, and the next round is good on both."""
    res = gloo_pair(_refusing_worker)
    (bad_pos, bad_dtype, unreadable, sparse, array, ragged, huge, meta, half_array, half_meta,
     nested, shaped, good), rounds = res[1]
    assert "layer positions must lie in [0, 1]" in bad_pos
    assert "floating-point tensors, got torch.bool" in bad_dtype
    assert "Could not infer dtype" in unreadable
    # a sparse tensor has no flat view: raising before taking its round, that worker's
    # next call would be summed with its peer's current one
    assert "sparse" in sparse.lower(), sparse
    # a numpy array, or a list without a size, raised before its round: the peer waited
    assert "takes a torch.Tensor, got ndarray" in array, array
    assert "takes a torch.Tensor, got list" in ragged, ragged
    peer, rounds0 = res[0]
    assert all("mark of a worker" in r for r in peer[:5]), peer
    assert "differ" in peer[5], peer    # a list without a size stands in as empty: unlike
    # 2^40 elements in a few bytes: zeros of its size cannot be had, so it stands in as
    # empty; once its stand-in failed before the round, and every later sum was a step off
    assert "takes a torch.Tensor, got ndarray" in huge and "differ" in peer[6], (huge, peer)
    # a meta tensor has no values: Gloo "summed" it without sending, the peer was told the
    # workers were in different rounds, and every later round was refused
    assert "on the meta device" in meta and "mark of a worker" in peer[7], (meta, peer)
    # half-type peers: a float32 stand-in's key left out the dtype theirs hold, and they
    # were told the workers' settings differ instead of the refusal
    assert "got ndarray" in half_array and "on the meta device" in half_meta
    assert all("mark of a worker" in r for r in peer[8:10]), peer
    # a nested tensor: reading its shape for the round's key raised before the round went
    # out, and the peer waited until the group's timeout
    assert "got a nested one" in nested and "mark of a worker" in peer[10], (nested, peer)
    # a (2, 512) array stood in as 1024 zeros in one dimension: the peer's (2, 512) key was
    # unlike, and it was told so instead of the refusal
    assert "got ndarray" in shaped and "mark of a worker" in peer[11], (shaped, peer)
    assert good == pytest.approx(1.0, abs=0.1) and peer[12] == pytest.approx(1.0, abs=0.1)
    assert rounds == rounds0 == 13


def _a_round_then_one_failing_in_encode(ar) -> torch.Tensor:
    """A good round of ``ar``, then one whose encode runs out of memory (after its MAX
    round); returns the input."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    ar(x)
    ar.codec.encode_prepared = lambda *a, **k: (_ for _ in ()).throw(MemoryError("oom"))
    with pytest.raises(MemoryError):
        ar(x)
    del ar.codec.encode_prepared
    return x


def test_a_round_left_between_its_collectives_abandons_the_process_group():
    """A worker that fails after its MAX round and before its sums (here in encode) would
    pair its next collective with a peer's pending sum: its transport refuses every later
    round on that group, naming the failure; a new group is usable again."""
    from thc.testing.clusters import free_tcp_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=1)
        x = _a_round_then_one_failing_in_encode(ar)
        other = THCAllReduce.through_torch_distributed(params=PARAMS, generator=2)
        for reducer in (ar, other):
            with pytest.raises(RuntimeError, match="round 1 failed after its MAX round "
                                                   r"\(MemoryError: oom.*out of step"):
                reducer(x)
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        assert torch.isfinite(THCAllReduce.through_torch_distributed(params=PARAMS)(x)).all()
    finally:
        dist.destroy_process_group()


def test_a_round_left_after_its_max_round_fails_the_aggregator_clients_run():
    """Through an aggregator, a worker that fails after its MAX round leaves its peers' DATA
    in the slots its next round would take: its client's run takes no more rounds, naming
    the failure (its next MAX round had been refused by the aggregator as another use). One
    that fails after its sums came back (keeping its residual) goes on."""
    from thc.net.client import RunFailed
    job = local_job(1, 1, free_port_block(1), pool_size=32, table=PARAMS.table)
    with Aggregator([job]) as agg, AggregationClient(job, 0, agg.start(), run=1) as c:
        ar = THCAllReduce.through_aggregator(c, PARAMS, generator=1)
        x = _a_round_then_one_failing_in_encode(ar)
        with pytest.raises(RunFailed, match=r"round 1 failed after its MAX round "
                                            r"\(MemoryError: oom"):
            ar(x)
    # failed once its sums all came back, its sequence numbers are in step: the run goes on
    with Aggregator([job]) as agg, AggregationClient(job, 0, agg.start(), run=1) as c:
        ar = THCAllReduce.through_aggregator(c, PARAMS, generator=1)
        ar.feedback.keep = lambda *a: (_ for _ in ()).throw(MemoryError("oom"))
        with pytest.raises(MemoryError):
            ar(x)
        del ar.feedback.keep
        assert torch.isfinite(ar(x)).all()


def test_sums_no_workers_make_are_refused_alike_and_the_next_round_runs():
    """Decode on the CPU checks the sums it is given, which every worker holds alike: a sum
    outside what the table's values add to is a refusal every worker reaches, so it leaves
    the group usable and the next round runs."""
    from thc.collective.transports import DistTransport
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=1)
        x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
        real = ar.transport.sum

        def outside(*a, **k):
            sums, short = real(*a, **k)
            sums = sums.clone()
            sums[0] = max(PARAMS.table) + 1
            return sums, short
        ar.transport.sum = outside
        with pytest.raises(ValueError, match="outside"):
            ar(x)
        del ar.transport.sum
        DistTransport.check_group(None)
        assert torch.isfinite(ar(x)).all()
    finally:
        dist.destroy_process_group()


def test_a_failure_right_after_the_max_round_abandons_and_keeps_the_first_reason(monkeypatch,
                                                                               alone):
    """The MAX all-reduce returned, then this worker failed before its sums (here untagging
    the result): its peers wait in a sum, so the group is abandoned; a later refusal keeps
    the first reason, and so does the hook's FP32 span."""
    from thc.collective import agreement
    from thc.collective.transports import DistTransport
    ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=1)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as m:
        m.setattr(agreement, "untag", lambda v: (_ for _ in ()).throw(MemoryError("oom")))
        with pytest.raises(MemoryError):
            ar(x)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"round 0 failed .*MemoryError: oom\); its"):
            ar(x)
    with pytest.raises(RuntimeError, match="round 0 failed"):
        DistTransport.check_group(None)


def test_a_pipelined_round_that_fails_leaves_no_codec_work_running(alone):
    """A round of three pieces whose second sum fails: the first piece's decode and the third
    piece's encode were queued on the codec thread. They end (or are cancelled) before the
    round raises, so none of them runs beside the next round (flagging its checks, or
    drawing from the generator beside its encodes)."""
    import threading
    import time

    params = THCParams(slice_size=1 << 10)
    ar = THCAllReduce.through_torch_distributed(params=params, generator=1,
                                                pipeline_elements=4 << 10)
    x = torch.randn(12 << 10, generator=torch.Generator().manual_seed(1))
    ended, sums = [], []
    codec_thread = threading.Event()

    def slow(fn):
        def run(*a, **k):
            codec_thread.set()
            time.sleep(0.3)
            out = fn(*a, **k)
            ended.append(time.monotonic())
            return out
        return run

    def sum_(wire, count, p, classes=None):
        sums.append(count)
        if len(sums) == 2:
            raise MemoryError("oom")
        return real(wire, count, p, classes)
    real = ar.transport.sum
    ar.transport.sum = sum_
    ar.codec.decode = slow(ar.codec.decode)
    ar.codec.encode_prepared = slow(ar.codec.encode_prepared)
    with pytest.raises(MemoryError):
        ar(x)
    raised = time.monotonic()
    assert len(sums) == 2 and codec_thread.is_set()
    time.sleep(0.5)
    assert ended and max(ended) <= raised, (ended, raised)


@pytest.mark.parametrize("where", ["agreement", "together"])
def test_a_failure_before_a_rounds_first_collective_abandons(monkeypatch, where, alone):
    """This worker's own failure once its round number was taken and before the round's first
    collective went out (building the agreement's lanes: out of memory) abandoned nothing: its
    peers waited in that collective, and its next round paired with theirs (round numbers a
    round apart: every later round refused as out of step). The group is abandoned, named."""
    from thc.collective import agreement
    ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=1)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as m:
        m.setattr(agreement, "tagged",
                  lambda *a: (_ for _ in ()).throw(MemoryError("out of memory")))
        with pytest.raises(MemoryError):
            if where == "together":
                agreement.together(None, 0, 1, "cpu")
            else:
                ar(x)
    with pytest.raises(RuntimeError, match="round 0 failed before its agreement went out "
                                           r"\(MemoryError: out of memory"):
        ar(x)


def test_an_interrupt_between_the_agreement_and_the_max_round_abandons(monkeypatch, alone):
    """Ctrl-C in the encode, after the round's size agreement went out and before its MAX
    round, abandoned nothing (only an Exception sent the MAX round marked): a caller that
    went on paired its next agreement with its peers' pending MAX round, and Gloo aborted
    both processes on their unlike lengths. The group is abandoned, named."""
    ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=1)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as m:
        m.setattr(ar.codec, "prepare",
                  lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            ar(x)
    with pytest.raises(RuntimeError, match=r"round 0 failed before its MAX round went out "
                                           r"\(KeyboardInterrupt"):
        ar(x)


def test_an_interrupt_as_a_marked_max_round_returns_leaves_the_group_usable(monkeypatch,
                                                                           alone):
    """A marked MAX round is refused by every worker: a Ctrl-C that surfaces as it returns
    owes the peers nothing, and the next round is summed."""
    ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=1)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    ar(x)
    real_max, calls = ar.transport.max, []

    def max_then_interrupt(v):   # the size agreement's, then the marked MAX round's
        out = real_max(v)
        calls.append(len(v))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return out
    with monkeypatch.context() as m:
        m.setattr(ar.codec, "prepare", lambda *a: (_ for _ in ()).throw(RuntimeError("bad")))
        m.setattr(ar.transport, "max", max_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            ar(x)
    assert len(calls) == 2
    assert torch.isfinite(ar(x)).all()


def test_a_refused_input_too_large_to_stand_in_for_takes_its_round(monkeypatch, alone):
    """A refused input's round still goes out, from zeros of its size; where they could not be
    made (out of memory, as its own conversion was) the error escaped before the round number
    moved: its next call took the same round as its peers' next, paired with their pending
    one, a sum of two rounds. It stands in as empty instead (peers with a tensor refuse it; a
    failure alike on every worker is refused alike), its round taken, the next one summed."""
    import thc.collective.allreduce as allreduce_module
    ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=1)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as m:
        m.setattr(allreduce_module, "as_float32",
                  lambda t: (_ for _ in ()).throw(MemoryError("out of memory")))
        m.setattr(allreduce_module, "torch", NoMemory("zeros", sized=True))
        with pytest.raises(MemoryError, match="^out of memory$"):   # its own error
            ar(x.double())
    assert ar.round == 1
    assert float(((ar(x) - x) ** 2).sum() / (x ** 2).sum()) < 0.05


def test_an_input_whose_estimate_could_overflow_is_refused_and_the_next_round_runs():
    """An estimate reaches t_p times the max norm: a finite 3e38 came back Inf, the residual
    became -Inf, and every later round was refused as "NaN or Inf" for finite input. Such a
    norm is refused at once, the residual untouched."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        ar = THCAllReduce.through_torch_distributed(params=PARAMS)
        x = torch.zeros(4096)
        x[7] = 3e38
        with pytest.raises(ValueError, match="slice norm beyond"):
            ar(x)
        assert ar.feedback.residual is None
        y = torch.randn(4096, generator=torch.Generator().manual_seed(1))
        out = ar(y)
        assert bool(torch.isfinite(out).all())
        assert float(((out - y) ** 2).sum() / (y ** 2).sum()) < 0.05
    finally:
        dist.destroy_process_group()


SMALL = THCParams(slice_size=256, seed=7)


def _huge_norm_worker(rank, port, q):
    join_gloo(rank, port)
    out = {}
    for backend in ("reference", "compiled"):
        ar = THCAllReduce.through_torch_distributed(params=SMALL, generator=rank,
                                                    backend=backend)
        x = torch.randn(700, generator=torch.Generator().manual_seed(rank))
        if rank == 0:
            x[300] = 3e38   # finite, in slice 1, its norm beyond norm_limit
        try:
            ar(x)
            out[backend] = "returned"
        except ValueError as e:
            out[backend] = str(e)
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_norm_beyond_the_limit_is_named_with_its_slice_on_both_workers():
    """The worker names its slice, and its peer the same slice and the limit as a cause:
    the peer was told slice 0 and "NaN or Inf" for a finite input in slice 1."""
    res = gloo_pair(_huge_norm_worker)
    for backend in ("reference", "compiled"):
        assert "slice norm beyond" in res[0][backend] and "in slice 1" in res[0][backend]
        peer = res[1][backend]
        assert peer.startswith("slice 1's max norm is the mark") and "norm beyond" in peer


def test_a_finite_input_whose_norm_overflows_is_not_called_nan():
    """A prepare that failed for another reason than NaN or Inf marks every slice; its error
    was rewritten as "NaN or Inf in slice 0" for an input that holds neither."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        ar = THCAllReduce.through_torch_distributed(params=PARAMS)
        with pytest.raises(ValueError, match="slice norm beyond") as err:
            ar(torch.full((4096,), 1e37))
        assert "NaN or Inf in slice" not in str(err.value)
    finally:
        dist.destroy_process_group()


def test_a_float64_input_beyond_float32s_range_is_not_called_nan():
    """THC rounds in float32: a finite float64 value beyond its range was refused as "NaN or
    Inf", which the input does not hold. The next round, in range, is summed."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        ar = THCAllReduce.through_torch_distributed(params=PARAMS)
        x = torch.zeros(4096, dtype=torch.float64)
        x[7] = 1e300
        with pytest.raises(ValueError, match="beyond float32's range") as err:
            ar(x)
        assert "NaN or Inf" not in str(err.value)
        got = ar(torch.ones(4096, dtype=torch.float64))
        assert got.dtype == torch.float64 and torch.isfinite(got).all()
    finally:
        dist.destroy_process_group()


def test_an_input_refused_is_refused_where_every_worker_stood_in_as_empty(alone):
    """Workers that all stood in as empty (a worker alone here) agree on the empty round:
    the refusal still reaches the caller, not an empty tensor as if summed; positions of
    another count than the elements are refused, more as fewer; and rounds never go back."""
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256))
    for bad, kind in ((np.zeros(0, np.float32), "ndarray"), ([], "list")):
        with pytest.raises(TypeError, match=f"takes a torch.Tensor, got {kind}"):
            ar(bad)
    for n in (255, 257):
        with pytest.raises(ValueError, match=f"{n} layer positions for 256 elements"):
            ar(torch.ones(256), torch.zeros(n))
    assert ar(torch.ones(256)).shape == (256,)
    rnd = ar.round
    ar.skip_to(rnd - 1)
    assert ar.round == rnd
    ar.skip_to(rnd + 3)
    assert ar.round == rnd + 3


def _empty_refusing_worker(rank, port, q):
    """Empty inputs alike on every rank but for one refused on rank 1."""
    join_gloo(rank, port)
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256))
    out = []
    for bad in (torch.zeros(0, dtype=torch.int64), np.zeros(0, np.float32),
                torch.zeros(0, 3, dtype=torch.complex64)):
        try:
            out.append(ar(bad if rank == 1 else torch.zeros(0)).shape)
        except (ValueError, TypeError, RuntimeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    out.append(tuple(ar(torch.zeros(0)).shape))
    q.put((rank, out))
    dist.destroy_process_group()


def test_an_empty_input_refused_on_one_rank_is_refused_on_every_rank():
    """An empty tensor skipped the input checks (an int64 or complex one was taken), and one
    refused (a numpy array) raised on its rank alone: its peer returned an empty sum as if
    the round had gone well. An empty round holds no slice to mark; its key carries the
    refusal."""
    res = gloo_pair(_empty_refusing_worker)
    own, peer = res[1], res[0]
    assert "floating-point tensors, got torch.int64" in own[0], own
    assert "takes a torch.Tensor, got ndarray" in own[1], own
    assert "got torch.complex64" in own[2], own
    for told in peer[:3]:
        assert told.startswith("RuntimeError") and "refused its input" in told, peer
    assert own[3] == peer[3] == (0,)


@pytest.mark.parametrize("kind", ["thc", pytest.param("graphed", marks=kernels)])
def test_an_empty_input_is_checked_as_any_other(alone, kind):
    from thc.collective.graphed import GraphedAllReduce
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256)) \
        if kind == "thc" else GraphedAllReduce.through_torch_distributed(
            params=THCParams(slice_size=256), capture=False)
    with pytest.raises(TypeError, match="floating-point tensors, got torch.int64"):
        ar(torch.zeros(0, dtype=torch.int64, device=DEV if kind == "graphed" else "cpu"))
    if kind == "graphed":
        with pytest.raises(ValueError, match="a graphed round does not use"):
            ar(torch.zeros(0, device=DEV), torch.zeros(0))
        return
    with pytest.raises(ValueError, match="5 layer positions for 0 elements"):
        ar(torch.zeros(0), torch.zeros(5))
    assert ar(torch.zeros(0), torch.zeros(0)).shape == (0,)


def _far_ahead_worker(rank, port, q, how):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=1024),
                                                error_feedback=False)
    if rank == 0 and how == "skips":
        ar.skip_to(1 << 39)
        ar.skip_to(1 << 40)
    elif how == "loaded":
        ar.load_state_dict({**ar.state_dict(), "round": 3 + (1 << 64) * (1 - rank)})
    q.put((rank, ar(x)))
    dist.destroy_process_group()


@pytest.mark.parametrize("how", ["skips", "loaded"])
def test_a_rank_2_to_the_40_rounds_ahead_draws_as_its_peers(how):
    """Two jumps of 2^39 took rank 0 to round 2^40 alone: its round lanes (the round
    modulo 2^40) paired with rank 1's round 0 while its rotation was drawn under 2^40, and
    each rank returned another, wrong mean (relative error 0.98 and 1.01 where THC's is
    0.14), unrefused. A round now draws under its number modulo 2^40, as its lanes carry
    it; so a state saved past round 2^40 (a DDP hook's ``no_sync`` stretches add 2^20 each)
    resumes, where it was refused."""
    from functools import partial
    res = gloo_pair(partial(_far_ahead_worker, how=how), port=free_port_block(1))
    mean = sum(torch.randn(4096, generator=torch.Generator().manual_seed(r))
               for r in range(2)) / 2
    assert torch.equal(res[0], res[1])
    assert float((res[0] - mean).norm() / mean.norm()) < 0.3


@pytest.mark.parametrize("kind", ["thc", "marsit"])
def test_a_skip_of_2_to_the_40_rounds_or_more_is_refused(alone, kind):
    """No count of rounds jumps 2^40 or more, and the round lanes (the round modulo 2^40)
    could not tell a rank's peers of such a jump: refused as the caller's bug."""
    from thc.collective.marsit import MarsitAllReduce
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256)) \
        if kind == "thc" else MarsitAllReduce(None, torch.Generator().manual_seed(0))
    ar(torch.ones(256))
    for bad in (1 + (1 << 40), True, 2.0):
        with pytest.raises(ValueError, match="skip_to"):
            ar.skip_to(bad)
    assert ar.round == 1
    ar.skip_to(1 << 40)
    assert ar.round == 1 << 40
