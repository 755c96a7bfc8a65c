"""One worker of ``thc bench dlcp``: THC rounds of a layered gradient under congestion.

``python -m thc.bench.dlcp_worker --rank R --world N --rendezvous IP:PORT --agg IP:PORT
--config cluster.json --numel N --layers L --rounds K [--loss-bound F] [--priorities]``

Each round every worker all-reduces its gradient of round r: layer l (of L equal layers, l=0
needed first by the forward pass) is ``2^(-l/2) (s_r + n_{r,w})``, a signal shared by all
workers plus this worker's noise, both from fixed seeds, so every worker also knows the exact
mean. ``--priorities`` marks each chunk's DLCP class (layer position and agreed magnitude);
``--loss-bound`` lets a round close short. Rounds start after a Gloo barrier; the time of a
round is from the barrier to the decoded estimate. Prints one JSON line: round times, the
NMSE of each round's estimate, and the NMSE of the sum of all estimates against the sum of
all exact means (what SGD accumulates: error feedback re-sends what a short round lost);
before it, one line a round (``{"round": r, "seconds": ..., "short": ...}``) as it ends.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from thc.codec.params import THCParams
from thc.collective import worker
from thc.collective.allreduce import THCAllReduce


def gradient(numel: int, layers: int, rnd: int, worker: int, seed: int):
    """Worker ``worker``'s gradient of round ``rnd`` (see the module docstring)."""
    import torch
    shared = torch.randn(numel, generator=torch.Generator().manual_seed(seed * 7_919 + rnd))
    noise = torch.randn(numel, generator=torch.Generator().manual_seed(
        (seed * 104_729 + rnd) * 1_000 + worker + 1))
    scale = torch.repeat_interleave(2.0 ** (-torch.arange(layers) / 2), numel // layers)
    return scale * (shared + noise)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    worker.add_arguments(ap, deadline=50.0)
    ap.add_argument("--numel", type=int, default=1 << 18)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--priorities", action="store_true", help="mark DLCP classes in DSCP")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.numel % args.layers:
        ap.error("--numel must be a multiple of --layers")

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    worker.init_group(args, timeout=600)
    client = worker.client_from_args(args)
    job = client.job
    layer = args.numel // args.layers
    slice_size = 1 << (layer.bit_length() - 1) if layer & (layer - 1) else layer
    params = THCParams(granularity=job.granularity, seed=args.seed, slice_size=slice_size)
    ar = THCAllReduce.through_aggregator(client, params)
    position = (torch.repeat_interleave(torch.arange(args.layers, dtype=torch.float32),
                                        layer) / max(1, args.layers - 1))
    # one round untimed first, on an input and a reducer of its own (no residual carried into
    # the rounds measured): so the mode that runs first does not meet the fresh aggregator
    # and bridge alone; its packets are left out of the transport's counts below
    dist.barrier()
    warm = THCAllReduce.through_aggregator(client, params, error_feedback=False, name="warm-up")
    warm(gradient(args.numel, args.layers, args.rounds, args.rank, args.seed),
         position=position if args.priorities else None)
    before_all = dict(vars(client.stats))
    times, nmse, short = [], [], []
    sum_est = torch.zeros(args.numel)
    sum_mean = torch.zeros(args.numel)
    for r in range(args.rounds):
        xs = [gradient(args.numel, args.layers, r, w, args.seed) for w in range(args.world)]
        mean = sum(xs) / args.world
        before = client.stats.short
        dist.barrier()
        t0 = time.perf_counter()
        est = ar(xs[args.rank], position=position if args.priorities else None)
        times.append(time.perf_counter() - t0)
        short.append(client.stats.short - before)
        print(json.dumps({"round": r, "seconds": times[-1], "short": short[-1]}), flush=True)
        nmse.append(float(((est - mean) ** 2).sum() / (mean ** 2).sum()))
        sum_est += est
        sum_mean += mean
    cum = float(((sum_est - sum_mean) ** 2).sum() / (sum_mean ** 2).sum())
    result = {"rank": args.rank, "times": times, "nmse": nmse, "cumulative_nmse": cum,
              "short_chunks": short,
              "chunks_per_round": -(-ar.codec.layout(args.numel).total_padded // job.lanes),
              "transport": {k: v - before_all[k] if isinstance(v, (int, float)) else v
                            for k, v in vars(client.stats).items()}}
    client.close()
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
