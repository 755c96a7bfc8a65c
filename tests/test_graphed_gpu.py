"""Graphed THC rounds on a GPU: captured in a CUDA graph at their second round and replayed
from then on, over NCCL (a process group of one), equal to the eager all-reduce bit for bit,
alone and inside the DDP hook (captured on its communication thread while backward runs).
Needs CUDA and NCCL; skipped without them (tests/test_graphed.py checks the same steps
eagerly under Triton's interpreter)."""
import copy

import pytest
import torch
import torch.distributed as dist

from thc.codec.thc import THCParams
from thc.collective.allreduce import THCAllReduce
from thc.collective.ddp import THCHook
from thc.collective.graphed import GraphedAllReduce

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()),
    reason="no CUDA device with NCCL: graphed rounds are captured on a GPU")


@pytest.fixture(scope="module")
def nccl():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_rounds_replay_from_a_graph_equal_to_the_eager_ones(nccl):
    """Six rounds: eager, captured, then replays; a NaN in round 3 is refused by both, and the
    rounds after it are equal again."""
    p = THCParams()
    eager = THCAllReduce.through_torch_distributed(params=p, generator=9)
    graphed = GraphedAllReduce.through_torch_distributed(params=p, generator=9)
    gen = torch.Generator("cuda").manual_seed(1)
    for r in range(6):
        x = torch.randn((1 << 21) + 5000, device="cuda", generator=gen)
        if r == 3:
            x[70_000] = float("nan")
            for ar in (eager, graphed):
                with pytest.raises(ValueError, match="NaN or Inf .* in slice 0"):
                    ar(x)
            continue
        assert torch.equal(eager(x), graphed(x)), r
    assert graphed.graph is not None and graphed.round == eager.round == 6
    assert graphed.transport.bytes_sent == eager.transport.bytes_sent


@pytest.mark.parametrize("deferred", [False, True])
def test_the_ddp_hook_replays_graphed_rounds(nccl, deferred):
    """Two copies of a model, the eager rounds and the graphed ones in the hook (waited for,
    or with deferred checks): the same gradients, bit for bit, step after step (DDP rebuilds
    its buckets after the first)."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 10)).cuda()
    p = THCParams(slice_size=1 << 16)
    makers = (lambda group: THCAllReduce.through_torch_distributed(group, params=p,
                                                                   generator=4),
              lambda group: GraphedAllReduce.through_torch_distributed(
                  group, params=p, generator=4, deferred_checks=deferred))
    models, hooks = [], []
    for make in makers:
        m = copy.deepcopy(base)
        ddp = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=1)
        hooks.append(THCHook(m, make).register(ddp))
        models.append(ddp)
    gen = torch.Generator("cuda").manual_seed(2)
    for step in range(5):
        x = torch.randn(64, 512, device="cuda", generator=gen)
        grads = []
        for ddp in models:
            ddp.zero_grad(set_to_none=True)
            ddp(x).square().mean().backward()
            grads.append([q.grad.clone() for q in ddp.parameters()])
        for a, b in zip(*grads):
            assert torch.equal(a, b), step
    replayed = [ar for ar in hooks[1].reducers.values() if ar.graph is not None]
    assert replayed and all(ar.stats.calls >= 3 for ar in replayed)
    hooks[1].check()


def test_deferred_rounds_replay_equal_to_the_waited_ones(nccl):
    """Replayed rounds that are not waited for: equal to the eager ones; a NaN's round returns
    zeros and the next call raises it, taking no round; then equal again."""
    p = THCParams()
    eager = THCAllReduce.through_torch_distributed(params=p, generator=9)
    graphed = GraphedAllReduce.through_torch_distributed(params=p, generator=9,
                                                         deferred_checks=True)
    gen = torch.Generator("cuda").manual_seed(1)
    for r in range(7):
        x = torch.randn((1 << 21) + 5000, device="cuda", generator=gen)
        if r == 3:
            x[70_000] = float("nan")
            with pytest.raises(ValueError, match="NaN or Inf .* in slice 0"):
                eager(x)
            assert not graphed(x).any()
            continue
        if r == 4:
            with pytest.raises(ValueError, match="NaN or Inf .* in slice 0"):
                graphed(x)
        assert torch.equal(eager(x), graphed(x)), r
    graphed.check()
    assert graphed.graph is not None and graphed.round == eager.round == 7


def test_a_failed_capture_falls_back_to_eager_rounds(nccl, monkeypatch):
    """The capture at round 2 fails: that round owes its collectives and raises, the reducer
    runs eagerly from then on, host and device rounds in step."""
    ar = GraphedAllReduce.through_torch_distributed(params=THCParams(), generator=3)
    x = torch.randn((1 << 20) + 300, device="cuda")
    ar(x)

    def broken(*a, **k):
        raise RuntimeError("capture refused")
    monkeypatch.setattr(torch.cuda, "graph", broken)
    with pytest.raises(RuntimeError, match="capture refused"):
        ar(x)
    monkeypatch.undo()
    assert ar.capture is False and ar.graph is None
    assert torch.isfinite(ar(x)).all() and ar.round == int(ar._bufs.round) == 3


def test_a_replay_that_outlasts_its_deadline_abandons_the_group(nccl):
    """No watchdog watches a replayed collective: past ``timeout`` the wait raises, and no
    later round uses that process group."""
    group = dist.new_group(backend="nccl")
    ar = GraphedAllReduce.through_torch_distributed(group, THCParams(), generator=3,
                                                    timeout=1e-9)
    x = torch.randn(1 << 22, device="cuda")
    ar(x)
    with pytest.raises(TimeoutError, match="did not finish in"):
        ar(x)
    with pytest.raises(RuntimeError, match="out of step"):
        ar(x)


def test_a_refusal_raised_on_another_stream_does_not_refuse_the_next_round(nccl):
    """Each round clears its own flags in its stream order: a refusal raised while another,
    busy stream is current leaves no flag behind for the next, clean, round."""
    ar = GraphedAllReduce.through_torch_distributed(params=THCParams(), generator=1,
                                                    deferred_checks=True)
    gen = torch.Generator("cuda").manual_seed(0)
    for _ in range(3):
        ar(torch.randn(1 << 20, device="cuda", generator=gen))
    bad = torch.randn(1 << 20, device="cuda", generator=gen)
    bad[5] = float("nan")
    assert not ar(bad).any()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(1e9))              # the side stream is busy for a while
        with pytest.raises(ValueError, match="NaN or Inf"):
            ar.check()
    clean = ar(torch.randn(1 << 20, device="cuda", generator=gen))
    ar.check()
    assert clean.any() and ar.graph is not None
