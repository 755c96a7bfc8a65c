"""``python -m thc.emu.run``: bring up the testbed, run a THC smoke all-reduce, check it, tear down.

Every worker streams random 4-bit indices (1M elements by default) through the aggregator
(a software aggregator shard on every worker host, the central software aggregator on host
``agg``, or the BMv2 switch); the sums each worker gets back
are compared bit for bit with a numpy reference computed here. Prints per-worker time and
the bytes its link carried. Exit code 0 when every worker got exactly the reference sums.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from thc.argtypes import non_negative_int, positive_int, seconds
from thc.emu.smoke_worker import digest, reference_sums
from thc.emu import links, testbed
from thc.lifetime import Terminated, stopped_by
from thc.emu.testbed import TestbedError, WorkerError, open_testbed


CHOICES = {"sharded": "sharded", "central": "software", "bmv2": "bmv2"}
"""--aggregator's names -> the testbed's."""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    testbed.add_arguments(ap, timeout=300.0, timeout_help="limit of the run, seconds")
    testbed.add_link_arguments(ap, bw=None)
    testbed.add_job_arguments(ap, lanes=None, pool_size=None, window=None)
    ap.add_argument("--aggregator", choices=sorted(CHOICES), default="sharded",
                    help="sharded: one shard per worker host; central: one central software "
                         "aggregator on its own host (as `thc bench allreduce` names them); "
                         "bmv2: the switch")
    ap.add_argument("--numel", type=positive_int, default=1 << 20, help="elements per worker")
    ap.add_argument("--seed", type=non_negative_int, default=1234)
    ap.add_argument("--rto", type=seconds, default=None,
                    help="least retransmission timeout, seconds (default: half the links' "
                         "round trip, at least 0.02)")
    ap.add_argument("--verbose", action="store_true", help="show Mininet's own log")


def run(args: argparse.Namespace) -> int:
    unavailable = None if args.loopback else \
        testbed.mininet_unavailable_reason(CHOICES[args.aggregator])
    why = testbed.loopback_conflict(args, unavailable) or \
        testbed.agg_bw_conflict(args, central=args.aggregator == "central") or \
        testbed.memory_conflict(args.workers, args.numel)
    if why:
        print(f"thc.emu.run: {why}", file=sys.stderr)
        return 2

    t0 = time.monotonic()
    try:
        with open_testbed(args.workers, bw_mbit=args.bw, delay_ms=args.delay,
                          loss_pct=args.loss, aggregator=CHOICES[args.aggregator],
                          prefer_mininet=not args.loopback, agg_bw_factor=args.agg_bw_factor,
                          lanes=args.lanes, pool_size=args.pool_size,
                          quiet=not args.verbose) as tb:
            print(f"{tb.describe()} (up in {time.monotonic() - t0:.1f} s)")
            if tb.kind == "mininet":
                bw = f"{args.bw:g} Mbit/s" if args.bw else "unshaped"
                agg_bw = (f", aggregator link {args.bw * tb.agg_bw_factor:g} Mbit/s"
                          if args.bw and args.aggregator == "central" else "")
                print(f"links: {bw}{agg_bw}, delay {args.delay:g} ms, loss {args.loss:g}%")
            tb.start_aggregator()
            before = tb.wire_bytes()
            agg = ["--agg", f"{tb.agg_addr[0]}:{tb.agg_addr[1]}"] if tb.agg_addr else []
            results = tb.run_workers(
                lambda r: ["python", "-m", "thc.emu.smoke_worker", "--rank", str(r),
                           "--config", str(tb.cluster_path)] + agg + [
                           "--numel", str(args.numel), "--seed", str(args.seed),
                           "--rto", str(args.rto or links.client_timeout(
                               args.delay, args.aggregator == "bmv2"))]
                + (["--window", str(args.window)] if args.window else []),
                timeout=args.timeout)
            after = tb.wire_bytes()
            counters = tb.stop_aggregator()
            if args.aggregator == "bmv2":
                counters = tb.switch.counters()
            job = tb.job
    except WorkerError as e:
        print(f"smoke all-reduce FAILED:\n{e}", file=sys.stderr)
        return 1
    except TestbedError as e:
        print(f"thc.emu.run: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as e:
        how, code = stopped_by(e)
        print(f"\nthc.emu.run: {how}; testbed torn down", file=sys.stderr)
        return code

    ref = digest(reference_sums(job.table, job.n_workers, args.seed, args.numel))
    rows = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    ok = all(row["sha256"] == ref and row["mismatches"] == 0 for row in rows)
    print(f"\n{args.numel:,} elements per worker, {job.lanes} lanes per packet")
    print(f"{'worker':>6} {'seconds':>8} {'Melem/s':>8} {'tx MB':>8} {'rx MB':>8} "
          f"{'sent':>7} {'retx':>6}  sums")
    for row in rows:
        r = row["rank"]
        tx = (after[r][0] - before[r][0]) / 1e6 if after else float("nan")
        rx = (after[r][1] - before[r][1]) / 1e6 if after else float("nan")
        st = row["stats"]
        print(f"{r:>6} {row['seconds']:>8.3f} {row['numel'] / row['seconds'] / 1e6:>8.2f} "
              f"{tx:>8.2f} {rx:>8.2f} {st['sent']:>7} {st['retransmitted']:>6}  "
              + ("bit-exact" if row["sha256"] == ref else f"WRONG ({row['mismatches']} differ)"))
    if counters:
        shown = json.dumps(counters) if isinstance(counters, dict) else counters.strip()
        print(f"aggregator counters: {shown}")
        print("(a worker's retx: chunks it sent again, its timer out; the aggregator's "
              "retransmissions: results sent again for a chunk already finished, pending: "
              "PENDING answers to a worker that sent again a chunk still waiting for others; "
              "a retx whose first send was lost counts in neither; docs/protocol.md, "
              "\"Drops\")")
    print(f"\nsmoke all-reduce {'OK: every worker got the exact sums' if ok else 'FAILED'} "
          f"({time.monotonic() - t0:.1f} s total, testbed torn down)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m thc.emu.run", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
