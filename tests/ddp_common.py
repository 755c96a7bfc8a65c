"""Models, data and workers that the DDP hook tests (tests/test_ddp*.py) share."""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist


WORLD = 2


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))


def _data(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(32, 64, generator=g), torch.randint(0, 4, (32,), generator=g)


KINDS = ("thc", "topk", "marsit")


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


def _hooked(rank, port, kind):
    """A two-rank Gloo group and a DDP model with ``kind``'s hook, not overlapped."""
    model, ddp, _ = _hooked_with(rank, port, kind)
    return model, ddp


def _hooked_with(rank, port, kind):
    """:func:`_hooked`'s model, DDP model and hook."""
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
        hook = THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(seed=3), generator=gen),
            HookOptions(uncompressed=("2.bias",)), overlap=False)
    elif kind == "compressed":   # no FP32 span: the THC rounds are the only check
        hook = THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(seed=3), generator=gen), overlap=False)
    elif kind == "spans":   # FP32 spans alone: their tag lanes are the only check
        hook = THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(seed=3), generator=gen),
            HookOptions(min_numel=1 << 30), overlap=False)
    elif kind == "topk":
        hook = TopKHook(model, overlap=False)
    else:
        hook = MarsitHook(model, overlap=False, generator=gen)
    return model, ddp, hook.register(ddp)


def _outcome(ddp, x, y, forwards=1, logits=lambda out: out) -> str:
    """One backward of the summed loss of ``forwards`` forwards (``logits``: of a forward's
    output): "ok", or what it raised."""
    try:
        sum(torch.nn.functional.cross_entropy(logits(ddp(x)), y)
            for _ in range(forwards)).backward()
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
