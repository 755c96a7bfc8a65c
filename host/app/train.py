"""One data-parallel training worker: a CNN on scikit-learn's digits, DDP over Gloo.

The gradient exchange is chosen by ``--mode``: ``fp32`` (DDP's own all-reduce), ``thc``
(THC through the aggregator at ``--agg``: switch or software), ``thc-dist`` (THC integer
sums over the Gloo all-reduce) or ``topk`` (10% TopK with error feedback). The dataset ships
inside scikit-learn, so nothing is downloaded. Every epoch prints one JSON line.

Run by ``thc run`` (the main job) inside emulated hosts, or by hand, e.g. under torchrun:
``torchrun --nproc-per-node 4 -m host.app.train --mode thc-dist``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from host.codec.params import THCParams
from host.collective.allreduce import THCAllReduce, agree_run
from host.collective.ddp import HookOptions, THCHook, TopKHook
from host.net.aggregator import parse_hostport
from host.net.client import AggregationClient
from host.wire.jobs import Cluster

MODES = ("fp32", "thc", "thc-dist", "topk")
STEP_LOSSES_KEPT = 50
"""Per-step losses reported (enough to compare two runs step by step)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=MODES, default="thc")
    parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    parser.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    parser.add_argument("--master", default=None, metavar="IP:PORT",
                        help="torch.distributed TCP rendezvous (default: env:// as torchrun sets)")
    parser.add_argument("--config", help="cluster JSON of the aggregator (mode thc)")
    parser.add_argument("--agg", metavar="IP:PORT", help="aggregator address (mode thc)")
    parser.add_argument("--run", type=int, default=None,
                        help="run id, the same on every worker (default: THC_RUN, else rank 0's "
                             "clock broadcast over the process group)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16, help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--width", type=int, default=64, help="CNN width (model size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many optimizer steps (evaluating then)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--topk-ratio", type=float, default=0.1)
    parser.add_argument("--slice-size", type=int, default=1 << 16,
                        help="THC rotation slice (power of two; small slices waste less padding)")
    parser.add_argument("--no-error-feedback", action="store_true")
    parser.add_argument("--uncompressed", default="",
                        help="comma-separated parameter-name parts left in FP32 (e.g. bias)")
    THCParams.add_arguments(parser, seed=False)


def load_digits_split(seed: int = 0):
    """Digits (1797 8x8 images, 10 classes) standardized, split 80/20 with a fixed seed."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0 - 0.5) / 0.5
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(y))
    tr, te = perm[:cut], perm[cut:]
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return to(x[tr]).unsqueeze(1), to(y[tr]), to(x[te]).unsqueeze(1), to(y[te])


def make_model(width: int = 64):
    import torch.nn as nn
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * 4, 256), nn.ReLU(), nn.Linear(256, 10))


def _hook(args, model, ddp):
    opts = HookOptions(uncompressed=tuple(s for s in args.uncompressed.split(",") if s))
    if args.mode == "topk":
        return TopKHook(model, ratio=args.topk_ratio, options=opts)
    import torch
    params = THCParams.from_args(args, seed=args.seed, slice_size=args.slice_size)
    ef = not args.no_error_feedback
    gen = torch.Generator().manual_seed(1000 + args.rank)
    if args.mode == "thc-dist":
        make = lambda: THCAllReduce.through_torch_distributed(  # noqa: E731
            params=params, error_feedback=ef, generator=gen)
        return THCHook(model, make, opts)
    cluster = Cluster.load(args.config)
    job = cluster.jobs[0]
    agg = parse_hostport(args.agg) if args.agg else (cluster.agg_ip, cluster.agg_port)
    client = AggregationClient(job, args.rank, agg, deadline=30.0,
                               run=args.run or agree_run())
    make = lambda: THCAllReduce.through_aggregator(  # noqa: E731
        client, params, error_feedback=ef, generator=gen)
    return THCHook(model, make, opts)


def train(args) -> list[dict]:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    init = f"tcp://{args.master}" if args.master else "env://"
    dist.init_process_group("gloo", init_method=init, rank=args.rank, world_size=args.world)
    xtr, ytr, xte, yte = load_digits_split(args.seed)
    model = make_model(args.width)
    ddp = DDP(model)
    hook = None
    if args.mode != "fp32":
        hook = _hook(args, model, ddp).register(ddp)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    global_batch = args.batch * args.world
    steps = len(ytr) // global_batch
    history = []
    start = time.perf_counter()
    step_losses: list[float] = []
    for epoch in range(1, args.epochs + 1):
        ddp.train()
        perm = torch.from_numpy(np.random.default_rng([args.seed, epoch]).permutation(len(ytr)))
        for s in range(steps):
            if args.max_steps is not None and len(step_losses) >= args.max_steps:
                break
            lo = s * global_batch + args.rank * args.batch
            idx = perm[lo: lo + args.batch]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            step_losses.append(float(loss))
        ddp.eval()
        with torch.no_grad():
            acc = float((model(xte).argmax(1) == yte).float().mean())
        if args.mode == "fp32":
            sent = 2 * (args.world - 1) * n_params * 4 * len(step_losses) // args.world
        else:
            sent = hook.bytes_sent
        row = {"mode": args.mode, "rank": args.rank, "epoch": epoch, "accuracy": acc,
               "loss": float(loss), "seconds": time.perf_counter() - start,
               "bytes_sent": int(sent), "params": n_params, "steps_per_epoch": steps,
               "steps": len(step_losses), "step_losses": step_losses[:STEP_LOSSES_KEPT]}
        history.append(row)
        print(json.dumps(row), flush=True)
        if args.max_steps is not None and len(step_losses) >= args.max_steps:
            break
    dist.barrier()
    dist.destroy_process_group()
    return history


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m host.app.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.mode == "thc" and not args.config:
        parser.error("--mode thc needs --config (the aggregator's cluster JSON)")
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
