"""DDP communication hooks in real multi-process Gloo groups."""
from __future__ import annotations

import functools
import math
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
from tests.procs import gloo_pair

WORLD = 2


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))


def _data(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(32, 64, generator=g), torch.randint(0, 4, (32,), generator=g)


def _grads_without_ddp(rank):
    m = _model()
    x, y = _data(rank)
    torch.nn.functional.cross_entropy(m(x), y).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


KINDS = ("thc", "topk", "marsit")


def _worker(rank, port, q):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import HookOptions, MarsitHook, THCHook, TopKHook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    results = {}
    for kind in KINDS:
        model = _model()
        ddp = DDP(model)
        opts = HookOptions(uncompressed=("2.bias",))
        if kind == "thc":
            gen = torch.Generator().manual_seed(rank)
            hook = THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
                group, params=THCParams(seed=3), generator=gen), opts).register(ddp)
        elif kind == "marsit":
            hook = MarsitHook(model, opts,
                              generator=torch.Generator().manual_seed(rank)).register(ddp)
        else:
            hook = TopKHook(model, ratio=0.25, options=opts).register(ddp)
        x, y = _data(rank)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        start = time.perf_counter()
        loss.backward()
        backward = time.perf_counter() - start
        br, idle = hook.step_breakdown(), hook.step_breakdown()
        results[kind] = ({n: p.grad.numpy().copy() for n, p in model.named_parameters()},
                         hook.fp32_elements, hook.bytes_sent, (br.comm, br.exposed, backward),
                         (idle.comm, idle.exposed))
    q.put((rank, results))
    dist.destroy_process_group()


SHARED = pytest.mark.xdist_group("ddp_all_kinds")
"""The tests that read :func:`_run_all`'s one pair of spawned processes: one pytest-xdist
process runs them, so the pair is spawned once."""


@functools.lru_cache(maxsize=None)
def _run_all():
    """Every hook kind in one pair of spawned processes (one Gloo group, a DDP model each)."""
    out = gloo_pair(_worker, WORLD, free_port_block(1))
    ref = [_grads_without_ddp(r) for r in range(WORLD)]
    mean = {k: ((ref[0][k] + ref[1][k]) / 2).numpy() for k in ref[0]}
    return out, mean


def _run(kind):
    out, mean = _run_all()
    return {r: out[r][kind] for r in out}, mean


@SHARED
@pytest.mark.parametrize("kind", KINDS)
def test_hook_gives_every_rank_the_same_gradient(kind):
    out, mean = _run(kind)
    for name in mean:
        np.testing.assert_array_equal(out[0][0][name], out[1][0][name])
    # The parameter left uncompressed gets the exact FP32 mean (up to summation order).
    np.testing.assert_allclose(out[0][0]["2.bias"], mean["2.bias"], rtol=1e-5, atol=1e-7)
    assert out[0][1] == 4, "only 2.bias (4 elements) goes through FP32"
    assert out[0][2] > 0
    # Every bucket is handed over and reduced, one after another on the communication
    # thread, within backward(): neither figure can exceed the backward pass they split.
    comm, exposed, backward = out[0][3]
    assert 0 < comm <= backward and 0 <= exposed <= backward, (comm, exposed, backward)
    # a step that reduced nothing (a no_sync micro-step) gave the last one's exposed again
    assert out[0][4] == (0.0, 0.0)


@SHARED
def test_thc_hook_gradient_close_to_the_mean():
    out, mean = _run("thc")
    num = sum(float(((out[0][0][k] - mean[k]) ** 2).sum()) for k in mean)
    den = sum(float((mean[k] ** 2).sum()) for k in mean)
    # Two workers' THC estimate of their mean: relative error well under 10%.
    assert num / den < 0.1, num / den


COMPRESSED = ("0.weight", "0.bias", "2.weight")
"""The parameters the shared run's hooks compress (2.bias stays FP32)."""


@SHARED
def test_topk_hook_gives_the_mean_of_every_ranks_largest_values():
    """Each rank sends its k = ceil(0.25 n) largest-magnitude coordinates of the compressed
    part (one bucket): every rank's gradient is their sum over the ranks, averaged. The
    reference is built here from each rank's own gradient without DDP."""
    out, _ = _run("topk")
    local = [_grads_without_ddp(r) for r in range(WORLD)]
    flats = [torch.cat([local[r][n].reshape(-1) for n in COMPRESSED]) for r in range(WORLD)]
    k = math.ceil(0.25 * flats[0].numel())
    want = torch.zeros_like(flats[0])
    for f in flats:
        top = torch.topk(f.abs(), k).indices
        want[top] += f[top]
    want /= WORLD
    for rank in range(WORLD):
        got = torch.cat([torch.from_numpy(out[rank][0][n]).reshape(-1) for n in COMPRESSED])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)


@SHARED
def test_marsit_hook_gives_each_coordinate_a_ranks_sign_at_the_shared_scale():
    """Marsit's estimate of a tensor is its ranks' mean absolute value with, per coordinate,
    one rank's sign: where the two ranks' signs differ, either one's with probability 1/2 (the
    merge is unbiased for the mean sign), in every block of 1024 coordinates (the ring merges
    each rank's segment in turn: a hop that passed its bits on unmerged would give a block
    one rank's signs only)."""
    out, _ = _run("marsit")
    local = [_grads_without_ddp(r) for r in range(WORLD)]
    blocks = 0
    for n in COMPRESSED:
        got = torch.from_numpy(out[0][0][n]).reshape(-1)
        signs = [torch.sign(local[r][n]).reshape(-1) for r in range(WORLD)]
        scale = sum(float(local[r][n].abs().mean()) for r in range(WORLD)) / WORLD
        torch.testing.assert_close(got.abs(), torch.full_like(got, scale), rtol=1e-5, atol=0)
        mine = torch.sign(got)
        assert bool(((mine == signs[0]) | (mine == signs[1]) | (signs[0] == 0)
                     | (signs[1] == 0)).all()), n
        for start in range(0, got.numel(), 1024):
            part = slice(start, start + 1024)
            unlike = signs[0][part] * signs[1][part] < 0
            m = int(unlike.sum())
            if m < 100:
                continue
            took = int((mine[part][unlike] == signs[0][part][unlike]).sum())
            assert abs(took / m - 0.5) < 5 * 0.5 / math.sqrt(m), (n, start, took, m)
            blocks += 1
    assert blocks >= 8, blocks


class _Crossed(torch.nn.Module):
    """``first`` is registered first but runs second: DDP's first buckets (reverse
    registration order) hold ``second`` in bucket 0, its rebuilt ones (gradient-ready order)
    ``first``; both buckets are the same size."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.second(x)
        return self.first(h).pow(2).sum() + 1e3 * h.pow(2).sum()   # second's grads are large


@pytest.mark.parametrize("kind", ["thc", "topk"])
def test_a_rebuilt_bucket_keeps_its_parameters_residuals(kind):
    """Residuals were keyed by bucket index and size: after DDP's rebuild, bucket 0 held
    ``first`` and was handed ``second``'s residual (first's gradient off by 10^5 in NMSE)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook, TopKHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        model = _Crossed()
        cap = 64 * 65 * 4 / 2 ** 20
        ddp = DDP(model, bucket_cap_mb_list=[cap, cap])
        hook = THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(slice_size=1024), generator=0), overlap=False) \
            if kind == "thc" else TopKHook(model, ratio=0.05, overlap=False)
        hook.register(ddp)
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
        errors = []
        for _ in range(2):
            model.zero_grad()
            ddp(x).backward()
            got = model.first.weight.grad.clone()
            model.zero_grad()
            model(x).backward()   # one worker: the mean is its own gradient
            want = model.first.weight.grad
            errors.append(float((got - want).pow(2).sum() / want.pow(2).sum()))
        assert errors[1] < 2 * errors[0] + 0.1, errors
    finally:
        dist.destroy_process_group()


class _SyncedBackward(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient on the model's group, as
    SyncBatchNorm's does, late on rank 0 (a slower backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if dist.get_rank() == 0:
            time.sleep(0.3)
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g / dist.get_world_size()


class _Synced(torch.nn.Module):
    def __init__(self, unused: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = (torch.nn.Linear(16, 16, bias=False) for _ in range(2))
        if unused:   # no gradient: DDP all-reduces its table of unused parameters
            self.unused = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.b(_SyncedBackward.apply(self.a(x))).square().sum()


def _synced_worker(unused, rank, port, q):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import FP32Hook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    out = {}
    for overlap in (False, True):
        model = _Synced(unused)
        ddp = DDP(model, bucket_cap_mb=1e-4, find_unused_parameters=unused)   # a bucket each
        FP32Hook(model, overlap=overlap).register(ddp)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):   # DDP's first step has one bucket; then one per parameter
            model.zero_grad()
            ddp(torch.randn(8, 16, generator=gen)).backward()
        out[overlap] = [p.grad.clone().numpy() for p in (model.a.weight, model.b.weight)]
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("unused", [False, True])
def test_collectives_of_backward_and_ddp_never_pair_with_the_hooks(unused):
    """A backward that all-reduces on the model's group (SyncBatchNorm) and DDP's table of
    unused parameters: the overlap thread issued the hook's all-reduces beside them in
    another order on each rank, and Gloo paired them (an abort, or a wrong mean where the
    lengths matched; overlap was turned off for unused parameters). The hook's collectives
    now run on a group of its own: overlapped or not, the same gradients on both ranks."""
    res = gloo_pair(functools.partial(_synced_worker, unused))
    for rank in (0, 1):
        for plain, overlapped in zip(res[rank][False], res[rank][True]):
            np.testing.assert_array_equal(plain, overlapped)
    for g0, g1 in zip(res[0][True], res[1][True]):
        np.testing.assert_array_equal(g0, g1)


def _half_worker(rank, port, q):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import HookOptions, TopKHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    hook = TopKHook(model, options=HookOptions(min_numel=1 << 20), overlap=False)
    ddp = DDP(model)
    hook.register(ddp)
    ddp(torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()
    q.put((rank, (hook.bytes_sent, hook.fp32_elements)))
    dist.destroy_process_group()


def test_uncompressed_spans_count_the_bytes_they_travel_in():
    """A bf16 model's uncompressed spans are summed in float32, with their tag lanes: 4 bytes
    an element on the wire, as counted."""
    from thc.collective.agreement import sum_tag_lanes
    res = gloo_pair(_half_worker)
    for rank in (0, 1):
        sent, elements = res[rank]
        # and two agreements, the hook's settings and the bucket's split: nine float32 lanes
        # each, as a ring all-reduce sends them
        spans = 2 * (2 - 1) * (72 + sum_tag_lanes(2)) * 4 // 2
        assert elements == 72 and sent == spans + 2 * 36, res[rank]


def _fp16_sum_worker(rank, port, q):
    from thc.collective.ddp import FP32Hook, HookOptions, THCHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    model = torch.nn.Linear(4, 4)
    hook = FP32Hook(model, overlap=False)
    whole = hook.reduce("b", torch.full((16,), 40000.0, dtype=torch.float16), [16])
    spans = THCHook(model, lambda group: None, HookOptions(uncompressed=("weight", "bias")),
                    overlap=False)
    buf = spans._reduce_bucket("k", torch.full((20,), 40000.0, dtype=torch.float16),
                               [(0, 16, True, 0.0), (16, 20, True, 1.0)])
    q.put((rank, (whole.tolist(), buf.tolist())))
    dist.destroy_process_group()


def test_half_buckets_are_divided_before_their_sum():
    """Two workers' 40000 in fp16: the mean fits, the sum (80000) does not. The FP32 hook and
    the uncompressed spans summed first and divided after, and returned Inf."""
    res = gloo_pair(_fp16_sum_worker)
    for rank in (0, 1):
        whole, spans = res[rank]
        assert whole == [40000.0] * 16 and spans == [40000.0] * 20, res[rank]


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


def test_a_hook_on_a_smaller_group_that_overlaps_needs_a_group_made_by_every_rank():
    """The hook made its collectives' group from its own ranks alone: torch names groups by
    a per-process count, so ranks outside it fell one behind and the next group the whole
    world made got two names (a hang), and hooks of disjoint replica groups shared one name
    (ranks of both paired). Only the world's group is made inside the hook now."""
    from thc.collective.ddp import FP32Hook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        replicas, own = dist.new_group([0]), dist.new_group([0])
        model = torch.nn.Linear(2, 2)
        with pytest.raises(ValueError, match="comm_group=dist.new_group"):
            FP32Hook(model, group=replicas)
        assert FP32Hook(model, group=replicas, overlap=False).group is replicas
        assert FP32Hook(model, group=replicas, comm_group=own).group is own
        world = FP32Hook(model).group
        assert world is not None and world is not dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _one_backward(hook_of, rank, port, q):
    """One backward of a Linear(8, 4) under DDP with the hook ``hook_of(model, rank)``;
    puts (rank, (what it raised or "returned", seconds)). Rank 1 lives on a while after, as
    a trainer would."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ddp = DDP(model)
    hook_of(model, rank).register(ddp)
    start = time.monotonic()
    try:
        ddp(torch.ones(3, 8)).sum().backward()
        out = "returned"
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        out = str(e)
    q.put((rank, (out, time.monotonic() - start)))
    time.sleep(1 if rank == 0 else 5)
    dist.destroy_process_group()


def _unlike_options_hook(model, rank):
    from thc.collective.ddp import FP32Hook, HookOptions
    opts = HookOptions(uncompressed=("bias",) if rank == 0 else ())
    return FP32Hook(model, options=opts, overlap=False)


def test_ranks_that_split_a_bucket_unlike_refuse_it():
    """Rank 0 keeps the bias in FP32, rank 1 does not: rank 0's FP32 span paired with rank
    1's reduction of the whole bucket (20 floats against 4: Gloo aborts; equal lengths sum
    unlike things). Every rank checks a bucket's split before its first reduction."""
    res = gloo_pair(functools.partial(_one_backward, _unlike_options_hook))
    assert all("differ in the hook" in res[rank][0] for rank in (0, 1)), res


def _two_buckets_backward(name, rank, port, q):
    """One backward of a model with a float32 and a float64 layer (a DDP bucket each), rank
    0 alone keeping ``name`` in FP32."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import FP32Hook, HookOptions
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    torch.manual_seed(0)

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 4)
            self.b = torch.nn.Linear(8, 4).double()

        def forward(self, x):
            return self.a(x).sum() + self.b(x.double()).sum()
    model = Mixed()
    ddp = DDP(model)
    opts = HookOptions(uncompressed=(name,) if rank == 0 else ())
    FP32Hook(model, options=opts, overlap=False).register(ddp)
    try:
        ddp(torch.ones(2, 8)).backward()
        out = "returned"
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        out = str(e)
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["a.bias", "b.bias"])
def test_every_bucket_is_checked_not_the_first_alone(name):
    """DDP makes a bucket per dtype: a split unlike on the ranks in the bucket reduced second
    must be refused as one in the first is."""
    res = gloo_pair(functools.partial(_two_buckets_backward, name))
    assert all("differ in the hook" in res[rank] for rank in (0, 1)), res


def test_a_hooks_group_is_its_own_keeps_the_timeout_and_refuses_after_an_abandoned_round():
    """Two hooks given one comm_group interleaved their threads' collectives differently on
    each rank (both ranks' gradients wrong, swapped); the group a hook made waited torch's
    30 minutes, not the job's timeout; and a bucket's split check still issued its
    all-reduce on a group a failed round had left mid-round (it paired with the peer's
    pending sum: a wrong mean)."""
    from thc.collective import agreement
    from thc.collective.ddp import FP32Hook
    from thc.collective.torchgaps import group_timeout
    from thc.collective.transports import DistTransport
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1, timeout=timedelta(seconds=7))
    try:
        shared = dist.new_group()
        model = torch.nn.Linear(2, 2)
        first = FP32Hook(model, comm_group=shared)
        with pytest.raises(ValueError, match="carries another hook's collectives"):
            FP32Hook(model, comm_group=shared)
        assert FP32Hook(model, comm_group=shared, overlap=False).group is shared
        assert group_timeout(FP32Hook(model).group) == timedelta(seconds=7)
        DistTransport(first.group).abandon("round 3 failed between its MAX round and its sums")
        with pytest.raises(RuntimeError, match="no THC round may use this process group"):
            agreement.together(first.group, 0, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


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


def _two_hooks_worker(rank, port, q, kind="thc", unlike=False, swap_at=2):
    """Two models, each with a hook of ``kind`` on the one group; in step ``swap_at`` rank 1
    runs B's backward before A's: each step's outcome on this rank, and the hooks' indices.
    ``unlike``: B has 8 outputs, A 4, and their biases stay FP32."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import FP32Hook, HookOptions, THCHook, TopKHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    models = [_model(), _model()]
    opts = HookOptions(uncompressed=("bias",) if unlike else ())
    if unlike:
        models[1][2] = torch.nn.Linear(128, 8)
    ddps = [DDP(m) for m in models]
    if kind == "thc":
        hooks = [THCHook(m, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(slice_size=256), generator=rank), opts, overlap=False)
            for m in models]
    elif kind == "fp32":
        hooks = [FP32Hook(m, opts, overlap=False) for m in models]
    else:
        hooks = [TopKHook(m, ratio=0.25, options=opts, overlap=False) for m in models]
    for hook, d in zip(hooks, ddps):
        hook.register(d)
    out = []
    for step in range(3):
        x, y = _data(rank)
        losses = [torch.nn.functional.cross_entropy(d(x), y) * scale
                  for d, scale in zip(ddps, (1, 100))]
        errors = []
        for loss in (losses[::-1] if step == swap_at and rank == 1 else losses):
            try:   # both backwards on every rank: DDP's next forward needs both
                loss.backward()
            except RuntimeError as e:
                errors.append(str(e))
        out.append(" | ".join(errors) or "ok")
    q.put((rank, (out, [h.index for h in hooks])))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind,unlike", [("thc", False), ("topk", False), ("thc", True)])
def test_two_hooks_on_one_group_never_pair_each_others_rounds(kind, unlike):
    """Each hook named its reducers by its own build count alone: ("hook", 0) on both, so a
    rank that reduced the second model's bucket first paired it with the first model's (a
    mean of gradients 100x apart, taken on every rank). TopK's check named no hook at all.
    ``unlike``: the FP32 spans (biases of 4 and 8) went out before the checked round, and
    Gloo aborted the process on their unlike lengths."""
    res = gloo_pair(functools.partial(_two_hooks_worker, kind=kind, unlike=unlike))
    for rank in (0, 1):
        out, indices = res[rank]
        assert out[:2] == ["ok", "ok"] and indices == [("0", 0), ("0", 1)], res
        assert "which reducer it is" in out[2], res


def test_two_fp32_hooks_on_one_group_never_pair_each_others_first_buckets():
    """A bucket's check named the hook's kind and spans, not which hook: two models of one
    layout whose backwards ran in another order on rank 1 paired A's gradient with B's, a
    mean taken on every rank. (FP32Hook checks a bucket's first reduction only, as DDP's own
    all-reduce checks none.)"""
    res = gloo_pair(functools.partial(_two_hooks_worker, kind="fp32", swap_at=0))
    for rank in (0, 1):
        out, _ = res[rank]
        assert "which of the hooks built on the group it is" in out[0], res


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
        Late(model, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(seed=3)), overlap=overlap).register(ddp)
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


def test_a_factory_must_build_a_new_reducer_on_the_group_it_is_given():
    """A factory that handed every bucket one reducer mixed the buckets' residuals (each took
    the other's rounding error: first.weight's gradient off by 10^3-10^5 in NMSE), and one
    that ignored its group ran the rounds beside backward's own collectives (Gloo aborted a
    process); neither was refused."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import MarsitHook, THCHook
    from thc.collective.marsit import MarsitAllReduce
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        params = THCParams(slice_size=1024)
        made: list = []

        def one_for_all(group):
            if not made:
                made.append(THCAllReduce.through_torch_distributed(group, params=params))
            return made[0]
        model = _Crossed()
        cap = 64 * 65 * 4 / 2 ** 20
        ddp = DDP(model, bucket_cap_mb_list=[cap, cap])
        THCHook(model, one_for_all, overlap=False).register(ddp)
        with pytest.raises(RuntimeError, match="another bucket uses"):
            ddp(torch.randn(16, 64)).backward()
        for hook in (lambda m: THCHook(m, lambda group: THCAllReduce.through_torch_distributed(
                         params=params)),
                     lambda m: MarsitHook(m, make_allreducer=lambda group: MarsitAllReduce())):
            model = _model()
            ddp = DDP(model)
            hook(model).register(ddp)
            x, y = _data(0)
            with pytest.raises(RuntimeError, match="another process group"):
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
    finally:
        dist.destroy_process_group()


def _unlike_settings_worker(base, rank, port, q):
    """Ranks unlike in a hook's settings (overlap; comm_group on a smaller group; a mode one
    rank cannot take), then in their clients' run ids (rank 0's given, rank 1's to agree),
    through the hook and through worker_client: per case, what each rank raised and how long
    it took."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook, TopKHook
    from thc.collective.worker import worker_client
    from thc.net.client import AggregationClient
    from thc.testing.clusters import local_job
    from thc.wire.jobs import Cluster
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    params = THCParams(slice_size=256)
    job = local_job(1, 2, base, granularity=params.granularity, table=params.table)
    # no round reaches the aggregator: any address will do
    client = AggregationClient(job, rank, ("127.0.0.1", base + 2), run=7 if rank == 0 else None)
    both = dist.new_group([0, 1])
    mine = dist.new_group([0, 1])

    def reducer(group):
        return THCAllReduce.through_torch_distributed(group, params=params)
    cases = {"overlap": lambda m: THCHook(m, reducer, overlap=rank == 0),
             "comm_group": lambda m: THCHook(m, reducer, group=both,
                                             comm_group=mine if rank == 0 else None),
             "nonfinite": lambda m: TopKHook(m, nonfinite="propagate" if rank else "hand on"),
             "ratio": lambda m: TopKHook(m, ratio=0.0 if rank else 0.5),
             "factory_group": lambda m: THCHook(m, lambda group: THCAllReduce.through_aggregator(
                 AggregationClient(job, rank, ("127.0.0.1", base + 2), run=9,
                                   sock=client.sock), params)),
             "run": lambda m: THCHook(m, lambda group: THCAllReduce.through_aggregator(
                 client, params, group)),
             "worker_client": lambda m: worker_client(
                 Cluster((job,)), rank, ("127.0.0.1", base + 2), run=7 if rank == 0 else None,
                 sock=client.sock)}
    out = {}
    for case, hook in cases.items():
        start = time.monotonic()
        try:
            model = torch.nn.Linear(32, 32)
            ddp = DDP(model)
            hook(model).register(ddp)
            ddp(torch.randn(4, 32)).sum().backward()
            got = "returned"
        except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
            got = str(e)
        out[case] = (got, time.monotonic() - start)
    q.put((rank, out))
    time.sleep(1)
    dist.destroy_process_group()


def test_ranks_unlike_in_a_hooks_settings_or_their_run_ids_all_raise_at_once():
    """A hook that overlaps on one rank only made its group there alone (a wait in new_group
    until the store's timeout, 30 minutes by default); one rank's settings refused on that
    rank alone left the others in the hook's next collective; a run id given to one rank's
    client only left the other rank alone in the run's agreement until the group's timeout,
    and no error named the cause. So did a TopK ratio refused on one rank (checked after the
    agreement). An aggregator reducer built on another group than the one its factory was
    given would agree its run there, from the hook's thread, beside backward's collectives."""
    res = gloo_pair(functools.partial(_unlike_settings_worker, free_port_block(3)))
    refused = "failed before this round's collectives"
    expected = {"overlap": ("overlap, comm_group or nonfinite",) * 2,
                "comm_group": (refused, "overlaps backward runs its collectives on a group"),
                "nonfinite": ("nonfinite must be one of", refused),
                "ratio": (refused, "TopK ratio must be in (0, 1]"),
                "factory_group": ("collectives run on another process group",) * 2,
                "run": ("different run ids (rank 0: 7, rank 1: none)",) * 2,
                "worker_client": ("different run ids (rank 0: 7, rank 1: none)",) * 2}
    for case, texts in expected.items():
        for rank in (0, 1):
            got, seconds = res[rank][case]
            assert texts[rank] in got and seconds < 15, (case, rank, res[rank][case])


def test_hooks_on_two_groups_name_their_reducers_apart():
    """A hook's place was counted per group only: hooks on two groups of the same ranks both
    took place 0, and their reducers' names matched where they shared an aggregator client."""
    from thc.collective.ddp import FP32Hook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        first = FP32Hook(model, overlap=False)
        second = FP32Hook(model, group=dist.new_group([0]), overlap=False)
        assert first.index[1] == second.index[1] == 0 and first.index != second.index
    finally:
        dist.destroy_process_group()


class _Phase(torch.nn.Module):
    """A complex parameter (DDP's bucket holds its real view, twice its numel) and a real one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.z = torch.nn.Parameter(torch.randn(600, dtype=torch.cfloat))
        self.w = torch.nn.Parameter(torch.randn(600))

    def forward(self, x):
        return ((self.z * x).abs() ** 2).sum() + (self.w * x.real).sum()


def _phase_input(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.complex(torch.randn(600, generator=g), torch.randn(600, generator=g))


def _complex_worker(rank, port, q):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import FP32Hook, MarsitHook, THCHook, TopKHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    out = {}
    for kind in ("fp32", "thc", "topk", "marsit"):
        model = _Phase()
        ddp = DDP(model)
        if kind == "fp32":
            FP32Hook(model, overlap=False).register(ddp)
        elif kind == "thc":
            THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
                group, params=THCParams(slice_size=256), generator=rank),
                overlap=False).register(ddp)
        elif kind == "topk":
            TopKHook(model, ratio=0.5, overlap=False).register(ddp)
        else:
            MarsitHook(model, generator=torch.Generator().manual_seed(rank),
                       overlap=False).register(ddp)
        ddp(_phase_input(rank)).backward()
        out[kind] = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    q.put((rank, out))   # numpy: torch's queue hands tensors over in memory the worker frees
    dist.destroy_process_group()


def test_a_complex_parameter_is_reduced_whole_and_alike_on_every_rank():
    """DDP's bucket holds a complex parameter as its real view: the hooks cut their spans by
    numel, so half of the bucket was never reduced and each rank kept its own (FP32's mean
    off on both ranks, and unlike). Every hook now gives every rank the same gradient, and
    FP32's is the mean."""
    res = gloo_pair(_complex_worker)
    grads = []
    for rank in range(WORLD):
        m = _Phase()
        m(_phase_input(rank)).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    mean = {n: (grads[0][n] + grads[1][n]) / 2 for n in grads[0]}
    for kind in ("fp32", "thc", "topk", "marsit"):
        for n in mean:
            np.testing.assert_array_equal(res[0][kind][n], res[1][kind][n], err_msg=kind)
    for n in mean:
        torch.testing.assert_close(torch.from_numpy(res[0]["fp32"][n]), mean[n])
        thc = torch.from_numpy(res[0]["thc"][n])
        err = (thc - mean[n]).abs().pow(2).sum() / mean[n].abs().pow(2).sum()
        assert err < 0.1, (n, float(err))


def _misfit_worker(rank, port, q):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import FP32Hook, TopKHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    out = []
    alone = [dist.new_group([r]) for r in range(WORLD)]
    model = _model()
    try:   # replicas DDP keeps apart, each on a group of its own
        FP32Hook(model, overlap=False).register(DDP(model, process_group=alone[rank]))
        out.append("registered")
    except ValueError as e:
        out.append(str(e))
    own = dist.new_group([0, 1])
    try:   # an overlapping hook whose group DDP's own collectives use too
        FP32Hook(model, comm_group=own).register(DDP(model, process_group=own))
        out.append("registered")
    except ValueError as e:
        out.append(str(e))
    other = _model()
    try:   # a hook built for one model, installed on another's DDP
        FP32Hook(model, overlap=False).register(DDP(other))
        out.append("registered")
    except ValueError as e:
        out.append(str(e))
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 8, sparse=True)
    ddp = DDP(emb)
    TopKHook(emb, overlap=False).register(ddp)
    try:
        ddp(torch.tensor([1, 2, 3 + rank])).sum().backward()
        out.append("reduced")
    except (ValueError, RuntimeError) as e:
        out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_hook_refuses_a_ddp_group_of_other_ranks_another_model_and_sparse_gradients():
    """A DDP model on a group of its own rank only, under a hook of the whole world: the
    hook averaged the replicas DDP keeps apart. An overlapping hook's group that DDP uses
    too paired DDP's collectives with the hook's. A hook built for another model compressed
    what its options keep FP32 (they name that model's parameters). A sparse gradient
    failed deep in torch (as_strided on SparseCPU); every rank now names it."""
    res = gloo_pair(_misfit_worker)
    for rank in range(WORLD):
        group, shared, model, sparse = res[rank]
        assert f"process group holds ranks [{rank}], the hook's workers [0, 1]" in group, group
        assert "process group is the hook's own" in shared, shared
        assert "built for another model" in model, model
        assert "sparse gradient" in sparse, sparse


def _hooked(rank, port, kind):
    """A two-rank Gloo group and a DDP model with ``kind``'s hook, not overlapped."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import HookOptions, MarsitHook, THCHook, TopKHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    model = _model()
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(rank)
    if kind == "thc":
        # with an FP32 span, whose tag lanes hold the step: join()'s shadow steps count too
        THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(seed=3), generator=gen),
            HookOptions(uncompressed=("2.bias",)), overlap=False).register(ddp)
    elif kind == "spans":   # FP32 spans alone: their tag lanes are the only check
        THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(seed=3), generator=gen),
            HookOptions(min_numel=1 << 30), overlap=False).register(ddp)
    elif kind == "topk":
        TopKHook(model, overlap=False).register(ddp)
    else:
        MarsitHook(model, overlap=False, generator=gen).register(ddp)
    return model, ddp


def _outcome(ddp, x, y, forwards=1) -> str:
    """One backward of the summed loss of ``forwards`` forwards: "ok", or what it raised."""
    try:
        sum(torch.nn.functional.cross_entropy(ddp(x), y) for _ in range(forwards)).backward()
        return "ok"
    except (ValueError, RuntimeError) as e:
        return str(e)


def _out_of_step_worker(rank, port, q, kind, alone):
    """Four DDP steps with ``kind``'s hook; in step 1 rank 0 runs under ``no_sync`` (``alone``)
    or both ranks do (gradient accumulation): each step's outcome on this rank."""
    model, ddp = _hooked(rank, port, kind)
    out = []
    for step in range(4 if rank == 0 or not alone else 3):
        x, y = _data(rank * 10 + step)
        if step == 1 and (rank == 0 or not alone):
            with ddp.no_sync():
                done = _outcome(ddp, x, y)
            out.append("accumulated" if done == "ok" else done)
            continue
        out.append(_outcome(ddp, x, y))
        model.zero_grad(set_to_none=True)
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", KINDS + ("spans",))
def test_a_rank_a_whole_step_out_of_step_is_refused_by_every_rank(kind):
    """Each reducer counted its own rounds: rank 0 running step 1 under no_sync alone kept
    every reducer in step with its peer's while pairing rank 0's steps 1+2 with rank 1's
    step 1, and every later step with the step before, each taken as a sum. Rounds now also
    count the DDP model's no_sync stretches (``BaseHook._stretches``): every later step is
    refused on both ranks, naming the cause. So do the tag lanes of a hook's FP32 spans,
    where every span is one (they held the step and bucket alone, and took those sums)."""
    res = gloo_pair(functools.partial(_out_of_step_worker, kind=kind, alone=True))
    assert res[0][:2] == ["ok", "accumulated"], res
    assert res[1][:1] == ["ok"], res
    for rank, steps in ((0, res[0][2:4]), (1, res[1][1:3])):
        for text in steps:
            assert "no_sync alone" in text, (rank, text)


@pytest.mark.parametrize("kind", KINDS + ("spans",))
def test_gradient_accumulation_on_every_rank_stays_in_step(kind):
    """no_sync on every rank (the forwards jump alike): every synced step is reduced."""
    res = gloo_pair(functools.partial(_out_of_step_worker, kind=kind, alone=False))
    assert res[0] == res[1] == ["ok", "accumulated", "ok", "ok"], res


def _probe_worker(rank, port, q, kind, alone):
    """Three DDP steps with ``kind``'s hook. In step 0 rank 1 runs a forward under
    ``no_sync`` between its synced forward and that forward's backward (a probe, never
    backpropagated), and (``alone``) rank 0 first accumulates a micro-batch under ``no_sync``
    alone: each step's outcome on this rank."""
    model, ddp = _hooked(rank, port, kind)
    loss_of = torch.nn.functional.cross_entropy
    out = []
    for step in range(3):
        x, y = _data(rank * 10 + step)
        try:
            if step == 0 and rank == 0 and alone:
                with ddp.no_sync():
                    loss_of(ddp(*_data(50)[:1]), _data(50)[1]).backward()
            loss = loss_of(ddp(x), y)
            if step == 0 and rank == 1:
                with ddp.no_sync():
                    ddp(x)
            loss.backward()
            out.append("ok")
        except (ValueError, RuntimeError) as e:
            out.append(str(e))
        model.zero_grad(set_to_none=True)
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", KINDS)
def test_a_probe_forward_under_no_sync_counts_no_stretch(kind):
    """A stretch counted at the first gradient after a forward under no_sync, whatever that
    backward ran through: rank 1's probe forward counted as one, so every later step was
    refused ("a worker missed a round"), and beside rank 0's step accumulated alone it
    stood in for rank 0's stretch: both ranks took the sum of rank 0's two micro-batches and
    rank 1's one. A stretch now counts where a backward runs through its outputs."""
    res = gloo_pair(functools.partial(_probe_worker, kind=kind, alone=False))
    assert res[0] == res[1] == ["ok"] * 3, res
    res = gloo_pair(functools.partial(_probe_worker, kind=kind, alone=True))
    for rank in (0, 1):
        assert all("no_sync alone" in text for text in res[rank]), (rank, res[rank])


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


def _unlike_forwards_worker(rank, port, q, kind):
    """Three DDP steps with ``kind``'s hook in which rank 0 runs one forward more than rank 1
    before each backward (a rollout one longer, a probe loss), DDP's sum of the losses, and
    before that a forward alone under ``no_sync`` (an evaluation wrapped in it); then
    rank 0 has one batch more than rank 1 under ``ddp.join()`` (whose shadow steps call the
    hook without a forward): each step's outcome on this rank."""
    model, ddp = _hooked(rank, port, kind)
    out = []
    for step in range(3):
        if rank == 0:
            with ddp.no_sync():
                ddp(_data(99)[0])
        out.append(_outcome(ddp, *_data(rank * 10 + step), forwards=2 - rank))
        model.zero_grad(set_to_none=True)
    with ddp.join():
        for step in range(3 - rank):
            out.append(_outcome(ddp, *_data(rank * 10 + step)))
            model.zero_grad(set_to_none=True)
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_with_unlike_forwards_or_batches_under_join_are_reduced(kind):
    """Rounds counted the model's forwards for a while: ranks running unlike numbers of them
    before one backward (DDP sums that) were refused at every step, and TopK's shadow steps
    under join too. Then stretches under no_sync counted without a backward in them: one
    rank's evaluation under no_sync was refused at every later step."""
    res = gloo_pair(functools.partial(_unlike_forwards_worker, kind=kind))
    assert res[0] == ["ok"] * 6 and res[1] == ["ok"] * 5, res


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


@pytest.mark.parametrize("overlaps,by_hand", [((True, True), False), ((False, True), False),
                                              ((True, False), False), ((False, False), False),
                                              ((True, True), True)])
def test_hooks_sharing_an_aggregator_client_may_not_overlap(overlaps, by_hand):
    """Two hooks whose reducers share a client, one of them on a thread of its own: their
    rounds met in unlike orders on each rank, refused (each reducer now holds the client for
    its whole round) or, before that, summed with each other. The second hook's build is
    refused on every rank, naming the way out; two hooks that do not overlap share it. So
    are hooks installed by hand (``register_comm_hook(None, hook.hook)``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    from thc.net.aggregator import Aggregator
    from thc.net.client import AggregationClient
    from thc.testing.clusters import free_tcp_port, local_job
    job = local_job(1, 1, free_port_block(1), pool_size=32)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        with Aggregator([job]) as agg, AggregationClient(job, 0, agg.start(), run=1) as client:
            models = [torch.nn.Linear(64, 64) for _ in overlaps]
            ddps = [DDP(m) for m in models]
            for m, ddp, overlap in zip(models, ddps, overlaps):
                hook = THCHook(m, lambda group: THCAllReduce.through_aggregator(
                    client, THCParams(seed=3, slice_size=256), group), overlap=overlap)
                if by_hand:
                    ddp.register_comm_hook(None, hook.hook)
                else:
                    hook.register(ddp)
            x = torch.randn(4, 64)
            ddps[0](x).sum().backward()
            if any(overlaps):
                with pytest.raises(RuntimeError, match="another hook's reducers use"):
                    ddps[1](x).sum().backward()
            else:
                ddps[1](x).sum().backward()
                assert all(m.weight.grad is not None for m in models)
    finally:
        dist.destroy_process_group()


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


def test_a_model_wrapped_anew_keeps_its_aggregator_client():
    """A model wrapped in a new DDP with a new overlapping hook on its client (layers
    unfrozen, say): the old hook lives on in the parameters' gradient hooks, and the new
    one's build was refused as sharing its client. Only a hook whose DDP model lives counts."""
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    from thc.net.aggregator import Aggregator
    from thc.net.client import AggregationClient
    from thc.testing.clusters import free_tcp_port, local_job
    job = local_job(1, 1, free_port_block(1), pool_size=32)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        with Aggregator([job]) as agg, AggregationClient(job, 0, agg.start(), run=1) as client:
            model = torch.nn.Linear(64, 64)
            x = torch.randn(4, 64)
            for _ in range(2):
                ddp = DDP(model)
                THCHook(model, lambda group: THCAllReduce.through_aggregator(
                    client, THCParams(seed=3, slice_size=256), group)).register(ddp)
                ddp(x).sum().backward()
                assert model.weight.grad is not None
                model.zero_grad(set_to_none=True)
                del ddp
                gc.collect()
    finally:
        dist.destroy_process_group()


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


def _own_job_worker(jobs, addr, rank, port, q):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    from thc.net.client import AggregationClient
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    model = _model()
    ddp = DDP(model)
    client = AggregationClient(jobs[rank], 0, addr, run=1, deadline=3.0)
    THCHook(model, lambda group: THCAllReduce.through_aggregator(
        client, THCParams(seed=3), group), overlap=False).register(ddp)
    try:
        torch.nn.functional.cross_entropy(ddp(_data(rank)[0]), _data(rank)[1]).backward()
        q.put((rank, "ok"))
    except RuntimeError as e:
        q.put((rank, str(e)))


def test_a_job_of_fewer_workers_than_the_group_is_refused_on_every_rank():
    """Each rank the only worker of a job of its own: every round was whole, and each rank
    averaged its own gradient, the replicas parting without an error."""
    from thc.net.aggregator import Aggregator
    from thc.testing.clusters import local_job
    base = free_port_block(4)
    jobs = [local_job(1, 1, base), local_job(2, 1, base + 2)]
    with Aggregator(jobs) as agg:
        addr = agg.start()
        res = gloo_pair(functools.partial(_own_job_worker, jobs, addr))
    for rank in (0, 1):
        assert "rounds sum 1 workers' gradients, in a process group of 2 ranks" in res[rank], res


def test_a_hook_is_freed_with_its_ddp_model_when_the_model_is_wrapped_anew():
    """The hook's parameter hooks held it, its thread and its residuals for as long as the
    parameters lived: a model wrapped anew each epoch kept every earlier hook, each still
    running on every gradient."""
    import gc
    import weakref

    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        model, x = torch.nn.Linear(64, 64), torch.randn(4, 64)
        hooks = []
        for _ in range(3):
            ddp = DDP(model)
            hook = THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
                group=group), overlap=True).register(ddp)
            ddp(x).sum().backward()
            hooks.append(weakref.ref(hook))
            del ddp, hook
        end = time.monotonic() + 10   # the comm thread lets its last work item go after
        while any(h() is not None for h in hooks) and time.monotonic() < end:   # the result
            gc.collect()
            time.sleep(0.05)
        assert all(h() is None for h in hooks), [h() for h in hooks]
        model(x).sum().backward()      # no hook left on the parameters runs
    finally:
        dist.destroy_process_group()
