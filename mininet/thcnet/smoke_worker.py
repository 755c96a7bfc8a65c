"""One worker of the smoke all-reduce: random 4-bit indices through the aggregator.

``python -m thcnet.smoke_worker --rank R --config cluster.json --agg IP:PORT --numel N --seed S``

Worker r draws its indices from seed S + r, so anyone can recompute every worker's vector and
the exact integer sums (:func:`reference_sums`). Prints one JSON line: rank, seconds, the
SHA-256 of the sums, how many differ from the reference, rounds done, transport stats; a
failure of the aggregation (timeout, aggregator restarted) is a JSON line with its cause and
exit code 3, so a fault experiment can tell a clear failure from a crash.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from host.codec.packing import pack_bits
from host.net.aggregator import parse_hostport
from host.net.client import AggregationClient, AggregationTimeout, AggregatorRestarted
from host.net.impair import Impairment
from host.wire import protocol as P
from host.wire.jobs import Cluster


def indices(seed: int, rank: int, numel: int) -> np.ndarray:
    return np.random.default_rng(seed + rank).integers(0, 1 << P.INDEX_BITS, numel,
                                                       dtype=np.uint8)


def padded(numel: int, lanes: int) -> int:
    return -(-numel // lanes) * lanes


def reference_sums(table, n_workers: int, seed: int, numel: int) -> np.ndarray:
    lut = np.asarray(table, dtype=np.uint16)
    total = np.zeros(numel, dtype=np.uint16)
    for r in range(n_workers):
        total += lut[indices(seed, r, numel)]
    return total


def digest(sums: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(sums, dtype=np.uint16).tobytes()).hexdigest()


def _stop_round(until: str) -> float:
    """The round count after which every worker stops (DIR/stop), or infinity.

    Whoever writes it must pick a count no worker has reached yet: a worker is at most one
    round ahead of the slowest (a round needs everyone's chunks), so the highest done-RANK
    plus two is safe, and every worker then runs the same number of rounds."""
    try:
        return int(Path(until, "stop").read_text())
    except (OSError, ValueError):
        return float("inf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--agg", metavar="IP:PORT",
                    help="the aggregator (not for a sharded job: its shard map names them)")
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--deadline", type=float, default=30.0)
    ap.add_argument("--window", type=int, default=None, help="chunks in flight (default: pool)")
    ap.add_argument("--run", type=lambda t: int(t, 0), default=None,
                    help="run id, the same on every worker (default: THC_RUN)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="aggregate the vector this many times (each checked)")
    for name in ("loss", "dup", "reorder"):
        ap.add_argument(f"--{name}", type=float, default=0.0,
                        help=f"inject {name} with this probability on sent chunks (testing)")
    ap.add_argument("--until", metavar="DIR", default=None,
                    help="streams of a set duration: write DIR/done-RANK (rounds finished) "
                         "after each round, and stop once DIR/stop holds a round count this "
                         "worker reached (--rounds stays the upper bound)")
    ap.add_argument("--jitter", type=float, default=0.0, metavar="SECONDS",
                    help="delay each sent chunk by a random 0..SECONDS (testing)")
    ap.add_argument("--rto", type=float, default=0.02, help="initial/minimum retransmission "
                    "timeout in seconds")
    args = ap.parse_args(argv)


    job = Cluster.load(args.config).jobs[0]
    if not job.shards and not args.agg:
        ap.error("--agg is needed for a job without a shard map")
    agg = None if job.shards else parse_hostport(args.agg)
    idx = np.zeros(padded(args.numel, job.lanes), dtype=np.uint8)
    idx[: args.numel] = indices(args.seed, args.rank, args.numel)
    packed = pack_bits(idx, P.INDEX_BITS)
    impair = Impairment(loss=args.loss, dup=args.dup, reorder=args.reorder,
                          jitter=args.jitter, seed=args.rank)
    ref = reference_sums(job.table, job.n_workers, args.seed, args.numel)
    mismatches, rounds, sums = 0, 0, ref
    with AggregationClient(job, args.rank, agg, deadline=args.deadline, window=args.window,
                           timeout=args.rto, run=args.run, impair=impair) as client:
        t0 = time.perf_counter()
        try:
            for _ in range(args.rounds):
                if args.until and rounds >= _stop_round(args.until):
                    break
                sums = client.aggregate(packed)[: args.numel]
                mismatches += int(np.count_nonzero(sums != ref))
                rounds += 1
                if args.until:
                    Path(args.until, f"done-{args.rank}").write_text(str(rounds))
        except (AggregationTimeout, AggregatorRestarted) as e:
            print(json.dumps({"rank": args.rank, "error": type(e).__name__, "message": str(e),
                              "missing": getattr(e, "missing", None), "rounds": rounds,
                              "mismatches": mismatches, "seconds": time.perf_counter() - t0,
                              "stats": vars(client.stats)}), flush=True)
            return 3
        seconds = time.perf_counter() - t0
        stats = vars(client.stats)
    print(json.dumps({"rank": args.rank, "seconds": seconds, "sha256": digest(sums),
                      "mismatches": mismatches, "numel": args.numel, "rounds": rounds,
                      "stats": stats}), flush=True)
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
