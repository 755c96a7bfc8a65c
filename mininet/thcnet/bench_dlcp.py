"""``thc bench dlcp``: DLCP's bounded loss and priorities on a congested Mininet link.

One Mininet testbed (N workers, the software aggregator, every link queueing by DLCP class:
``tclinks.PriorityTCIntf``) and a competing UDP flow (iperf, best effort) from every worker to
the aggregator's host at ``--competing`` x the link rate. The aggregator's link is N times a
worker's (``--agg-bw-factor``), so it carries the workers' flows at the same share of its
rate as each worker's link (at 1x, four workers' flows alone would offer it 3.2 times its
rate). In the same testbed and under the same flow, the modes run the same rounds
(``thc.bench.dlcp_worker``), all on the same client window (``--client-datapath``: the
compiled one where it is built, or Python's):

- ``retransmit``: loss bound 0, no DSCP marks: every lost chunk is retransmitted;
- ``bound``: ``--loss-bound``, no marks: a chunk that would be retransmitted closes short;
- ``bound+prio``: the same bound, every chunk marked with its DLCP class, so the competing
  flow's packets (and the low classes) are the ones the link drops.

Each round's time shows as it ends (rank 0's). Per mode: median and 99th percentile of the
round time (the slowest worker's), the NMSE of each round's estimate and of the accumulated
estimates (what SGD sums), and the chunks that closed short; ratios against ``retransmit``
from the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

from thc.argtypes import non_negative_float, positive_float, positive_int
from thc.bench import add_common, emit_json
from thc.codec import settings
from thc.codec.params import THCParams
from thc.wire import protocol as P
from thc.net.client import DATAPATH_ENV
from thc.wire.jobs import loss_bound_arg
from thc.emu.base import worker_ip
from thc.emu import links, testbed
from thc.lifetime import Terminated, stopped_by
from thc.emu.testbed import TestbedError, WorkerError, mininet_unavailable_reason, open_testbed

MODES = {"retransmit": (0.0, False), "bound": (None, False), "bound+prio": (None, True)}
"""mode -> (loss bound (None: --loss-bound), DSCP marks)."""
LOSS_BOUND = 0.05
"""``--loss-bound``'s default: given with no mode that reads it, it is refused."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    testbed.add_arguments(parser, timeout=900.0, loopback=False)
    parser.add_argument("--bw", type=positive_float, default=20.0, help="worker link Mbit/s")
    parser.add_argument("--competing", type=non_negative_float, default=0.8,
                        help="competing UDP flow per worker, as a fraction of --bw")
    parser.add_argument("--numel", type=positive_int, default=1 << 18,
                        help="gradient elements per round, split over --layers")
    parser.add_argument("--layers", type=positive_int, default=8,
                        help="equal layers of the gradient, each with its own scale; with "
                             "priorities, its DLCP class follows its position")
    parser.add_argument("--rounds", type=positive_int, default=None, help="default 40; --quick: 10")
    parser.add_argument("--loss-bound", type=loss_bound_arg, default=LOSS_BOUND,
                        help="the job's loss_bound: the share of a round's chunks that may "
                             "close short (docs/protocol.md, \"Bounded loss\")")
    parser.add_argument("--agg-bw-factor", type=positive_float, default=None,
                        help="the aggregator's link = factor x --bw (default: --workers)")
    parser.add_argument("--modes", type=_modes, default=",".join(MODES),
                        help=f"comma-separated, of {','.join(MODES)} (ratios against "
                             f"retransmit where it runs)")
    parser.add_argument("--client-datapath", choices=("python", "auto"), default="auto",
                        help="the workers' client window for every mode: python, or auto "
                             "(the compiled window where it is built); THC_CLIENT_DATAPATH is "
                             "not read: the modes are compared on the window this names")
    parser.add_argument("--pool-size", type=positive_int, default=64,
                        help="the job's slots: chunks a worker keeps in flight")


def _modes(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}, not {text!r}")
    return names


def _progress(name: str, rounds: int):
    """Rank 0's line handler: each round's time as it ends."""
    def on_line(rank: int, line: str) -> None:
        if rank == 0 and line.startswith('{"round"'):
            row = json.loads(line)
            print(f"    {name} round {row['round'] + 1}/{rounds}: {row['seconds']:.3f} s"
                  f"{', %d chunks short' % row['short'] if row['short'] else ''}", flush=True)
    return on_line


def _run_mode(tb, name: str, loss_bound: float, marks: bool, args, rounds: int) -> dict:
    master = f"{tb.master_addr[0]}:{tb.master_addr[1]}"
    agg = f"{tb.agg_addr[0]}:{tb.agg_addr[1]}"
    rate = args.competing * args.bw
    flows = [tb.popen(r, links.competing_flow(tb.agg_addr[0], rate), name=f"iperf{r}")
             for r in range(tb.n_workers)] if rate > 0 else []

    def argv(r):
        a = ["python", "-m", "thc.bench.dlcp_worker", "--rank", str(r), "--world",
             str(tb.n_workers), "--rendezvous", master, "--agg", agg, "--config",
             str(tb.cluster_path), "--numel", str(args.numel), "--layers", str(args.layers),
             "--rounds", str(rounds), "--loss-bound", str(loss_bound)]
        return a + (["--priorities"] if marks else [])

    try:
        results = tb.run_workers(argv, env={DATAPATH_ENV: args.client_datapath},
                                 timeout=args.timeout, on_line=_progress(name, rounds))
    finally:
        for f in flows:
            f.kill()
    rows = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    times = [max(row["times"][i] for row in rows) for i in range(rounds)]
    return {"mode": name, "loss_bound": loss_bound, "priorities": marks,
            "round_seconds": times,
            "median_s": statistics.median(times),
            "p99_s": float(np.percentile(times, 99)),
            "nmse_mean": statistics.mean(rows[0]["nmse"]),
            "cumulative_nmse": rows[0]["cumulative_nmse"],
            "short_chunks_per_round": statistics.mean(rows[0]["short_chunks"]),
            "chunks_per_round": rows[0]["chunks_per_round"],
            "identical_results": len({json.dumps(r["nmse"]) for r in rows}) == 1,
            "compiled_rounds": sum(row["transport"]["compiled_rounds"] for row in rows),
            "transport": [row["transport"] for row in rows]}


def run(args: argparse.Namespace) -> int:
    rounds = args.rounds or (10 if args.quick else 40)
    if args.loss_bound != LOSS_BOUND and all(MODES[m][0] is not None for m in args.modes):
        print(f"thc bench dlcp: --loss-bound applies to "
              f"{', '.join(m for m in MODES if MODES[m][0] is None)}, which --modes does not "
              f"name", file=sys.stderr)
        return 2
    try:
        settings.current()                  # a bad THC_* variable, before a testbed starts
    except ValueError as e:
        print(f"thc bench dlcp: {e}", file=sys.stderr)
        return 2
    if why := testbed.memory_conflict(args.workers, args.numel):
        print(f"thc bench dlcp: {why}", file=sys.stderr)
        return 2
    why = mininet_unavailable_reason("software")
    if why:
        print(f"thc bench dlcp: needs Mininet (congested, class-queued links): {why}",
              file=sys.stderr)
        return 2
    result = {"workers": args.workers, "bw_mbit": args.bw, "competing_mbit": args.competing
              * args.bw, "numel": args.numel, "layers": args.layers, "rounds": rounds,
              "loss_bound": args.loss_bound, "lanes": P.LANES,
              "agg_bw_factor": args.agg_bw_factor or args.workers,
              "datapath": args.client_datapath, "modes": {}}
    params = THCParams()
    running = "before the first mode"
    try:
        with open_testbed(args.workers, bw_mbit=args.bw, aggregator="software", params=params,
                          lanes=P.LANES, pool_size=args.pool_size, priorities=True,
                          agg_bw_factor=result["agg_bw_factor"]) as tb:
            print(f"{tb.describe()}; links {args.bw:g} Mbit/s (the aggregator's "
                  f"{args.bw * tb.agg_bw_factor:g}) queued by DLCP class; competing UDP flow "
                  f"{args.competing * args.bw:g} Mbit/s per worker; "
                  f"{args.client_datapath} client window", flush=True)
            tb.popen("agg", links.competing_sink(), name="iperf-server")
            # The flow's sink answers nothing: without traffic from it the bridge forgets its
            # MAC and floods the flow onto every worker link. A slow ping keeps it learnt.
            tb.popen("agg", ["ping", "-q", "-i", "0.5", worker_ip(0)], name="agg-ping")
            tb.start_aggregator()
            for name in args.modes:
                running = f"in mode {name}"
                bound, marks = MODES[name]
                m = _run_mode(tb, name, args.loss_bound if bound is None else bound, marks,
                              args, rounds)
                result["modes"][name] = m
                print(f"  {name:<11} median {m['median_s']:.3f} s  p99 {m['p99_s']:.3f} s  "
                      f"nmse {m['nmse_mean']:.4f}  cumulative {m['cumulative_nmse']:.5f}  "
                      f"short {m['short_chunks_per_round']:.1f}/{m['chunks_per_round']}",
                      flush=True)
            running = "after the last mode"
            result["aggregator_counters"] = tb.stop_aggregator()
    except (TestbedError, WorkerError) as e:
        print(f"thc bench dlcp: {e}", file=sys.stderr)
        emit_json(args, {**result, "complete": False, "error": str(e)})   # the modes before
        return 1
    except (KeyboardInterrupt, Terminated) as e:
        how, code = stopped_by(e)
        done = ", ".join(result["modes"]) or "none"
        print(f"\nthc bench dlcp: {how} {running}; testbed torn down; modes done: {done}"
              + (f" (in {args.json})" if args.json and result["modes"] else ""),
              file=sys.stderr)
        emit_json(args, {**result, "complete": False, "error": f"{how} {running}"})
        return code
    _print_table(result)
    wrong = [f"{name}: the workers' estimates differ" for name, m in result["modes"].items()
             if not m["identical_results"]]
    wrong += [f"{name}: NMSE {m['nmse_mean']:.3g} a round, no better than half an all-zero "
              f"estimate's 1" for name, m in result["modes"].items()
              if not m["nmse_mean"] < 0.5]
    if wrong:
        print(f"thc bench dlcp: {'; '.join(wrong)}", file=sys.stderr)
        emit_json(args, {**result, "complete": False, "error": "; ".join(wrong)})
        return 1
    emit_json(args, result)
    return 0


def _print_table(result: dict) -> None:
    base = result["modes"].get("retransmit")

    def ratio(key: str, m: dict) -> str:
        return f"{base[key] / m[key]:>5.2f}x" if base else f"{'-':>6}"
    print(f"\n{'mode':<11} {'median s':>9} {'x':>6} {'p99 s':>8} {'x':>6} {'NMSE/round':>11} "
          f"{'NMSE sum':>9} {'short/round':>12}")
    for name, m in result["modes"].items():
        print(f"{name:<11} {m['median_s']:>9.3f} {ratio('median_s', m)} "
              f"{m['p99_s']:>8.3f} {ratio('p99_s', m)} {m['nmse_mean']:>11.4f} "
              f"{m['cumulative_nmse']:>9.5f} {m['short_chunks_per_round']:>7.1f}/"
              f"{m['chunks_per_round']}")
    print(f"x: speedup over retransmit (same run, same competing flow, one untimed round "
          f"first); p99 of {result['rounds']} rounds: about the slowest")
    compiled = {name: m["compiled_rounds"] for name, m in result["modes"].items()}
    if len(set(compiled.values())) > 1:
        print("WARNING: the modes ran unlike client windows (rounds on the compiled one, all "
              "workers: " + ", ".join(f"{n} {c}" for n, c in compiled.items())
              + "): their ratios hold the windows' difference too")
    for name, m in result["modes"].items():
        if not m["identical_results"]:
            print(f"WARNING: {name}: the workers' estimates differ (replicas diverged)")
