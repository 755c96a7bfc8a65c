"""One worker of ``thc bench allreduce``: time all-reduces of one float32 gradient.

``python -m thc.bench.allreduce_worker --mode fp32|fp16|thc|thc-dist --rank R --world N
--rendezvous IP:PORT [--config cluster.json [--agg IP:PORT]] --numel N --repeat K``

- ``fp32``: ``torch.distributed.all_reduce`` (Gloo, ring) of the whole tensor;
- ``fp16``: the same all-reduce of the tensor cast to float16 (cast and back included);
- ``thc``: :class:`thc.collective.allreduce.THCAllReduce` through the aggregator (norm round,
  encode, stream through the switch or the software aggregator, decode);
- ``thc-dist``: the same THC round with its integer sums carried by a Gloo all-reduce (no
  aggregator: THC sums are integers, so the ordinary ring adds them exactly).

Every round starts after a Gloo barrier; the first ``--warmup`` rounds are not timed. If
``--intf`` names this host's interface, its byte counters (``/proc/net/dev`` of the worker's
own network namespace) are read around each timed round. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from thc.codec.params import THCParams
from thc.collective import worker
from thc.collective.allreduce import THCAllReduce

MODES = ["fp32", "fp16", "thc", "thc-dist"]


def worker_generator(seed: int, rank: int):
    """The generator of rank ``rank``'s input: any rank can regenerate any other's."""
    import torch
    return torch.Generator().manual_seed(seed * 1000 + rank)


def intf_counters(intf: str | None) -> tuple[int, int] | None:
    """(tx_bytes, rx_bytes) of ``intf`` as this process's network namespace sees it."""
    if not intf:
        return None
    try:
        with open("/proc/self/net/dev") as f:
            for line in f:
                name, sep, rest = line.partition(":")
                if sep and name.strip() == intf:
                    v = rest.split()
                    return int(v[8]), int(v[0])
    except OSError:
        return None
    return None


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mode", choices=MODES, required=True)
    worker.add_arguments(ap, deadline=50.0)
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--intf", help="this host's interface, for wire byte counters")
    ap.add_argument("--error-feedback", action="store_true",
                    help="THC: keep error feedback on (its update is then part of the time)")
    ap.add_argument("--check-elems", type=int, default=1 << 20,
                    help="NMSE of the first THC estimate against the exact mean of this many "
                         "leading elements (an extra small FP32 all-reduce after timing)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    worker.init_group(args, timeout=600)
    x = torch.randn(args.numel, generator=worker_generator(args.seed, args.rank))

    times, wire, phases, cpu = [], [], [], []
    first = None
    client = None
    ar = None
    if args.mode == "thc":
        client = worker.client_from_args(args)
        params = THCParams(granularity=client.job.granularity, seed=args.seed)
        ar = THCAllReduce.through_aggregator(client, params,
                                             error_feedback=args.error_feedback,
                                             generator=torch.Generator().manual_seed(
                                                 7919 * (args.rank + 1)))
        step = ar
    elif args.mode == "thc-dist":
        ar = THCAllReduce.through_torch_distributed(
            params=THCParams(seed=args.seed), error_feedback=args.error_feedback,
            generator=torch.Generator().manual_seed(7919 * (args.rank + 1)))
        step = ar
    elif args.mode == "fp16":
        def step(t):
            y = t.half()
            dist.all_reduce(y)
            return y.float().div_(args.world)
    else:
        def step(t):
            y = t.clone()
            dist.all_reduce(y)
            return y.div_(args.world)

    out = None
    for i in range(args.warmup + args.repeat):
        before_ph = dict(ar.stats.seconds) if ar is not None else None
        dist.barrier()
        c0 = intf_counters(args.intf)
        t0, p0 = time.perf_counter(), time.process_time()
        out = step(x)
        t1, p1 = time.perf_counter(), time.process_time()
        c1 = intf_counters(args.intf)
        if first is None:
            first = out[: args.check_elems].clone()
        if i < args.warmup:
            continue
        times.append(t1 - t0)
        cpu.append(p1 - p0)
        if c0 and c1:
            wire.append((c1[0] - c0[0], c1[1] - c0[1]))
        if before_ph is not None:
            phases.append({k: v - before_ph[k] for k, v in ar.stats.seconds.items()})

    digest = hashlib.sha256(out.numpy().tobytes()).hexdigest()
    nmse = nmse_zero = None
    if args.check_elems:
        # Every rank's input is regenerated here from its seed rather than all-reduced: the
        # check then puts no bytes on the links whose counters measure the rounds.
        k = min(args.check_elems, args.numel)
        exact, sq = torch.zeros(k), 0.0
        for r in range(args.world):
            xr = x if r == args.rank else torch.randn(args.numel, generator=worker_generator(
                args.seed, r))
            exact += xr[:k]
            sq += float((xr[:k] ** 2).sum())
            del xr
        exact /= args.world
        nmse = float(((first[:k] - exact) ** 2).sum() / (sq / args.world))
        nmse_zero = float((exact ** 2).sum() / (sq / args.world))   # an all-zero estimate's
    result = {"rank": args.rank, "mode": args.mode, "numel": args.numel, "times": times,
              "cpu_seconds": cpu, "wire": wire, "phases": phases, "sha256": digest,
              "nmse": nmse, "nmse_of_zeros": nmse_zero}
    if client is not None:
        result["transport"] = vars(client.stats)
        result["client_datapath"] = ar.transport.datapath
        client.close()
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
