"""DDP hooks when a rank fails, a peer is gone or a bucket is refused: every rank raises at
once, the cause is named, and no peer takes a wrong span."""
from __future__ import annotations

import functools
import os
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from thc.testing.clusters import free_port_block
from tests.oom import NoMemory
from tests.ddp_common import _data, _model, _one_backward
from tests.procs import gloo_pair


def test_a_topk_step_that_fails_after_its_agreement_abandons_the_group(monkeypatch):
    """A rank's own failure between its gathers or after them (here in combining them): its
    peers wait in a gather or go on to their next collective (a hook's FP32 spans), which
    would pair with this rank's next; so the group is abandoned, and its next step refuses,
    naming the failure."""
    from thc.collective.ddp import TopKHook
    from thc.collective.transports import DistTransport
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        hook = TopKHook(torch.nn.Linear(8, 8), ratio=0.5, overlap=False)
        assert int(hook.reduce("bucket", torch.ones(64), [64]).count_nonzero()) == 32
        with monkeypatch.context() as m:
            m.setattr(hook.scheme, "combine",
                      lambda *a: (_ for _ in ()).throw(MemoryError("out of memory")))
            with pytest.raises(MemoryError):
                hook.reduce("bucket", torch.ones(64), [64])
        with pytest.raises(RuntimeError, match=r"TopK step 1 failed after its agreement "
                                               r"\(MemoryError: out of memory\)"):
            hook.reduce("bucket", torch.ones(64), [64])
        with pytest.raises(RuntimeError, match="TopK step 1 failed"):
            DistTransport.check_group(hook.group)
    finally:
        dist.destroy_process_group()


class _NoRoomToDivide:
    """A world size whose division runs out of memory, as ``flat / world`` can on a GPU."""

    def __rtruediv__(self, other):
        raise MemoryError("out of memory")


def test_an_fp32_hook_that_fails_before_its_all_reduce_abandons_the_group():
    """The FP32 hook's division (a bucket-sized tensor) ran outside the failures that abandon
    the group: the peers waited in that step's all-reduce, and this rank's next paired with
    it, summing gradients of two steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import FP32Hook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        model = _model()
        ddp = DDP(model)
        hook = FP32Hook(model, overlap=False).register(ddp)
        x, y = _data(0)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        hook.world = _NoRoomToDivide()
        with pytest.raises(RuntimeError, match="out of memory"):
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        hook.world = 1
        with pytest.raises(RuntimeError, match="may use this process group any more: a "
                                               "bucket of backward failed before its all-r"):
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_bucket_that_fails_around_its_compressed_round_abandons_the_group(monkeypatch, where):
    """A rank's own failure in the hook between the bucket's THC round and the end of its FP32
    spans (copying the estimate out, concatenating the spans: out of memory, say): its peers
    wait in the spans' all-reduce or go on to their next collective, which would pair with
    this rank's next; so the group is abandoned, named by the failure. So it is for one
    before the round went out (joining the compressed spans), which told its peers nothing:
    they waited in the round, and the rank's next step, if it went on, paired with it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thc.collective.ddp_base as ddp_module
    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import HookOptions, THCHook
    from thc.collective.transports import DistTransport

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        model = _model()
        ddp = DDP(model)
        hook = THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(seed=3)), HookOptions(uncompressed=("2.bias",)),
            overlap=False).register(ddp)
        x, y = _data(0)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        DistTransport.check_group(hook.group)
        if where == "after":
            monkeypatch.setattr(hook, "_reduce_fp32",
                                lambda *a: (_ for _ in ()).throw(MemoryError("out of memory")))
        else:
            monkeypatch.setattr(ddp_module, "torch", NoMemory())
        with pytest.raises(RuntimeError, match="out of memory"):
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        with pytest.raises(RuntimeError, match=f"a bucket of backward failed {where} its "
                                               r"compressed round \(MemoryError: out of"):
            DistTransport.check_group(hook.group)
    finally:
        dist.destroy_process_group()


def _topk_nan_worker(rank, port, q):
    from thc.collective.ddp import TopKHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    hook = TopKHook(torch.nn.Linear(8, 8), ratio=0.5, overlap=False)
    out = []
    for call in range(3):
        x = torch.full((64,), float(call + 1))
        if rank == 0 and call == 0:
            x[3] = float("nan")
        try:
            out.append(hook.reduce("bucket", x, [64]).tolist())
        except (ValueError, RuntimeError) as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_topk_a_nan_on_one_worker_is_refused_by_both():
    """The NaN worker raised before its all-gathers: its peer waited in them until the group's
    timeout, and their later calls paired off by one (a wrong mean, no error)."""
    res = gloo_pair(_topk_nan_worker)
    assert "NaN or Inf" in res[0][0] and "refused on every worker" in res[1][0], res
    assert res[0][1:] == res[1][1:] and all(isinstance(r, list) for r in res[0][1:]), res


def _topk_bad_step_worker(rank, port, q, nonfinite):
    """Two DDP steps of a Linear(8, 8) under a TopK hook that compresses every parameter;
    rank 1's batch holds an Inf at the second. Puts its outcome, the gradients and the
    hook's residuals after each step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import TopKHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ddp = DDP(model)
    hook = TopKHook(model, ratio=0.25, overlap=False, nonfinite=nonfinite).register(ddp)
    out = []
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
        if rank == 1 and step == 1:
            x[0, 0] = float("inf")
        model.zero_grad(set_to_none=True)
        try:
            ddp(x).pow(2).sum().backward()
            done = "ok"
        except (ValueError, RuntimeError) as e:
            done = str(e)
        grads = [p.grad.numpy().copy() for p in model.parameters() if p.grad is not None]
        out.append((done, grads, {n: r.numpy().copy()
                                  for n, r in hook.state_dict()["residuals"].items()}))
    q.put((rank, out))
    dist.destroy_process_group()


def test_topk_an_inf_on_one_rank_comes_back_nan_on_every_rank_under_propagate():
    """Under nonfinite="propagate" a refused bucket came back as zeros, a gradient like any
    other: a GradScaler found nothing to skip where every parameter is compressed (no FP32
    span carried the Inf), and stepped on a step no rank could reduce."""
    res = gloo_pair(functools.partial(_topk_bad_step_worker, nonfinite="propagate"))
    for rank in (0, 1):
        done, grads, _ = res[rank][1]
        assert done == "ok" and len(grads) == 2, (rank, done)
        assert all(np.isnan(g).all() for g in grads), (rank, grads)


def test_topk_a_refused_step_leaves_every_ranks_residual_as_it_was():
    """Rank 0 compressed its finite gradient before the round was refused for rank 1's Inf:
    its residual kept that step's left-overs (a step no rank applied), and the next steps
    fed them back, the ranks' residuals no longer the mass their applied means missed."""
    res = gloo_pair(functools.partial(_topk_bad_step_worker, nonfinite="raise"))
    for rank in (0, 1):
        (first, _, kept), (second, _, after) = res[rank]
        assert first == "ok" and "NaN or Inf" in second, (rank, first, second)
        assert kept.keys() == after.keys() == {"weight", "bias"}, kept.keys()
        assert any(np.abs(r).sum() > 0 for r in kept.values()), kept
        for n in kept:
            np.testing.assert_array_equal(after[n], kept[n], err_msg=f"rank {rank} {n}")


def _factory_hook(model, rank):
    from thc.codec.params import THCParams
    from thc.collective.ddp import THCHook
    pieces = (1 << 21) if rank == 0 else 1000          # rank 1's factory raises
    return THCHook(model, functools.partial(_thc_with_pieces, THCParams(slice_size=64), pieces))


def _thc_with_pieces(params, pieces, group):
    from thc.collective.allreduce import THCAllReduce
    return THCAllReduce.through_torch_distributed(group, params=params,
                                                  pipeline_elements=pieces)


def test_a_reducer_that_fails_to_build_on_one_rank_fails_every_rank_at_once():
    """The factory ran after the bucket's split check with nothing told to the peers: rank 0
    waited in its reducer's first collective until the group's timeout, then read only
    "Connection closed by peer"."""
    res = gloo_pair(functools.partial(_one_backward, _factory_hook))
    assert "pipeline_elements" in res[1][0], res
    assert "failed before this round's collectives" in res[0][0] and res[0][1] < 20, res


def _once_failing_factory_worker(rank, port, q):
    """THC's hook whose factory fails once on rank 1 (a transient error): each of four DDP
    steps' outcome on this rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    model = _model()
    ddp = DDP(model)
    calls = []

    def make(group):
        calls.append(group)
        if rank == 1 and len(calls) == 1:
            raise RuntimeError("a transient failure building the reducer")
        return THCAllReduce.through_torch_distributed(group, params=THCParams(slice_size=256),
                                                      generator=rank)
    THCHook(model, make, overlap=False).register(ddp)
    out = []
    for _ in range(4):
        ddp.zero_grad()
        x, y = _data(rank)
        try:
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            out.append("ok")
        except Exception as e:  # noqa: BLE001 - the test reads each step's outcome
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_reducer_build_that_failed_once_on_one_rank_is_built_again_on_every_rank():
    """The other rank's reducer had taken a place in the group's build order: when both
    built again, their places differed and every later round was refused."""
    res = gloo_pair(_once_failing_factory_worker)
    assert "transient failure" in res[1][0], res   # its own error
    assert "failed before" in res[0][0], res        # the peer's refusal of the round
    for rank in (0, 1):
        assert res[rank][1:] == ["ok"] * 3, res


def _refused_then_on_worker(rank, port, q):
    """Three DDP steps with THC's hook, not overlapped; rank 0's first gradient holds an Inf:
    each step's outcome on this rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    model = _model()
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(rank)
    THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
        group, params=THCParams(seed=3), generator=gen), overlap=False).register(ddp)
    out = []
    for step in range(3):
        x, y = _data(rank)
        if rank == 0 and step == 0:
            x = x.clone()
            x[0, 0] = float("inf")
        try:
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            out.append("ok")
        except (ValueError, RuntimeError) as e:
            out.append(str(e))
        model.zero_grad(set_to_none=True)
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_refused_bucket_without_overlap_leaves_ddp_usable():
    """Raised inside DDP's hook call, a refusal would leave DDP's reducer half-marked: every
    later step failing in torch ("unmarked_param_indices ... please report a bug to
    PyTorch"). The hook hands it to DDP in its future, as the overlapping hook does."""
    res = gloo_pair(_refused_then_on_worker)
    for rank in (0, 1):
        assert "NaN or Inf" in res[rank][0] or "refused" in res[rank][0], res
        assert res[rank][1:] == ["ok", "ok"], res


def _steps_after_a_refusal(rank, port, q):
    """Four DDP steps with THC's hook over several buckets, overlapped and not; rank 0's
    second batch holds an Inf, and each rank goes on after the refusal. Per mode and step:
    the gradients, or the error."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    torch.set_num_threads(1)
    class Late(THCHook):
        """The first bucket reduced after a failure starts 0.5 s late: the next backward
        has filled the buffers by then."""
        late = False

        def _reduce_bucket(self, *args):
            if self.late:
                self.late = False
                time.sleep(0.5)
            try:
                return super()._reduce_bucket(*args)
            except Exception:
                self.late = True
                raise

    out = {}
    for overlap in (True, False):
        model = _model()
        # several buckets: with unused parameters DDP keeps its buckets of bucket_cap_mb
        ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True)
        # one key in both runs: by default each hook's reducers draw their own
        Late(model, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(seed=3), generator=rank), overlap=overlap).register(ddp)
        log = []
        for step in range(4):
            x, y = _data(rank * 10 + step)
            if rank == 0 and step == 1:
                x[0, 0] = float("inf")
            try:
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                log.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy())
            except RuntimeError as e:
                log.append(str(e))
            model.zero_grad(set_to_none=True)
        out[overlap] = log
    q.put((rank, out))
    dist.destroy_process_group()


def test_the_buckets_left_after_a_refusal_never_touch_the_next_step():
    """DDP raises at a refused bucket's future while the hook's thread still holds the step's
    later buckets: they ran during the next backward, reading and overwriting its bucket
    buffers, and its gradients differed from the same run without overlap (here the first
    one starts late, so it always does). They are now left alone on every rank, so both
    runs give the same gradients."""
    res = gloo_pair(_steps_after_a_refusal)
    for rank in (0, 1):
        for overlap in (True, False):
            log = res[rank][overlap]
            assert isinstance(log[1], str) and "NaN or Inf" in log[1], log[1]
            assert all(isinstance(g, np.ndarray) for g in (log[0], log[2], log[3])), log
        for step in (2, 3):
            np.testing.assert_array_equal(res[rank][True][step], res[rank][False][step])


def test_a_reduction_ending_in_no_exception_still_fails_ddp():
    """torch's futures take an Exception only: a SystemExit in the hook's thread left the
    future open, and DDP waited for it forever."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import FP32Hook
    from thc.testing.clusters import free_tcp_port

    class Exiting(FP32Hook):
        def _reduce_bucket(self, *args):
            raise SystemExit(3)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        model = _model()
        ddp = DDP(model)
        Exiting(model).register(ddp)
        x, y = _data(0)
        got: list = []

        def backward():
            try:
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                got.append("returned")
            except RuntimeError as e:
                got.append(str(e))
        t = threading.Thread(target=backward, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "DDP still waits for the bucket's future"
        assert "SystemExit(3)" in got[0], got
        assert "Unable to cast" not in got[0], got   # the error under its own type's name
    finally:
        dist.destroy_process_group()


def _peer_absent_worker(rank, port, q, exits=False):
    """Rank 0 runs a DDP step with THC's hook; rank 1 runs its forward and never its backward
    (it raised in between, say), then waits out rank 0's timeout or (``exits``) its process
    ends while rank 0 waits."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=3))
    model = _model()
    ddp = DDP(model)
    THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
        group, params=THCParams(seed=3), generator=rank), overlap=False).register(ddp)
    x, y = _data(rank)
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    out = "ok"
    if rank == 0:
        try:
            loss.backward()
        except RuntimeError as e:
            out = str(e)
    elif exits:
        q.put((rank, out))
        q.close()
        q.join_thread()
        time.sleep(1)
        os._exit(0)
    else:
        time.sleep(6)
    q.put((rank, out))


def test_a_peer_that_never_reaches_the_bucket_is_named_in_the_timeout():
    """Gloo's own words ("Timed out waiting 3000ms for recv operation") named no rank, step
    or cause."""
    res = gloo_pair(_peer_absent_worker)
    assert "timed out: a peer rank did not reach this bucket's reduction" in res[0], res
    assert "backward 0 " in res[0] and "Timed out" in res[0], res


def test_a_peer_whose_process_ended_is_named_in_the_lost_connection():
    """Gloo's "Connection closed by peer" named no step or cause either."""
    res = gloo_pair(functools.partial(_peer_absent_worker, exits=True))
    assert "lost its connection to a peer rank, whose process ended" in res[0], res
    assert "backward 0 " in res[0] and "Connection closed by peer" in res[0], res


def _failing_decode(ar, fail: list):
    """``ar`` whose codec's next decode raises an out-of-memory error while ``fail`` holds
    something."""
    real = ar.codec.decode

    def decode(*a, **k):
        if fail:
            fail.clear()
            raise MemoryError("out of memory in decode")
        return real(*a, **k)
    ar.codec.decode = decode
    return ar


def _steps_failing_once(model, rank: int, fail: list, steps: int, loss,
                        at: int = 1) -> list[str]:
    """``steps`` backwards of ``loss(step)``; at step ``at`` rank 1 sets ``fail`` (its next
    failing call raises): each step's outcome on this rank, "ok" or the error."""
    out = []
    for step in range(steps):
        if rank == 1 and step == at:
            fail.append(True)
        try:
            loss(step).backward()
            out.append("ok")
        except Exception as e:  # noqa: BLE001 - each step's outcome is the result
            out.append(f"{type(e).__name__}: {e}")
        model.zero_grad(set_to_none=True)
    return out


def _fails_after_its_sum_worker(rank, port, q, where="decode"):
    """Three DDP steps with THC's hook and an FP32 span (the last bias) in the bucket; at
    step 1 rank 1 fails after its sum went out, and it goes on to step 2: each step's outcome
    on this rank. ``where``: its decode fails (out of memory, say), or its hook's ``reduce``
    once its reducer returned (no code of the project fails there: the spans' tags are then
    the only check)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import HookOptions, THCHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=3))
    torch.manual_seed(0)
    # a last bias of 5, its span and tag lanes as long as a Gloo round's agreement: unlike
    # lengths would abort Gloo
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 5))
    ddp = DDP(model)
    fail = []

    def factory(group):
        return _failing_decode(THCAllReduce.through_torch_distributed(
            group, params=THCParams(seed=3), generator=rank), fail if where == "decode" else [])
    hook = THCHook(model, factory, HookOptions(uncompressed=("2.bias",)), overlap=False)
    hook.register(ddp)
    if where == "reduce":
        real = hook.reduce

        def reduce(*a, **k):
            out = real(*a, **k)
            if fail:
                fail.clear()
                raise MemoryError("out of memory after the round")
            return out
        hook.reduce = reduce
    q.put((rank, _steps_failing_once(model, rank, fail, 3, lambda step: (
        torch.nn.functional.cross_entropy(ddp(_data(10 * step + rank)[0]),
                                          _data(10 * step + rank)[1])))))


def test_a_rank_that_fails_after_its_sum_leaves_no_peer_a_wrong_fp32_span():
    """Rank 1 fails after its sum; rank 0's round went well, and it goes on to the bucket's
    FP32 span. That all-reduce paired with rank 1's next collective (step 2's agreement,
    whose tag lanes rank 0 took as its bias gradient, "ok"). Rank 1 now abandons the group:
    its later steps refuse, naming the failure, and rank 0's FP32 span ends in an error (the
group's timeout, or the connection lost when rank 1's process ends)."""
    res = gloo_pair(_fails_after_its_sum_worker)
    assert res[0][0] == res[1][0] == "ok", res
    assert "out of memory in decode" in res[1][1], res
    assert "the hook's collective of backward 1 " in res[0][1], res   # timed out, or lost
    assert "no THC round may use this process group any more" in res[1][2], res
    assert "failed after its MAX round (MemoryError: out of memory in decode)" in res[1][2], res


def test_a_rank_that_fails_after_its_reducer_returned_leaves_no_peer_a_wrong_fp32_span():
    """Rank 1's hook fails once its reducer returned, and no one abandons the group: rank 0's
    FP32 span pairs with rank 1's step 2 agreement, as long. It took its lanes as its bias
    gradient ("ok"); the span's tags now refuse it, and the group is abandoned."""
    res = gloo_pair(functools.partial(_fails_after_its_sum_worker, where="reduce"))
    assert res[0][0] == res[1][0] == "ok", res
    assert "out of memory after the round" in res[1][1], res
    assert "the FP32 spans of backward 1's bucket 0 were summed with another" in res[0][1], res
    assert "no THC round may use this process group any more" in res[0][2], res
    assert res[1][2] != "ok", res


def _aggregator_fails_after_its_sums_worker(job, addr, rank, port, q):
    """Four DDP steps with THC's hook through a software aggregator. Bucket 0 holds FP32
    spans alone, bucket 1 a compressed span and FP32 spans as long as bucket 0's; at step 1
    rank 1's decode fails (out of memory, say) after its aggregator sums went out, and it goes
    on: each step's outcome on this rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import HookOptions, THCHook
    from thc.net.client import AggregationClient
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=3))
    torch.manual_seed(0)
    # DDP's first bucket closes at 1 MiB: layer 4 (512 x 512 and its bias) fills it alone
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512))
    ddp = DDP(model)
    fail = []
    client = AggregationClient(job, rank, addr, run=1, deadline=3.0)

    def factory(group):
        return _failing_decode(THCAllReduce.through_aggregator(
            client, THCParams(seed=3, slice_size=256), group, generator=rank), fail)
    THCHook(model, factory, HookOptions(uncompressed=("2.", "4.")), overlap=False).register(ddp)
    q.put((rank, _steps_failing_once(model, rank, fail, 4, lambda step: ddp(torch.randn(
        16, 512, generator=torch.Generator().manual_seed(10 * step + rank))).square().mean())))


def test_a_rank_that_fails_after_its_aggregator_sums_leaves_no_peer_a_wrong_fp32_span():
    """Rank 1 fails after its aggregator sums (no collective of the hook's group in that
    round); rank 0 goes on to the bucket's FP32 spans, which pair with rank 1's next step's
    first bucket, as long: a sum of two different buckets of two different steps. The FP32
    spans carry the bucket and the step: both ranks refuse it, and the group is abandoned."""
    from thc.net.aggregator import Aggregator
    from thc.testing.clusters import local_job
    job = local_job(1, 2, free_port_block(2), pool_size=32)
    with Aggregator([job]) as agg:
        addr = agg.start()
        res = gloo_pair(functools.partial(_aggregator_fails_after_its_sums_worker, job, addr))
    refused = "the FP32 spans of backward {}'s bucket {} were summed with another collective"
    assert res[0][0] == res[1][0] == "ok", res
    assert "out of memory in decode" in res[1][1], res
    assert refused.format(1, 1) in res[0][1], res   # it was "ok": a wrong sum
    assert refused.format(2, 0) in res[1][2], res
    for rank, step in ((0, 2), (0, 3), (1, 3)):
        assert "no THC round may use this process group any more" in res[rank][step], res


def _fails_once_worker(job, addr, rank, port, q):
    """DDP steps with THC's hook over Gloo (``job`` None) or through a software aggregator;
    rank 1 runs out of memory once and goes on: each step's outcome on this rank. Over Gloo
    it fails at step 1 (DDP rebuilt its buckets: each is agreed again) building its bucket
    agreement's lanes, of 3 steps; through the aggregator at step 2 (every reducer built)
    joining the bucket's compressed spans, before its round went out, of 5 steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thc.collective.agreement as agreement_module
    import thc.collective.ddp_base as ddp_module
    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    from thc.net.client import AggregationClient
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=3))
    model = _model()
    ddp = DDP(model)
    fail = []
    params = THCParams(seed=3, slice_size=256)
    if job is None:
        agreement_module.torch = NoMemory("full", fail)
        steps, at = 3, 1

        def make(group):
            return THCAllReduce.through_torch_distributed(group, params, generator=rank)
    else:
        ddp_module.torch = NoMemory("cat", fail)
        client = AggregationClient(job, rank, addr, run=1, deadline=3.0)
        steps, at = 5, 2

        def make(group):
            return THCAllReduce.through_aggregator(client, params, group, generator=rank)
    THCHook(model, make, overlap=False).register(ddp)

    def loss(step):
        x, y = _data(10 * step + rank)
        return torch.nn.functional.cross_entropy(ddp(x), y)
    q.put((rank, _steps_failing_once(model, rank, fail, steps, loss, at)))


def test_a_rank_that_fails_in_its_bucket_agreement_pairs_no_later_step():
    """The bucket's agreement numbered its round by the buckets agreed so far, which a failure
    before its collective left as it was: rank 1's next step's agreement paired with rank 0's
    pending one, and from there every step of rank 0 summed with rank 1's next, with no error.
    The group is abandoned, naming the failure; rank 0's steps end in errors."""
    res = gloo_pair(functools.partial(_fails_once_worker, None, None))
    assert res[0][0] == res[1][0] == "ok", res
    assert "out of memory" in res[1][1], res
    assert res[0][1] != "ok" and res[0][2] != "ok", res   # step 1 was "ok": a sum of two steps
    assert "round 1 failed before its agreement went out (MemoryError" in res[1][2], res


def test_a_rank_that_fails_before_its_aggregator_round_stops_its_run():
    """Rank 1 fails before its bucket's round through the aggregator went out, and goes on.
    Abandoning the group stopped its collectives, but that round uses none: its next step's
    round paired with rank 0's pending one (same reducer, same round number), and every later
    step on both ranks was the sum of rank 0's step k and rank 1's step k+1, with no error.
    Its client's run is failed too: rank 0's round times out naming worker 1, and every later
    round on either rank is refused."""
    from thc.net.aggregator import Aggregator
    from thc.testing.clusters import local_job
    job = local_job(1, 2, free_port_block(2), pool_size=32)
    with Aggregator([job]) as agg:
        addr = agg.start()
        res = gloo_pair(functools.partial(_fails_once_worker, job, addr))
    assert res[0][:2] == res[1][:2] == ["ok", "ok"], res
    assert "out of memory" in res[1][2], res
    assert "missing worker(s) [1]" in res[0][2], res   # it was "ok": a sum of two steps
    for rank, step in ((0, 3), (0, 4), (1, 3), (1, 4)):
        assert "RunFailed" in res[rank][step], res


def _factory_fails_worker(job, addr, rank, port, q):
    """One DDP step with THC's hook through an aggregator, whose factory fails on rank 1
    before it builds its transport: what each rank raised, and how long it took."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    from thc.net.client import AggregationClient
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    client = AggregationClient(job, rank, addr, run=1, deadline=3.0)
    model = _model()
    ddp = DDP(model)

    def factory(group):
        if rank == 1:
            raise ValueError("rank 1's factory: bad config")
        return THCAllReduce.through_aggregator(client, THCParams(seed=3), group)
    THCHook(model, factory, overlap=False).register(ddp)
    start = time.monotonic()
    try:
        torch.nn.functional.cross_entropy(ddp(_data(rank)[0]), _data(rank)[1]).backward()
        got = "ok"
    except RuntimeError as e:
        got = str(e)
    q.put((rank, (got, time.monotonic() - start)))


def test_a_factory_that_fails_before_its_transport_makes_every_rank_raise_at_once():
    """The transport agreed the client's run over the hook's group as it was built, inside
    the factory: a rank whose factory failed before it joined the hook's agreement of the
    build while its peers waited in the run's, and both waited out the group's timeout,
    neither naming the failure. The run is agreed at the transport's first exchange now."""
    from thc.net.aggregator import Aggregator
    from thc.testing.clusters import local_job
    job = local_job(1, 2, free_port_block(2))
    with Aggregator([job]) as agg:
        addr = agg.start()
        res = gloo_pair(functools.partial(_factory_fails_worker, job, addr))
    assert "bad config" in res[1][0], res
    assert "a worker failed before this round's collectives" in res[0][0], res
    assert max(res[0][1], res[1][1]) < 10, res


@pytest.mark.parametrize("gloo", ["Connection closed by peer [127.0.0.1]:26830",
                                  "Read error [127.0.0.1]:26830: Connection reset by peer"])
def test_a_peer_whose_process_ended_is_named_however_gloo_words_it(gloo):
    """Gloo says a peer's process ended as a closed connection or, where the socket is read
    when it goes, a reset one; the second was passed on unnamed."""
    from thc.collective.ddp_base import _peer_gone
    named = _peer_gone(RuntimeError(f"[gloo/transport/tcp/pair.cc:537] {gloo}."), 1)
    assert "the hook's collective of backward 1 lost its connection to a peer rank" in str(named)
    assert gloo in str(named)


def test_a_gloo_pair_closed_by_an_earlier_timeout_is_named():
    """After a Gloo timeout the next collective on the pair fails with "Application timeout
    caused pair closure", which was passed on without the hook's words."""
    from thc.collective.ddp_base import _peer_gone
    gloo = "Application timeout caused pair closure"
    named = _peer_gone(RuntimeError(f"[gloo/transport/tcp/pair.cc:446] {gloo}"), 3)
    assert "backward 3 found its connection to a peer rank closed by an earlier timeout" \
        in str(named) and gloo in str(named)


def test_an_fp32_hook_issues_nothing_on_a_group_a_failed_bucket_left(monkeypatch):
    """A rank whose bucket failed before its all-reduce abandons the group (its peers wait in
    that all-reduce); the FP32 hook's next all-reduce went out regardless and paired with
    the peers' pending one, every later step then summing gradients of two steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thc.collective.ddp_base as ddp_module
    from thc.collective.ddp import FP32Hook

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        model = _model()
        ddp = DDP(model)
        FP32Hook(model, overlap=False).register(ddp)
        x, y = _data(0)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        with monkeypatch.context() as m:
            m.setattr(ddp_module, "torch", NoMemory())
            with pytest.raises(RuntimeError, match="out of memory"):
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
        with pytest.raises(RuntimeError, match="may use this process group any more: a "
                                               "bucket of backward failed before"):
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
    finally:
        dist.destroy_process_group()


def _run_refused_worker(job, addr, rank, port, q):
    """A hook loaded with residuals whose first build is refused at its run agreement (rank 1's
    client has no run id), then rank 1 given the run: each step's outcome, and the hook's
    residuals after the refusal."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective import checkpoint
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    from thc.net.client import AggregationClient
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    params = THCParams(slice_size=256)
    client = AggregationClient(job, rank, addr, run=7 if rank == 0 else None, deadline=3.0)
    model = torch.nn.Linear(32, 32)
    ddp = DDP(model)
    hook = THCHook(model, lambda group: THCAllReduce.through_aggregator(client, params, group),
                   overlap=False)
    hook.load_state_dict({"hook": "THCHook", "owner": checkpoint.owner(rank, 2, (0, 1)),
                          "steps": 0, "residuals": {"weight": torch.full((1024,), 0.5),
                                                    "bias": torch.full((32,), 0.5)}})
    hook.register(ddp)
    out = []
    for step in range(2):
        try:
            ddp(torch.randn(4, 32)).sum().backward()
            out.append("ok")
        except RuntimeError as e:
            out.append(str(e))
        if step == 0:
            try:
                kept = hook.state_dict()["residuals"]
                out.append({name: float(r.sum()) for name, r in kept.items()})
            except Exception as e:  # noqa: BLE001 - what the test reports
                out.append(f"{type(e).__name__}: {e}")
            if rank == 1:
                client.run = 7
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_build_refused_at_its_run_agreement_keeps_the_loaded_residuals_and_builds_anew():
    """The bucket's reducer took the loaded residuals before its run agreement: refused there
    (unlike run ids), the residuals were gone and the hook named the unbuilt reducer as their
    owner, so state_dict() and every later step's build raised a KeyError on every rank, the
    run ids mended or not."""
    from thc.codec.params import THCParams
    from thc.net.aggregator import Aggregator
    from thc.testing.clusters import local_job
    job = local_job(1, 2, free_port_block(2), table=THCParams().table)
    with Aggregator([job]) as agg:
        addr = agg.start()
        res = gloo_pair(functools.partial(_run_refused_worker, job, addr))
    for rank in (0, 1):
        refused, kept, then = res[rank]
        assert "run" in refused and kept == {"weight": 512.0, "bias": 16.0}, res
        assert then == "ok", res
