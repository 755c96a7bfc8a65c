"""A reducer's and a DDP hook's state saved and loaded (thc.collective.checkpoint): a reducer
restored goes on bit for bit as the one saved; a hook restored gives each parameter its
residual again, whatever buckets hold it. Without them the residuals' mass is lost."""
from __future__ import annotations

import copy
import enum
import io

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.test_codec_kernels import DEV, kernels
from thc.codec.thc import THCParams
from thc.collective import checkpoint
from thc.collective.allreduce import THCAllReduce
from thc.collective.ddp import HookOptions, MarsitHook, THCHook, TopKHook
from thc.collective.graphed import GraphedAllReduce
from thc.collective.marsit import MarsitAllReduce

P = THCParams(slice_size=256)


def _hook_state(kind: str, residuals: dict, steps: int = 0) -> dict:
    """A hook's state as a rank alone in its group saves it."""
    return {"hook": kind, "owner": checkpoint.owner(0, 1, (0,)), "steps": steps,
            "residuals": residuals}


def _saved(state: dict) -> dict:
    """``state`` through torch.save and torch.load, as a checkpoint carries it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


def _inputs(rounds: int, n: int = 3 * 256 + 200, device="cpu"):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(n, generator=gen).to(device) for _ in range(rounds)]


def _resumed(make, device="cpu") -> tuple[list, list, list]:
    """Three rounds of a reducer, then two more; and the same two from a reducer built anew,
    with the first one's saved state and without it."""
    xs = _inputs(5, device=device)
    first = make()
    for x in xs[:3]:
        first(x)
    state = _saved(first.state_dict())
    went_on = [first(x) for x in xs[3:]]
    restored = make()
    restored.load_state_dict(state)
    fresh = make()
    return went_on, [restored(x) for x in xs[3:]], [fresh(x) for x in xs[3:]]


@pytest.mark.parametrize("make", [
    lambda: THCAllReduce.through_torch_distributed(params=P, generator=11),
    lambda: MarsitAllReduce(None, torch.Generator().manual_seed(3)),
], ids=["thc", "marsit"])
def test_a_reducer_restored_goes_on_as_the_one_saved(alone, make):
    went_on, restored, fresh = _resumed(make)
    for a, b in zip(went_on, restored):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, c) for a, c in zip(went_on, fresh))


@kernels
def test_a_graphed_reducer_restored_goes_on_as_the_one_saved(alone):
    """Its residual is loaded into the rounds' buffer when the first call makes it."""
    went_on, restored, fresh = _resumed(
        lambda: GraphedAllReduce.through_torch_distributed(params=P, generator=11,
                                                          capture=False), DEV)
    for a, b in zip(went_on, restored):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, c) for a, c in zip(went_on, fresh))
    short = GraphedAllReduce.through_torch_distributed(params=P, generator=11, capture=False)
    short.load_state_dict(checkpoint.state(3, torch.zeros(5), short.state_owner))
    with pytest.raises(ValueError, match="loaded residual holds 5 elements, this tensor 968"):
        short(_inputs(1, device=DEV)[0])


@kernels
def test_a_graphed_state_is_taken_for_a_tensor_of_its_own_length_alone(alone):
    """A graphed reducer keeps its residual padded (1124 elements in slices of 1024: 1280).
    Its state, loaded for a tensor of 1280 elements or of 1100, was taken: the other tensor's
    residual (and its padding's) added to this one's coordinates. The state names its
    tensor's length, and only that length takes it."""
    params = THCParams(slice_size=1024)

    def make():
        return GraphedAllReduce.through_torch_distributed(params=params, generator=3,
                                                          capture=False, name="g")
    first = make()
    first(torch.randn(1124, generator=torch.Generator().manual_seed(1), device=DEV))
    state = _saved(first.state_dict())
    assert state["elements"] == 1124 and state["residual"].numel() == 1280
    for m in (1100, 1280):
        other = make()
        other.load_state_dict(state)
        with pytest.raises(ValueError, match=f"of a tensor of 1124 elements \\(1280 kept\\), "
                                             f"this tensor {m}"):
            other(torch.zeros(m, device=DEV))
    again = make()
    again.load_state_dict(state)
    assert again.state_dict()["elements"] == 1124
    assert torch.isfinite(again(torch.zeros(1124, device=DEV))).all()
    for bad in (1281, -1, 3.0, True):
        with pytest.raises(ValueError, match="the state's elements"):
            make().load_state_dict({**state, "elements": bad})
    # a state that does not name its tensor's length (saved before states named it) is
    # taken by its own tensor, whose residual it holds padded
    unnamed = make()
    unnamed.load_state_dict({k: v for k, v in state.items() if k != "elements"})
    assert torch.isfinite(unnamed(torch.zeros(1124, device=DEV))).all()
    # an eager reducer takes it without the padding, for the tensor of its length alone
    eager = THCAllReduce.through_torch_distributed(params=params, name="g")
    eager.load_state_dict(state)
    assert eager.kept_residual.numel() == 1124
    with pytest.raises(ValueError, match="error feedback holds 1124 elements"):
        eager(torch.zeros(1280))


def test_a_state_that_cannot_be_taken_is_refused(alone):
    ar = THCAllReduce.through_torch_distributed(params=P, generator=11)
    for bad, message in (({"round": -1, "residual": None}, "round must be a non-negative int"),
                         ({"round": True, "residual": None}, "round must be a non-negative int"),
                         ({"round": 2.0, "residual": None}, "round must be a non-negative int"),
                         ({"round": 2}, "not a reducer's state"),
                         ({"round": 2, "residual": torch.zeros(3, 3)}, "1-D floating-point"),
                         ({"round": 2, "residual": [0.0]}, "1-D floating-point"),
                         ({"round": 2, "residual": torch.tensor([0.0, float("inf")])},
                          "holds NaN or Inf"),
                         ({"round": 2, "residual": torch.tensor([float("nan")])},
                          "holds NaN or Inf"),
                         ({"round": 2, "residual": torch.tensor([1.0, 1e300],
                                                                dtype=torch.float64)},
                          "holds NaN or Inf, as float32")):
        with pytest.raises(ValueError, match=message):
            ar.load_state_dict({**bad, "owner": ar.state_owner} if "round" in bad else bad)
    plain = THCAllReduce.through_torch_distributed(params=P, error_feedback=False)
    with pytest.raises(ValueError, match="keeps none"):
        plain.load_state_dict(checkpoint.state(2, torch.zeros(4), plain.state_owner))
    ar(_inputs(1)[0])
    with pytest.raises(ValueError, match="before the first round"):
        ar.load_state_dict(checkpoint.state(0, None, ar.state_owner))


def _others_state_worker(rank, port, q):
    """Each rank saves a reducer's and a hook's state, then every rank loads rank 0's (the
    habit of saving on rank 0 alone)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    alone = [dist.new_group([0]), dist.new_group([1])][rank]   # groups of one, alike in size
    ar = THCAllReduce.through_torch_distributed(params=P, generator=rank)
    own = THCAllReduce.through_torch_distributed(alone, params=P, generator=rank)
    for x in _inputs(2):
        ar(x * (rank + 1))
        own(x * (rank + 1))
    model = _model()
    hook = HOOKS["thc"](model).register(DDP(model))
    saved = [{"reducer": ar.state_dict(), "hook": hook.state_dict(), "own": own.state_dict()}]
    dist.broadcast_object_list(saved, src=0)
    out = []
    for kind, fresh in (("reducer", THCAllReduce.through_torch_distributed(params=P)),
                        ("hook", HOOKS["thc"](_model())),
                        ("own", THCAllReduce.through_torch_distributed(alone, params=P))):
        try:
            fresh.load_state_dict(saved[0][kind])
            out.append("loaded")
        except ValueError as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_state_is_loaded_only_by_the_rank_that_saved_it():
    """Another rank's residual, loaded, is added to this rank's gradients from then on: every
    rank sums the same wrong mean (rank 0's error counted twice, rank 1's lost), with no
    error. Refused where it is loaded, a group of one of another rank's too; rank 0's own
    state is taken."""
    from tests.procs import gloo_pair
    res = gloo_pair(_others_state_worker)
    assert res[0] == ["loaded"] * 3, res
    for message in res[1][:2]:
        assert "saved by rank 0 of 2 in group (0, 1)" in message, res
        assert "this is rank 1 of 2 in group (0, 1)" in message, res
    assert "saved by rank 0 of 1 in group (0,), and this is rank 0 of 1 in group (1,)" \
        in res[1][2], res


def _unlike_rounds_worker(rank, port, q):
    """Both ranks save a named reducer's state after rounds 2 and 3; rank 0 loads the later,
    rank 1 the earlier, into a reducer built anew, and calls it."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ar = THCAllReduce.through_torch_distributed(params=P, name="enc")
    states = []
    for x in _inputs(3):
        ar(x)
        states.append(ar.state_dict())
    again = THCAllReduce.through_torch_distributed(params=P, name="enc")
    again.load_state_dict(states[2 - rank])
    try:
        again(_inputs(1)[0])
        out = "summed"
    except RuntimeError as e:
        out = str(e)
    q.put((rank, out))
    dist.destroy_process_group()


def test_states_of_unlike_rounds_are_refused_naming_the_load():
    """Ranks that load states saved at different rounds are in different rounds: every rank
    refuses, and the refusal named a missed round alone."""
    from tests.procs import gloo_pair
    res = gloo_pair(_unlike_rounds_worker)
    for rank in (0, 1):
        assert "different rounds" in res[rank], res
        assert "loaded a state saved at another round" in res[rank], res


def _resumed_worker(rank, port, q, kind, loads, counted=True):
    """Three steps and a save on each rank, then a model and hook built anew on each, rank
    ``r`` loading its own state where ``loads[r]`` (without its count of steps where not
    ``counted``), and a step."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, 40, generator=gen) for _ in range(4)]
    model = _model()
    ddp = DDP(model)
    hook = HOOKS[kind](model).register(ddp)
    _steps(ddp, model, xs[:3])
    state = _saved(hook.state_dict())
    if not counted:
        del state["steps"]
    again = _model()
    ddp_again = DDP(again)
    hook_again = HOOKS[kind](again)
    if loads[rank]:
        hook_again.load_state_dict(state)
    hook_again.register(ddp_again)
    try:
        _steps(ddp_again, again, xs[3:])
        out = ("stepped", state.get("steps"))
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        out = ("refused", str(e))
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["thc", "topk"])
def test_a_hook_resumed_on_one_rank_alone_is_refused_on_every_rank(kind):
    """Rank 0 loads its saved residuals and rank 1 starts afresh: rank 0 adds three steps'
    rounding error that rank 1's sum lacks, with no error. The first step refuses it on both
    ranks, naming the loaded state; both resumed (or neither) step on."""
    import functools

    from tests.procs import gloo_pair
    for loads in ((True, False), (False, True)):
        res = gloo_pair(functools.partial(_resumed_worker, kind=kind, loads=loads))
        for rank in (0, 1):
            assert res[rank][0] == "refused", (loads, res)
            assert "the backward passes behind the state the hook was loaded from" \
                in res[rank][1], (loads, res)
    res = gloo_pair(functools.partial(_resumed_worker, kind=kind, loads=(True, True)))
    assert res == {0: ("stepped", 3), 1: ("stepped", 3)}, res
    # a state that counts no steps loads, and is still told apart from a fresh start
    res = gloo_pair(functools.partial(_resumed_worker, kind=kind, loads=(True, False),
                                      counted=False))
    assert res[0][0] == res[1][0] == "refused", res


def test_a_hooks_state_names_the_steps_behind_it(alone):
    """A state saved after steps counts them, a state resumed counts on from its own, and a
    count of another form is refused."""
    model = _model()
    ddp = DDP(model)
    hook = HOOKS["thc"](model).register(ddp)
    _steps(ddp, model, [torch.ones(2, 40)] * 2)
    assert hook.state_dict()["steps"] == 2
    again = _model()
    ddp_again = DDP(again)
    resumed = HOOKS["thc"](again)
    resumed.load_state_dict(_saved(hook.state_dict()))
    resumed.register(ddp_again)
    _steps(ddp_again, again, [torch.ones(2, 40)])
    assert resumed.state_dict()["steps"] == 3
    for steps in (-1, 1.0, True, "2"):
        with pytest.raises(ValueError, match="names the backward passes behind it"):
            HOOKS["thc"](_model()).load_state_dict(_hook_state("THCHook", {}, steps))
    # a state that counts none (saved before states counted them) loads, and its count stays
    # unknown: a rank that took it still differs from one that started afresh
    counted_none = _hook_state("THCHook", {})
    del counted_none["steps"]
    for state in (counted_none, _hook_state("THCHook", {}, None)):
        unknown = HOOKS["thc"](_model())
        unknown.load_state_dict(state)
        assert unknown.state_dict()["steps"] is None


def test_a_named_reducers_state_is_refused_by_another(alone):
    """Two reducers' states swapped (of like lengths): each residual would be added to the
    other's tensor. Reducers named only by their build order are not told apart (their build
    order is that of the process, not of the run)."""
    a = THCAllReduce.through_torch_distributed(params=P, generator=11, name="encoder")
    a(_inputs(1)[0])
    b = THCAllReduce.through_torch_distributed(params=P, generator=11, name="decoder")
    with pytest.raises(ValueError, match="group \\(0,\\) \\(reducer 'encoder'\\), and this is "
                                         "rank 0 of 1 in group \\(0,\\) \\(reducer 'decoder'\\)"):
        b.load_state_dict(a.state_dict())
    again = THCAllReduce.through_torch_distributed(params=P, generator=11, name="encoder")
    again.load_state_dict(_saved(a.state_dict()))
    with pytest.raises(ValueError, match="names no owner"):
        THCAllReduce.through_torch_distributed(params=P).load_state_dict(
            {"round": 1, "residual": None})


class _Part(enum.Enum):
    ENCODER = 1


def test_an_owner_is_saved_as_torch_load_takes_it_and_checked_for_its_form(alone):
    """A name that is no plain value (an enum member) made the state unloadable by torch.load's
    defaults (weights only); an owner of another form raised a TypeError or an array's
    truth-value error, not the refusal."""
    ar = THCAllReduce.through_torch_distributed(params=P, generator=11, name=_Part.ENCODER)
    ar(_inputs(1)[0])
    again = THCAllReduce.through_torch_distributed(params=P, generator=11, name=_Part.ENCODER)
    again.load_state_dict(_saved(ar.state_dict()))
    good = ar.state_dict()
    for owner in ("rank 0", {**good["owner"], "rank": torch.zeros(2)},
                  {**good["owner"], "group": np.zeros(2)}, {**good["owner"], "extra": 1},
                  {k: v for k, v in good["owner"].items() if k != "group"}):
        fresh = THCAllReduce.through_torch_distributed(params=P, generator=11,
                                                       name=_Part.ENCODER)
        with pytest.raises(ValueError, match="names no owner"):
            fresh.load_state_dict({**good, "owner": owner})


def test_a_hooks_state_is_saved_after_its_group_is_gone():
    """A checkpoint written after ``destroy_process_group`` (the end of a run)."""
    import torch.distributed as dist

    from thc.testing.clusters import free_tcp_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    model = _model()
    ddp = DDP(model)
    hook = HOOKS["thc"](model).register(ddp)
    _steps(ddp, model, [torch.ones(2, 40)])
    dist.destroy_process_group()
    state = hook.state_dict()
    assert state["owner"] == checkpoint.owner(0, 1, (0,)) and state["residuals"]


def test_a_refused_marsit_state_leaves_the_reducer_as_it_was(alone):
    """A state whose coins or merge coins are refused took its round and residual first (merge
    coins of the wrong length, too, failing every round after): the reducer, half loaded,
    then refused its own good state."""
    first = MarsitAllReduce(None, None)
    first(_inputs(1)[0])
    good = first.state_dict()
    for bad in ({**good, "merges": ("tpu", b"x")},
                {**good, "merges": ("cpu", torch.zeros(3, dtype=torch.uint8))},
                {**good, "coin": torch.zeros(3, dtype=torch.uint8)}):
        ar = MarsitAllReduce(None, None)
        with pytest.raises(ValueError):
            ar.load_state_dict(bad)
        assert ar.round == 0 and ar.residual is None
        ar.load_state_dict(good)
        assert ar.round == good["round"] and torch.equal(ar.residual, good["residual"])


def test_a_buckets_residual_takes_zeros_for_a_parameter_of_another_length():
    """A residual of another length (another model's parameter of that name) would shift
    every later parameter's residual onto its neighbour's coordinates."""
    joined = checkpoint.joined({"a": torch.ones(3), "b": torch.full((2,), 2.0)},
                               [("a", 5), ("b", 2), ("c", 1)], "cpu")
    assert torch.equal(joined, torch.tensor([0.0, 0, 0, 0, 0, 2, 2, 0]))
    assert checkpoint.joined({"x": torch.ones(3)}, [("a", 5)], "cpu") is None


@pytest.mark.parametrize("kind", ["thc", "marsit", pytest.param("graphed", marks=kernels)])
def test_a_residual_past_what_a_round_keeps_is_refused(alone, kind):
    """Finite, yet past the codec's slice-norm limit (THC) or the clamp (Marsit): every
    later round would be refused, or NaN under "propagate", blamed on the input. A residual
    just inside is taken."""
    make = {"thc": lambda: THCAllReduce.through_torch_distributed(params=P, generator=11),
            "marsit": lambda: MarsitAllReduce(None, torch.Generator().manual_seed(3)),
            "graphed": lambda: GraphedAllReduce.through_torch_distributed(
                params=P, generator=11, capture=False)}[kind]
    from thc.codec.common import norm_limit
    from thc.collective.marsit import RESIDUAL_LIMIT
    top = norm_limit(P) / 16 if kind != "marsit" else RESIDUAL_LIMIT   # 16 = sqrt(256)
    inside = torch.zeros(1000)
    inside[:256] = top * 0.99
    took = make()
    took.load_state_dict(checkpoint.state(0, inside, took.state_owner))
    past = torch.zeros(1000)
    past[256:512] = top * 1.01 if kind != "marsit" else top * 1.5
    refuses = make()
    with pytest.raises(ValueError, match="past the"):
        refuses.load_state_dict(checkpoint.state(0, past, refuses.state_owner))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(),
                               torch.nn.Linear(300, 10))


HOOKS = {
    "thc": lambda m: THCHook(m, lambda group: THCAllReduce.through_torch_distributed(
        group, params=P, generator=11), overlap=False),
    "topk": lambda m: TopKHook(m, ratio=0.05, overlap=False),
    "marsit": lambda m: MarsitHook(m, generator=torch.Generator().manual_seed(3),
                                   overlap=False),
}


def _steps(ddp, model, xs) -> list[dict[str, torch.Tensor]]:
    grads = []
    for x in xs:
        model.zero_grad()
        ddp(x).pow(2).mean().backward()
        grads.append({n: p.grad.clone().reshape(-1) for n, p in model.named_parameters()})
    return grads


def _gap(kind: str, load: bool) -> float:
    """Four steps, a checkpoint, then the model and hook built anew from it (in one bucket
    where the saved run had several) for three steps, across DDP's rebuild of its buckets
    after the first. One worker's estimates with error feedback keep every coordinate's mass:
    the estimates' sum plus the last residual, less the first, is the gradients' sum. The
    largest difference from that, over the parameters, relative to the gradients' sum."""
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 40, generator=gen) for _ in range(7)]
    model = _model()
    ddp = DDP(model, bucket_cap_mb=40 * 300 * 4 / 2 ** 20)
    hook = HOOKS[kind](model).register(ddp)
    _steps(ddp, model, xs[:4])
    saved = _saved({"model": model.state_dict(), "hook": hook.state_dict()})
    first = saved["hook"]["residuals"]
    assert set(first) == {n for n, _ in model.named_parameters()}
    again = _model()
    again.load_state_dict(saved["model"])
    reference = copy.deepcopy(again)
    plain = _steps(reference, reference, xs[4:])
    hook_again = HOOKS[kind](again)
    if load:
        hook_again.load_state_dict(saved["hook"])
    ddp_again = DDP(again)
    hook_again.register(ddp_again)
    got = _steps(ddp_again, again, xs[4:])
    last = hook_again.state_dict()["residuals"]
    worst = 0.0
    for name, _ in again.named_parameters():
        kept = sum(g[name] for g in got) + last[name] - first[name]
        want = sum(g[name] for g in plain)
        worst = max(worst, float((kept - want).abs().max() / want.abs().max()))
    return worst


@pytest.mark.parametrize("kind", sorted(HOOKS))
def test_a_hook_restored_from_a_checkpoint_keeps_every_residual_on_its_parameter(alone, kind):
    """Restored, each parameter's residual joins its own coordinates, whatever bucket holds
    them (the saved run's buckets, DDP's first-iteration ones, its rebuilt ones); without the
    restore the mass the residuals held is lost."""
    assert _gap(kind, load=True) < 1e-5
    assert _gap(kind, load=False) > 1e-3


def test_a_hooks_state_is_loaded_before_its_first_step_and_into_its_own_kind(alone):
    model = _model()
    ddp = DDP(model)
    hook = HOOKS["thc"](model).register(ddp)
    with pytest.raises(ValueError, match="not a THCHook's state"):
        hook.load_state_dict(HOOKS["topk"](model).state_dict())
    with pytest.raises(ValueError, match="residual per parameter name"):
        HOOKS["topk"](model).load_state_dict(_hook_state("TopKHook", {"0.weight": 1}))
    with pytest.raises(ValueError, match="residual of 0.bias: the state's residual holds NaN"):
        HOOKS["topk"](model).load_state_dict(_hook_state("TopKHook", {
            "0.weight": torch.zeros(40 * 300), "0.bias": torch.full((300,), float("nan"))}))
    # finite as float64, Inf as the float32 it is taken in
    with pytest.raises(ValueError, match="residual of 2.bias: the state's residual holds NaN"):
        HOOKS["topk"](model).load_state_dict(_hook_state("TopKHook", {
            "2.bias": torch.full((10,), 1e300, dtype=torch.float64)}))
    # a residual no parameter of the model would take, or of another length, was kept
    # unapplied (and saved again), or replaced by zeros
    wrapped = _hook_state("TopKHook", {"module.0.bias": torch.zeros(300)})
    with pytest.raises(ValueError, match="residual of 'module.0.bias', but the hook "
                                         "compresses no parameter of that name"):
        HOOKS["topk"](model).load_state_dict(wrapped)
    in_fp32 = TopKHook(model, options=HookOptions(uncompressed=("bias",)), overlap=False)
    with pytest.raises(ValueError, match="compresses no parameter of that name"):
        in_fp32.load_state_dict(_hook_state("TopKHook", {"0.bias": torch.zeros(300)}))
    with pytest.raises(ValueError, match="residual of '2.bias' holds 11 elements, the "
                                         "parameter 10"):
        HOOKS["topk"](model).load_state_dict(_hook_state("TopKHook",
                                                         {"2.bias": torch.zeros(11)}))
    frozen = _model()
    frozen[0].weight.requires_grad_(False)   # unfrozen before DDP wraps it: compressed then
    HOOKS["topk"](frozen).load_state_dict(_hook_state("TopKHook",
                                                      {"0.weight": torch.zeros(40 * 300)}))
    _steps(ddp, model, [torch.ones(2, 40)])
    with pytest.raises(ValueError, match="before its first step"):
        hook.load_state_dict(hook.state_dict())
    overlapping = THCHook(model, lambda group: None)   # read on its communication thread
    assert overlapping.state_dict() == _hook_state("THCHook", {})


@pytest.mark.parametrize("kind", sorted(HOOKS))
def test_a_loaded_state_is_saved_again_and_follows_the_scale_before_a_step(alone, kind):
    """Residuals loaded and not yet taken by a bucket's reducer (before the first step) are
    the hook's too: its state named only those its buckets held (none: a checkpoint taken
    before the first step lost them all), and a change of scale left them in the old one."""
    model = _model()
    hook = HOOKS[kind](model).register(DDP(model))
    gen = torch.Generator().manual_seed(5)
    state = _hook_state(type(hook).__name__, {n: torch.randn(p.numel(), generator=gen) * 1e-3
                                               for n, p in model.named_parameters()})
    hook.load_state_dict(state)
    saved = hook.state_dict()["residuals"]
    assert set(saved) == set(state["residuals"])
    for n, r in state["residuals"].items():
        assert torch.equal(saved[n].reshape(-1), r), n
    hook.rescale_residuals(0.5)
    scaled = hook.state_dict()["residuals"]
    assert set(scaled) == set(state["residuals"])
    for n, r in state["residuals"].items():
        assert torch.equal(scaled[n].reshape(-1), r * 0.5), n


def test_a_hook_whose_first_step_was_refused_takes_no_state(alone):
    """A TopK hook whose first step was refused (a NaN) kept no residual, so a state loaded
    after that step was taken, though its bucket had already been laid out and had taken
    its parameters' residuals (none): a state is loaded before the first step, refused or
    not."""
    model = _model()
    ddp = DDP(model)
    hook = HOOKS["topk"](model).register(ddp)
    with pytest.raises(RuntimeError, match="NaN or Inf"):
        _steps(ddp, model, [torch.full((2, 40), float("nan"))])
    assert hook.state_dict()["residuals"] == {}
    with pytest.raises(ValueError, match="before its first step"):
        hook.load_state_dict(_hook_state("TopKHook", {"2.bias": torch.ones(10)}))


def test_a_parameter_whose_bucket_dropped_its_residual_has_none(alone):
    """A refused Marsit round drops its bucket's residual: the state named the residuals of
    DDP's first-iteration buckets instead, handed on a step before (a second time on
    resume)."""
    model = _model()
    ddp = DDP(model, bucket_cap_mb=40 * 300 * 4 / 2 ** 20)
    hook = HOOKS["marsit"](model).register(ddp)
    _steps(ddp, model, [torch.randn(16, 40) for _ in range(3)])
    assert len(hook.state_dict()["residuals"]) == 4
    with pytest.raises(RuntimeError, match="NaN"):
        _steps(ddp, model, [torch.full((16, 40), float("nan"))])
    held = hook._per_param
    owners = {held.owner[n] for n in hook.state_dict()["residuals"]}
    assert all(hook.reducers[(b, held.offsets[b][next(iter(held.layout_names[b]))][2])]
               .kept_residual is not None for b in owners)
    assert len(hook.state_dict()["residuals"]) < 4


def test_loaded_residuals_outlive_a_build_every_rank_refused(alone, monkeypatch):
    """The build of a bucket's reducer refused by its agreement (a peer's factory failed):
    the residuals it took from a load were gone on the ranks whose factory worked."""
    from thc.collective import agreement
    model = _model()
    ddp = DDP(model)
    hook = HOOKS["thc"](model).register(ddp)
    state = _hook_state("THCHook", {n: torch.full((p.numel(),), 0.5)
                                    for n, p in model.named_parameters()})
    hook.load_state_dict(state)
    together = agreement.together

    def peer_failed(group, rnd, key, *a, **kw):
        if kw.get("alike", "").startswith("the hook, the bucket"):   # a reducer's build
            raise RuntimeError("a peer's factory failed")
        return together(group, rnd, key, *a, **kw)
    monkeypatch.setattr(agreement, "together", peer_failed)
    with pytest.raises(RuntimeError, match="a peer's factory failed"):
        _steps(ddp, model, [torch.ones(2, 40)])
    assert set(hook._per_param.carried) == set(state["residuals"])


@kernels
def test_a_graphed_reducers_loaded_residual_follows_the_scale(alone):
    ar = GraphedAllReduce.through_torch_distributed(params=P, generator=11, capture=False)
    ar.load_state_dict(checkpoint.state(0, torch.ones(968), ar.state_owner))
    ar.rescale_residual(0.5)
    assert torch.equal(ar.kept_residual, torch.full((968,), 0.5))


def test_a_hook_serves_one_ddp_model(alone):
    model = _model()
    hook = HOOKS["thc"](model).register(DDP(model))
    with pytest.raises(ValueError, match="registered on a DDP model before"):
        hook.register(DDP(model))
