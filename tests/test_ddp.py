"""DDP communication hooks in real multi-process Gloo groups: what each hook gives every rank
(gradients, residuals, bytes), and its rounds kept apart from DDP's own collectives.

When a rank fails: tests/test_ddp_failures.py; groups, agreement and a hook's life:
tests/test_ddp_groups.py."""
from __future__ import annotations

import functools
import math
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from thc.testing.clusters import free_port_block
from tests.ddp_common import (KINDS, WORLD, _Crossed, _data, _hooked, _hooked_with, _model,
                              _out_of_step_worker, _outcome)
from tests.procs import gloo_pair
from tests.test_codec_kernels import kernels


def _grads_without_ddp(rank):
    m = _model()
    x, y = _data(rank)
    torch.nn.functional.cross_entropy(m(x), y).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


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


def test_a_hook_that_does_not_overlap_backward_reports_all_its_communication_exposed(alone):
    """Without overlap every bucket is reduced inside backward, all of it waited for; the
    breakdown counted only the last bucket's (0.2 of 0.8 s in four buckets "exposed", the
    rest "hidden")."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import FP32Hook
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    ddp = DDP(model, bucket_cap_mb=64 * 65 * 4 / 2 ** 20)   # a bucket a layer
    hook = FP32Hook(model, overlap=False).register(ddp)
    reduce = hook.reduce

    def slow(*a, **k):
        time.sleep(0.05)
        return reduce(*a, **k)
    hook.reduce = slow
    for _ in range(2):   # the first step's buckets are DDP's guess, rebuilt after it
        ddp(torch.randn(8, 64)).sum().backward()
        br = hook.step_breakdown()
    assert br.comm >= 4 * 0.05
    assert br.exposed == br.comm and br.hidden == 0.0, br


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
    # Two workers' THC estimate of their mean: about 0.014 here; a bucket scaled 0.85x or
    # 1.15x would already give about 0.04.
    assert num / den < 0.03, num / den


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


class _Forgetful(set):
    """A set that takes nothing in: the hook's count of gradients, missing every one."""

    def add(self, item):
        pass


class _Cut(torch.autograd.Function):
    """Identity forward; no gradient back (a stop-gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return None


class _Heads(torch.nn.Module):
    """A trunk and two heads; ``b`` runs only where asked (a mixture-of-experts' expert), or
    (``"cut"``) behind a stop-gradient: its parameters get no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(16, 64), torch.nn.Linear(64, 8),
                                  torch.nn.Linear(64, 8))

    def forward(self, x, use_b: bool | str):
        h = torch.relu(self.a(x))
        out = self.c(h).square().mean()
        if use_b == "cut":
            return out + _Cut.apply(self.b(h)).square().mean()
        return out + self.b(h).square().mean() if use_b else out


SCHEDULES = {
    # each step: micro-batches (under no_sync, whether each rank runs b, with a backward)
    "mixed": [[(False, u, True)] for u in ((True, True), (True, False), (False, False),
                                          (True, True))],
    # b used in a no_sync micro-batch alone, then a forward with no backward (a probe)
    "probe": [[(True, (True, True), True), (False, (False, False), False),
               (False, (False, False), True)]] * 2,
    # rank 1 runs out of batches (join): its shadow steps reuse its last use of b
    "join": [[(False, (True, False), True)], [(False, (False, True), True)],
             [(False, (False, None), True)], [(False, (True, None), True)]],
    # no zero_grad between synced steps: b keeps the gradient of step 1 in the next two
    "stale": [[(False, u, True)] for u in ((True, True), (False, False), (False, False))],
}
SCHEDULES["frozen"] = SCHEDULES["mixed"]   # b frozen while the hook is registered
# b's first gradient from a backward outside DDP's forward (frozen at register, then not)
SCHEDULES["frozen-module"] = [[("module", (True, True), True), (False, (False, False), True)],
                              [(False, (True, True), True)]]
# b frozen while the hook is registered and takes a saved state, and for two steps after
SCHEDULES["frozen-loaded"] = [[(False, (False, False), True)]] * 2 + \
    [[(False, (True, True), True)]] * 2
# the hook's count of gradients misses every one: the spans alone keep the replicas alike
SCHEDULES["missed"] = SCHEDULES["mixed"]
# b behind a stop-gradient: its gradient hooks fire, with no gradient (DDP: unused)
SCHEDULES["cut"] = [[(False, u, True)] for u in ((True, True), ("cut", "cut"), ("cut", "cut"))]
# under static_graph (not find_unused_parameters): b used by no rank, ever
SCHEDULES["static"] = [[(False, (False, False), True)]] * 3
# a.bias uncompressed: an FP32 span before compressed ones in the bucket (a.weight, a.bias,
# b.weight, b.bias, c.weight, c.bias)
SCHEDULES["fp32-bias"] = SCHEDULES["mixed"]
"""How head ``b`` is used, step by step; None: the rank has joined."""


def _unused_worker(kind, overlap, schedule, view, rank, port, q):
    import contextlib
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import HookOptions, MarsitHook, THCHook, TopKHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    model = _Heads()
    plain = copy.deepcopy(model)
    unused = {"static_graph": True} if schedule == "static" else {"find_unused_parameters": True}
    ddp = DDP(model, gradient_as_bucket_view=view, **unused)
    gen = torch.Generator().manual_seed(rank)
    opts = HookOptions(uncompressed=("a.bias",) if schedule == "fp32-bias" else ())
    if kind == "thc":
        hook = THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(slice_size=256), generator=gen), opts, overlap=overlap)
    elif kind == "graphed":   # its residual is a buffer its rounds update in place
        from thc.collective.graphed import GraphedAllReduce
        hook = THCHook(model, lambda group: GraphedAllReduce.through_torch_distributed(
            group, params=THCParams(slice_size=256), generator=rank, capture=False),
            opts, overlap=overlap)
    else:
        hook = TopKHook(model, options=opts, overlap=overlap) if kind == "topk" else \
            MarsitHook(model, opts, overlap=overlap, generator=gen)
    model.b.requires_grad_(not schedule.startswith("frozen"))
    if schedule == "missed":
        hook._uses._accumulated = _Forgetful()
    hook.register(ddp)
    names = ("b.weight", "c.weight")
    loaded = {n: torch.randn(model.get_parameter(n).numel(), generator=gen) * 1e-2
              for n in names} if schedule == "frozen-loaded" else {}
    if loaded:
        hook.load_state_dict({**hook.state_dict(), "residuals": loaded})
    model.b.requires_grad_(not loaded)
    applied = {n: torch.zeros_like(model.get_parameter(n)) for n in names}
    true = {n: torch.zeros_like(model.get_parameter(n)) for n in names}
    with ddp.join() if schedule == "join" else contextlib.nullcontext():
        for i, step in enumerate(SCHEDULES[schedule]):
            if step[0][1][rank] is None:
                break
            if loaded and i == 2:
                model.b.requires_grad_(True)
            if schedule != "stale":
                model.zero_grad(set_to_none=not view)   # a gradient that is the bucket's view
                plain.zero_grad()
            for alone, uses, backward in step:
                x = torch.randn(32, 16, generator=gen)
                with ddp.no_sync() if alone is True else contextlib.nullcontext():
                    out = ddp.module(x, uses[rank]) if alone == "module" else ddp(x, uses[rank])
                if backward:
                    with ddp.no_sync() if alone is True else contextlib.nullcontext():
                        out.backward()
                    plain(x, uses[rank]).backward()   # no step is taken: the same parameters
            for n in names:
                if (g := model.get_parameter(n).grad) is not None and schedule != "stale":
                    applied[n] += g
                if (g := plain.get_parameter(n).grad) is not None and schedule != "stale":
                    true[n] += g
    if schedule == "stale":   # the gradients summed over the steps
        applied = {n: model.get_parameter(n).grad for n in names}
        true = {n: plain.get_parameter(n).grad for n in names}
    residuals = hook.state_dict()["residuals"]
    # arrays, not tensors: a tensor travels by shared memory, which goes with the worker
    for n, r in loaded.items():   # what the saved residual adds to the sum
        true[n] += r.reshape(true[n].shape)
    q.put((rank, {n: (applied[n].numpy(), true[n].numpy(),
                      residuals[n].reshape(applied[n].shape).numpy()) for n in names}))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind, overlap, schedule, view", [
    ("thc", False, "mixed", False), ("topk", True, "mixed", False),
    ("marsit", False, "mixed", False), ("thc", False, "mixed", True),
    ("thc", True, "probe", False), ("topk", False, "join", False),
    ("marsit", True, "missed", False), ("thc", False, "stale", True),
    ("topk", True, "frozen", False), ("thc", False, "frozen-module", False),
    ("thc", False, "frozen-loaded", False), ("topk", True, "frozen-loaded", False),
    ("topk", False, "cut", False), ("thc", False, "static", False),
    ("thc", True, "fp32-bias", False), ("topk", False, "fp32-bias", False)])
def test_a_parameter_no_rank_used_keeps_its_residual(kind, overlap, schedule, view):
    """Under find_unused_parameters DDP leaves a parameter that no rank used as it was, the
    hook's mean of its residuals unapplied; the hook counted that mean as applied, so the
    residual lost its mass (b's sum off by 3 to 19% in one step). Where the gradient is the
    bucket's view, or a joined rank's shadow step marks b used, DDP applies what the bucket
    holds; a gradient of a no_sync micro-batch is in it too, and one left from an earlier
    step (no zero_grad) where it is the bucket's view. A parameter frozen while the hook was
    registered, unfrozen after, was never seen used: each rank got its own gradient back
    (also where its first gradient came from a backward outside DDP's forward); one frozen
    for steps after the hook took a saved residual counted as used, and the residual went
    into rounds whose estimate DDP never applied; behind a
    stop-gradient, its hooks fire with no gradient, which DDP does not count as a use. And
    where the hook's count of gradients misses one, the span's own test keeps the replicas
    alike (where it missed b's, each rank got its own gradient back). What error feedback
    keeps, in each: the mean applied plus the ranks' mean residual is the ranks' mean
    gradient, summed over the steps (rank 0's applied where rank 1 joined early). Under
    static_graph DDP leaves such a parameter alone too (the hook counted only
    find_unused_parameters); and where uncompressed parameters come first in a bucket, the
    hook read each compressed parameter's use off another's (b's off a bias)."""
    res = gloo_pair(functools.partial(_unused_worker, kind, overlap, schedule, view))
    for n in ("b.weight", "c.weight"):
        (applied, true0, res0), (applied1, true1, res1) = (
            [torch.from_numpy(t) for t in res[r][n]] for r in (0, 1))
        if schedule != "join":
            torch.testing.assert_close(applied, applied1, rtol=0, atol=0)
        kept = applied + (res0 + res1) / 2
        want = (true0 + true1) / 2
        scale = float(want.norm()) or 1.0   # b used by no rank: what is kept is nothing
        assert float((kept - want).norm()) / scale < 1e-5, n


@kernels
def test_a_parameter_no_rank_used_keeps_its_residual_in_a_graphed_round():
    """A graphed reducer updates its residual in place: the residual of a parameter no rank
    used, kept before its round without a copy, was the live one, and what it gave back was
    the round's (its mass lost, as in the eager hooks before). On the CPU its rounds run under
    Triton's interpreter (asked for when tests.test_codec_kernels is imported, before the
    workers' fork server starts)."""
    res = gloo_pair(functools.partial(_unused_worker, "graphed", False, "mixed", False))
    for n in ("b.weight", "c.weight"):
        (applied, true0, res0), (applied1, true1, res1) = (
            [torch.from_numpy(t) for t in res[r][n]] for r in (0, 1))
        torch.testing.assert_close(applied, applied1, rtol=0, atol=0)
        kept = applied + (res0 + res1) / 2
        want = (true0 + true1) / 2
        assert float((kept - want).norm() / want.norm()) < 1e-5, n


def _unused_first_worker(rank, port, q):
    """One step of ``_Heads`` under THC's hook in which no rank uses head ``b``: the
    residuals after it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    model = _Heads()
    ddp = DDP(model, find_unused_parameters=True)
    gen = torch.Generator().manual_seed(rank)
    hook = THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
        group, params=THCParams(slice_size=256), generator=gen), overlap=False).register(ddp)
    ddp(torch.randn(32, 16, generator=gen), False).backward()
    residuals = hook.state_dict()["residuals"]
    q.put((rank, {n: residuals[n].numpy() for n in ("b.weight", "c.weight")}))
    dist.destroy_process_group()


def test_a_parameter_no_rank_used_in_the_first_round_keeps_no_residual():
    """Before its first round a parameter has no residual to give back: one no rank used
    kept what the round left in its part of the new residual (the error of its zeros'
    estimate), mass no gradient had."""
    res = gloo_pair(_unused_first_worker)
    for rank in (0, 1):
        assert np.count_nonzero(res[rank]["c.weight"]) > 0, rank   # the round kept some
        assert np.count_nonzero(res[rank]["b.weight"]) == 0, (rank, res[rank]["b.weight"])


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


def _fp16_topk_worker(rank, port, q):
    from thc.collective.ddp import HookOptions, TopKHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    hook = TopKHook(torch.nn.Linear(2, 2), ratio=0.5, options=HookOptions(min_numel=1),
                    overlap=False)
    outs = [hook._reduce_bucket("k", torch.full((4,), 60000.0, dtype=torch.float16),
                                [(0, 4, False, 0.0)]).tolist() for _ in range(3)]
    kept = sum(float(r.double().sum()) for r in hook.scheme.residuals.values())
    q.put((rank, (outs, kept)))
    dist.destroy_process_group()


def test_a_compensated_half_mean_past_65504_is_held_to_float16s_range():
    """TopK sends half of four 60000s; the other half waits in the residual and goes out
    next step as 120000 on both workers, whose mean is past float16's largest. Copied into
    the float16 bucket bare, it came back Inf from finite gradients; held to the range, it
    is 65504, and what the hold cut off waits in the residuals as what is not sent does:
    applied and kept add up to the gradients, three steps of four 60000s."""
    res = gloo_pair(_fp16_topk_worker)
    for rank in (0, 1):
        (first, second, third), kept = res[rank]
        assert sorted(first) == [0.0, 0.0, 60000.0, 60000.0], res[rank]
        assert sorted(second) == [0.0, 0.0, 65504.0, 65504.0], res[rank]
        assert all(v <= 65504.0 for v in third), res[rank]
        assert sum(first + second + third) + kept == 3 * 4 * 60000.0, res[rank]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_what_a_half_buckets_rounding_moves_stays_in_topks_residual(alone, dtype):
    """A bfloat16 bucket took TopK's float32 mean rounded, and the rounding went nowhere:
    applied and kept fell short of the gradients (8.8e-3 in the review's five steps). Both
    half types now keep it, as float16's hold was kept."""
    from thc.collective.ddp import HookOptions, TopKHook
    hook = TopKHook(torch.nn.Linear(2, 2), ratio=0.5, options=HookOptions(min_numel=1),
                    overlap=False)
    gen = torch.Generator().manual_seed(3)
    total = applied = torch.zeros(64, dtype=torch.float64)
    for _ in range(5):
        x = torch.randn(64, generator=gen).to(dtype)
        total = total + x.double()
        applied = applied + hook._reduce_bucket("k", x.clone(), [(0, 64, False, 0.0)]).double()
    kept = hook.scheme.residuals[("k", 64)].double()
    assert float((applied + kept - total).abs().max()) < 1e-6


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


@pytest.mark.parametrize("kind", KINDS + ("spans",))
def test_gradient_accumulation_on_every_rank_stays_in_step(kind):
    """no_sync on every rank (the forwards jump alike): every synced step is reduced."""
    res = gloo_pair(functools.partial(_out_of_step_worker, kind=kind, alone=False))
    assert res[0] == res[1] == ["ok", "accumulated", "ok", "ok"], res


def _accumulating_worker(rank, port, q, kind):
    """Three DDP steps with ``kind``'s hook, each a micro-batch under ``no_sync`` and then a
    synced one, on every rank: each bucket reducer's round number after them."""
    model, ddp, hook = _hooked_with(rank, port, kind)
    for step in range(3):
        x, y = _data(rank * 10 + step)
        with ddp.no_sync():
            assert _outcome(ddp, x, y) == "ok"
        assert _outcome(ddp, x, y) == "ok"
        model.zero_grad(set_to_none=True)
    q.put((rank, sorted(ar.round for ar in hook.reducers.values())))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ("compressed", "marsit"))
def test_each_accumulated_stretch_moves_a_buckets_rounds_ahead_once(kind):
    """A bucket's reducer moved its rounds ahead by every stretch since the hook's start at
    each one (or at each of its rounds), not by the stretches since its last round: the
    ranks stayed alike, but the round numbers ran ahead quadratically, toward the end of
    their range, and a checkpoint's round was not the one its step should have."""
    from thc.collective.ddp_base import STRETCH_ROUNDS
    res = gloo_pair(functools.partial(_accumulating_worker, kind=kind))
    assert res[0] == res[1] and res[0], res
    # a round number is its calls plus the stretches when it last ran, times STRETCH_ROUNDS:
    # the first bucket's reducer ran step 0 (after one stretch); DDP rebuilt its bucket after
    # it, and the rebuilt one's reducer ran steps 1 and 2 (after two and three)
    assert res[0] == [1 + STRETCH_ROUNDS, 2 + 3 * STRETCH_ROUNDS], (res[0], STRETCH_ROUNDS)


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


class _Out:
    """A forward's output of a kind the stretch count cannot see into."""

    def __init__(self, t):
        self.t = t


class _Shaped(torch.nn.Module):
    """``_model()`` returning its logits as they are, inside an opaque object (``"opaque"``),
    or beside an auxiliary output no backward runs through (``"aux"``)."""

    def __init__(self, shape):
        super().__init__()
        self.net, self.shape = _model(), shape

    def forward(self, x):
        y = self.net(x)
        self.kept = self.net[0].weight.square().sum()   # a loss kept aside (a load balance)
        if self.shape == "opaque":
            return _Out(y)
        if self.shape == "aux":
            return y, self.net[0](x).sum()
        return y


def _logits(out):
    return out.t if isinstance(out, _Out) else out[0] if isinstance(out, tuple) else out


def _stretch_script_worker(rank, port, q, shape, script):
    """Three synced steps of a ``_Shaped(shape)`` model under TopK's hook; before step 1 each
    rank runs ``script[rank]``: "m" a micro-batch under ``no_sync`` (with its backward), "p"
    a probe forward under ``no_sync`` (no backward), "e" an evaluation under ``no_grad``
    outside ``no_sync``, "k" a forward under ``no_sync`` and the backward of the loss it kept
    aside (through no output), "u" a micro-batch of ``ddp.module`` under ``no_sync`` (no
    forward of the DDP model): each synced step's outcome on this rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import TopKHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    model = _Shaped(shape)
    ddp = DDP(model)
    TopKHook(model, overlap=False).register(ddp)
    out = []
    for step in range(3):
        x, y = _data(rank * 10 + step)
        for s in script[rank] if step == 1 else "":
            if s == "e":
                with torch.no_grad():
                    ddp(x)
                continue
            with ddp.no_sync():
                o = (ddp.module if s == "u" else ddp)(x)
                if s in "mu":
                    torch.nn.functional.cross_entropy(_logits(o), y).backward()
                if s == "k":
                    model.kept.backward()
        out.append(_outcome(ddp, x, y, logits=_logits))
        model.zero_grad(set_to_none=True)
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("shape,step", [("opaque", "m"), ("aux", "m"), ("plain", "k"),
                                        ("plain", "u")])
def test_a_step_accumulated_alone_is_refused_whatever_the_model_returns(shape, step):
    """A forward returning an object the count cannot see into (counted at the next gradient)
    or a tuple whose second output no backward runs through, a loss the forward kept aside,
    or a micro-batch of ``ddp.module`` (no DDP forward): without its stretch counted, rank
    0's micro-batch under no_sync alone summed with its next step beside rank 1's one,
    silently (85 times the mean's norm off, for a kept loss)."""
    res = gloo_pair(functools.partial(_stretch_script_worker, shape=shape, script=(step, "")))
    assert res[0][0] == res[1][0] == "ok", res
    for rank in (0, 1):
        assert all("no_sync alone" in text for text in res[rank][1:]), (rank, res[rank])


@pytest.mark.parametrize("shape,script", [
    ("plain", ("mm", "mmm")), ("opaque", ("mm", "mmm")), ("opaque", ("p", "")),
    ("plain", ("mem", "mm")), ("opaque", ("mem", "mm")), ("plain", ("k", "m")),
    ("plain", ("uu", "mk")), ("plain", ("mu", "u"))])
def test_stretches_alike_on_every_rank_are_reduced(shape, script):
    """Ranks with unlike numbers of micro-batches in one stretch (DDP sums them), a probe
    forward under no_sync with no backward on one rank (opaque outputs count at the next
    gradient, which is the synced step's), or an evaluation under no_grad inside a stretch
    on one rank: each was taken for a stretch more on one rank, and every synced step after
    it refused."""
    res = gloo_pair(functools.partial(_stretch_script_worker, shape=shape, script=script))
    assert res[0] == res[1] == ["ok"] * 3, res


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
