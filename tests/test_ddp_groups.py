"""DDP hooks and their process groups: the groups, factories, settings and steps every rank
must agree on, and a hook's life beside its model."""
from __future__ import annotations

import functools
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from thc.testing.clusters import free_port_block
from tests.ddp_common import (KINDS, WORLD, _Crossed, _data, _model, _one_backward,
                              _out_of_step_worker)
from tests.procs import gloo_pair


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


def test_hook_options_are_checked_when_made():
    """A bare string was read as its characters ("bias": every parameter whose name holds an
    "i", a "s", ... stayed FP32, compressing nothing), a name of another type failed inside
    DDP's backward, and a negative min_numel was taken."""
    from thc.collective.ddp import HookOptions
    assert HookOptions(uncompressed=["bias", "bn"]).uncompressed == ("bias", "bn")
    assert HookOptions(uncompressed={"bias"}, min_numel=1e6) == HookOptions(
        uncompressed=("bias",), min_numel=1_000_000)
    with pytest.raises(TypeError, match=r"got 'bias' \(one name: \('bias',\)\)"):
        HookOptions(uncompressed="bias")
    for bad in ((1,), ("bias", ""), None):
        with pytest.raises(TypeError, match="parameter-name substrings"):
            HookOptions(uncompressed=bad)
    for bad in (-5, 2.5, True):
        with pytest.raises(ValueError, match="min_numel takes a count"):
            HookOptions(min_numel=bad)


def test_a_parameter_of_exactly_min_numel_elements_is_compressed(alone):
    """min_numel keeps parameters of fewer elements than it uncompressed, as documented; one
    of exactly that many was kept too (a bound of 32 left a 32-element weight in FP32)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import HookOptions, TopKHook
    model = torch.nn.Linear(8, 4)   # weight: 32 elements, bias: 4
    ddp = DDP(model)
    hook = TopKHook(model, options=HookOptions(min_numel=32), overlap=False).register(ddp)
    ddp(torch.ones(2, 8)).sum().backward()
    assert hook.fp32_elements == 4, hook.fp32_elements
    assert set(hook.state_dict()["residuals"]) == {"weight"}


def test_a_comm_group_that_waits_longer_than_the_hooks_group_is_warned_of():
    """``dist.new_group(ranks)`` takes torch's default timeout (30 minutes), not the world's:
    a stalled rank then held the hook's collectives that long."""
    from thc.collective.ddp import FP32Hook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        model = torch.nn.Linear(2, 2)
        with pytest.warns(RuntimeWarning, match="comm_group waits 0:30:00 for a peer, the "
                                                "hook's group 0:00:30"):
            FP32Hook(model, comm_group=dist.new_group([0]))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            FP32Hook(model, comm_group=dist.new_group([0], timeout=timedelta(seconds=30)))
    finally:
        dist.destroy_process_group()


def _comm_group_of_other_ranks_worker(rank, port, q):
    from thc.collective.ddp import FP32Hook
    timeout = timedelta(seconds=20)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timeout)
    own = [dist.new_group([r], timeout=timeout) for r in (0, 1)][rank]
    try:
        FP32Hook(torch.nn.Linear(2, 2), group=own, comm_group=dist.group.WORLD)
        out = "built"
    except ValueError as e:
        out = str(e)
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_comm_group_of_another_size_than_the_hooks_group_is_refused():
    """A hook of one rank took the world's two as its collectives' group: its mean divided
    by one, and its collectives waited for a peer that was never the hook's worker."""
    res = gloo_pair(_comm_group_of_other_ranks_worker)
    for rank in (0, 1):
        assert "comm_group holds 2 ranks, the hook's group 1" in res[rank], res


def _unlike_options_hook(model, rank):
    from thc.collective.ddp import FP32Hook, HookOptions
    opts = HookOptions(uncompressed=("bias",) if rank == 0 else ())
    return FP32Hook(model, options=opts, overlap=False)


def _unlike_unused_worker(rank, port, q):
    """One backward of a Linear(8, 4) under DDP with a TopK hook of its own group; rank 0's
    DDP finds unused parameters, rank 1's does not: what it raised, or "returned"."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import TopKHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ddp = DDP(model, find_unused_parameters=rank == 0)
    TopKHook(model, ratio=0.5).register(ddp)
    try:
        ddp(torch.ones(3, 8)).sum().backward()
        out = "returned"
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        out = str(e)
    q.put((rank, out))
    time.sleep(1)
    dist.destroy_process_group()


def test_ranks_unlike_in_finding_unused_parameters_refuse_the_bucket():
    """A rank whose DDP finds unused parameters sums a lane per compressed parameter after
    its FP32 spans, its peer none: the spans' all-reduces were of unlike lengths (Gloo
    aborts) unless the bucket's check counted the setting."""
    res = gloo_pair(_unlike_unused_worker)
    for rank in (0, 1):
        assert "whether DDP finds unused parameters" in res[rank], res


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
    each rank (both ranks' gradients wrong, swapped), as did an overlapping hook and one that
    did not (a THC sum paired with an FP32 span of as many bytes: accepted on every rank,
    unlike); the group a hook made waited torch's
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
        shared = dist.new_group(timeout=timedelta(seconds=7))
        model = torch.nn.Linear(2, 2)
        first = FP32Hook(model, comm_group=shared)
        with pytest.raises(ValueError, match="carries another hook's collectives"):
            FP32Hook(model, comm_group=shared)
        for given in ({"comm_group": shared}, {"group": shared}):
            with pytest.raises(ValueError, match="overlaps backward, from a thread of its own"):
                FP32Hook(model, overlap=False, **given)
        other = dist.new_group(timeout=timedelta(seconds=7))
        kept = [FP32Hook(model, comm_group=other, overlap=False) for _ in range(2)]
        assert [h.group for h in kept] == [other, other]
        with pytest.raises(ValueError, match="carries another hook's collectives"):
            FP32Hook(model, comm_group=other)
        assert group_timeout(FP32Hook(model).group) == timedelta(seconds=7)
        DistTransport(first.group).abandon("round 3 failed between its MAX round and its sums")
        with pytest.raises(RuntimeError, match="no THC round may use this process group"):
            agreement.together(first.group, 0, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


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


def _crossed_hooks_worker(rank, port, q):
    """Two models of one architecture, initialized apart (twin critics), each wrapped by DDP
    in one order everywhere; their overlapping hooks built in the other order on rank 1 (as
    iterating a set of modules may): what one backward through both raises."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    models = [torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)]
    ddps = [DDP(m) for m in models]
    pairs = list(zip(models, ddps))
    for m, d in (pairs[::-1] if rank == 1 else pairs):
        THCHook(m, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(slice_size=256), generator=rank)).register(d)
    x, _ = _data(rank)
    try:
        (ddps[0](x).pow(2).sum() + 100 * ddps[1](x).pow(2).sum()).backward()
        out = "returned"
    except RuntimeError as e:
        out = str(e)
    q.put((rank, out))
    dist.destroy_process_group()


def test_twin_models_hooks_built_in_another_order_on_a_rank_are_refused():
    """Each overlapping hook makes its own group and takes its index in the order hooks are
    built. Built in another order on rank 1, the twins' hooks took each other's groups and
    places, and every check compared alike: rank 0's first model's gradients were averaged
    with rank 1's second's (relative error 0.65), with no error. Each bucket's check now
    names the model the hook serves, values included."""
    res = gloo_pair(_crossed_hooks_worker)
    for rank in (0, 1):
        assert "the model it serves" in res[rank], res


def _late_sync_worker(rank, port, q):
    """A model wrapped with ``init_sync=False``, each rank's own initial values, made alike
    after the hook is registered (rank 0's broadcast): what one backward raises."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    torch.manual_seed(rank)
    model = torch.nn.Linear(64, 64)
    ddp = DDP(model, init_sync=False)
    THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
        group, params=THCParams(slice_size=256), generator=rank)).register(ddp)
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, 0)
    x, _ = _data(rank)
    try:
        ddp(x).pow(2).sum().backward()
        out = "returned"
    except RuntimeError as e:
        out = str(e)
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_model_made_alike_after_its_hook_is_registered_trains():
    """DDP's init_sync=False leaves the replicas to their user: read at register(), the
    model's values differed from rank to rank and its first bucket was refused."""
    res = gloo_pair(_late_sync_worker)
    assert res == {0: "returned", 1: "returned"}, res


def test_hooks_of_a_model_and_its_copy_are_warned_of(alone):
    """A copy of a model (a target network) has its names, shapes and values: nothing tells
    the two hooks apart if some rank builds them in another order, so a second hook serving
    a model alike is warned of; a model initialized apart is not."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    torch.manual_seed(0)
    first = torch.nn.Linear(64, 64)
    for other, warned in ((torch.nn.Linear(64, 64), False), (copy.deepcopy(first), True)):
        pair = [(m, DDP(m)) for m in (first, other)]
        hooks = [THCHook(m, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(slice_size=256))).register(d) for m, d in pair]
        x, _ = _data(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _, d in pair:
                d(x).pow(2).sum().backward()
        said = [w for w in caught if "nothing tells their hooks apart" in str(w.message)]
        assert len(said) == warned, [str(w.message) for w in caught]
        del hooks, pair


def test_a_conjugate_or_negated_view_parameter_has_a_model_key():
    """A model's key read its parameters' bytes through a view that torch refuses for a
    lazily conjugated or negated tensor, which DDP takes as a parameter."""
    from thc.collective.agreement import model_key
    torch.manual_seed(0)
    values = torch.randn(64, dtype=torch.complex64)
    lazy, plain = torch.nn.Module(), torch.nn.Module()
    lazy.c, plain.c = torch.nn.Parameter(values.conj()), torch.nn.Parameter(values.conj_physical())
    lazy.n = torch.nn.Parameter(torch.ones(8)._neg_view())
    plain.n = torch.nn.Parameter(-torch.ones(8))
    assert lazy.c.is_conj() and lazy.n.is_neg()
    assert model_key(lazy) == model_key(plain)


def test_two_fp32_hooks_on_one_group_never_pair_each_others_first_buckets():
    """A bucket's check named the hook's kind and spans, not which hook: two models of one
    layout whose backwards ran in another order on rank 1 paired A's gradient with B's, a
    mean taken on every rank. (FP32Hook checks a bucket's first reduction only, as DDP's own
    all-reduce checks none.)"""
    res = gloo_pair(functools.partial(_two_hooks_worker, kind="fp32", swap_at=0))
    for rank in (0, 1):
        out, _ = res[rank]
        assert "which of the hooks built on the group it is" in out[0], res


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


class _NoSkip:
    """A THC reducer behind a wrapper that forwards its rounds, not its ``skip_to``."""

    def __init__(self, inner):
        self.inner, self.transport = inner, inner.transport

    def __call__(self, flat, position=None):
        return self.inner(flat, position=position)


def test_a_factory_whose_reducer_cannot_skip_rounds_is_refused_when_built(alone):
    """A reducer without skip_to was taken: its first rounds went well, and the first
    backward after a no_sync stretch failed inside the hook, mid-training (an
    AttributeError), where it could have been refused before any round."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    model = _model()
    ddp = DDP(model)
    THCHook(model, lambda group: _NoSkip(THCAllReduce.through_torch_distributed(
        group, params=THCParams(slice_size=256))), overlap=False).register(ddp)
    x, y = _data(0)
    with pytest.raises(RuntimeError, match=r"has no skip_to\(round\)"):
        torch.nn.functional.cross_entropy(ddp(x), y).backward()


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
    first, second = dist.new_group([0, 1]), dist.new_group([0, 1])

    def reducer(group):
        return THCAllReduce.through_torch_distributed(group, params=params)
    cases = {"overlap": lambda m: THCHook(m, reducer, overlap=rank == 0),
             "comm_group": lambda m: THCHook(m, reducer, group=both,
                                             comm_group=mine if rank == 0 else None),
             "which_comm_group": lambda m: THCHook(m, reducer, group=both,
                                                   comm_group=first if rank == 0 else second),
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
    given would agree its run there, from the hook's thread, beside backward's collectives.
    Ranks that passed different groups as comm_group waited in their first bucket until the
    group's timeout."""
    res = gloo_pair(functools.partial(_unlike_settings_worker, free_port_block(3)))
    refused = "failed before this round's collectives"
    alike = "overlap, comm_group (which group) or nonfinite"
    expected = {"overlap": (alike,) * 2,
                "comm_group": (refused, "overlaps backward runs its collectives on a group"),
                "which_comm_group": (alike,) * 2,
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
    for rewrapped in (False, True):
        hand = _model()
        hook = FP32Hook(hand, overlap=False)
        if rewrapped:   # registered on one DDP model, then installed on another
            hook.register(DDP(hand))
        by_hand = DDP(hand, process_group=alone[rank])
        by_hand.register_comm_hook(None, hook.hook)
        try:
            by_hand(_data(rank)[0]).sum().backward()
            out.append(f"reduced {hand[0].bias.grad[:2].tolist()}")
        except (ValueError, RuntimeError) as e:
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
    what its options keep FP32 (they name that model's parameters). The same replicas with
    the hook installed by hand (``register_comm_hook(None, hook.hook)``), or by hand on
    another DDP model after its registration, were averaged too: a hand install is refused
    at its first bucket. A sparse gradient failed deep in torch (as_strided on SparseCPU);
    every rank now names it."""
    res = gloo_pair(_misfit_worker)
    for rank in range(WORLD):
        group, shared, model, hand, rewrapped, sparse = res[rank]
        assert f"process group holds ranks [{rank}], the hook's workers [0, 1]" in group, group
        assert "process group is the hook's own" in shared, shared
        assert "built for another model" in model, model
        for text in (hand, rewrapped):
            assert "installed by hand" in text, text
        assert "sparse gradient" in sparse, sparse


@pytest.mark.parametrize("kind", KINDS + ("spans", "compressed"))
def test_a_rank_a_whole_step_out_of_step_is_refused_by_every_rank(kind):
    """Each reducer counted its own rounds: rank 0 running step 1 under no_sync alone kept
    every reducer in step with its peer's while pairing rank 0's steps 1+2 with rank 1's
    step 1, and every later step with the step before, each taken as a sum. Rounds now also
    count the DDP model's no_sync stretches (``BaseHook._stretches.count``): every later step is
    refused on both ranks, naming the cause. So do the tag lanes of a hook's FP32 spans,
    where every span is one (they held the step and bucket alone, and took those sums).
    Where every parameter is compressed ("compressed") no span's tags stand in: THC's own
    rounds must count the stretches (the hook did not move them ahead, and took the sums)."""
    res = gloo_pair(functools.partial(_out_of_step_worker, kind=kind, alone=True))
    assert res[0][:2] == ["ok", "accumulated"], res
    assert res[1][:1] == ["ok"], res
    for rank, steps in ((0, res[0][2:4]), (1, res[1][1:3])):
        for text in steps:
            assert "no_sync alone" in text, (rank, text)


@pytest.mark.parametrize("overlaps", [(True, True), (False, True), (True, False),
                                      (False, False)])
def test_hooks_sharing_an_aggregator_client_may_not_overlap(overlaps):
    """Two hooks whose reducers share a client, one of them on a thread of its own: their
    rounds met in unlike orders on each rank, refused (each reducer now holds the client for
    its whole round) or, before that, summed with each other. The second hook's build is
    refused on every rank, naming the way out; two hooks that do not overlap share it."""
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


def test_an_uncompressed_name_in_no_parameters_name_is_refused():
    """A typo ("bais") left every gradient compressed, unsaid (``--uncompressed nosuch``
    trained and exited 0)."""
    from thc.collective.ddp import FP32Hook, HookOptions
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    HookOptions(uncompressed=("bias", "0.")).check_names(model)
    with pytest.raises(ValueError, match=r"uncompressed \['bais'\] is in no parameter's name "
                                         r"\(the model's: 0.weight, 0.bias\)"):
        HookOptions(uncompressed=("bias", "bais")).check_names(model)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="'bais'"):
            FP32Hook(model, HookOptions(uncompressed=("bais",)), overlap=False)
    finally:
        dist.destroy_process_group()
