"""``thc run``: the main job. Train the same model with each gradient exchange and compare.

Modes (one table, :data:`MODES`): uncompressed FP32 (DDP's Gloo all-reduce), on request
FP16 (the same all-reduce of gradients cast to half precision), THC through
software aggregator shards co-located with the workers (THC's parameter-server layout), THC
through the BMv2 switch (when BMv2 and Mininet are present; bounded to ``--bmv2-steps`` steps,
3 by default, its losses compared step by step with THC's through the software shards), THC's
integer sums over the Gloo all-reduce, TopK 10%, and Marsit's sign bits merged along a ring or
counted by a vote job (software aggregator; BMv2 on request); on request (``--modes
...,thc-central``) THC through one central software aggregator on its own host, and DLCP over
that aggregator: ``thc-lossy`` (rounds may close short at the job's ``--loss-bound``) and
``thc-dlcp`` (the same, every chunk marked with its DLCP class by layer position), both on links
queued by DLCP class; ``thc``/``thc-central`` retransmit everything. ``--congest F`` adds a
competing UDP flow (iperf) from every worker at F x the link rate, as ``thc bench dlcp`` does,
and queues every mode's links by class (the links are alike; ``thc-central`` may run the
compiled client window, the bound and the marks Python's). Workers run in Mininet hosts
behind emulated links when possible, else as loopback processes (said so).

For each mode it reports the time to reach a target accuracy (FP32's final accuracy minus
one point, and a fixed one), the speedup over FP32, the final accuracy, and the bytes on the
worker links in both directions; it plots accuracy against training time and against
bytes, and says plainly which mode won. Everything lands in ``out/mainjob.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from thc.argtypes import non_negative_float, non_negative_int, positive_float, positive_int
from thc.app.datasets import AUTO, DATASETS, fashion_missing, resolve
from thc.app.modes import AGGREGATED
from thc.bench import provenance
from thc.codec import settings
from thc.codec.params import THCParams
from thc.wire import protocol as P
from thc.wire.jobs import loss_bound_arg
from thc.wire.protocol import MAX_SOFTWARE_LANES
from thc.emu.base import MAX_TESTBED_WORKERS, worker_ip
from thc.emu.cleanup import Terminated, signals_raise, stopped_by
from thc.emu.mainreport import compare_bmv2, dlcp_ratios, plot, print_table, summarize
from thc.emu.procs import WorkerError, with_parent
from thc.emu import links, testbed
from thc.emu.testbed import bmv2_unavailable_reason, mininet_unavailable_reason, open_testbed

IPERF_PORT = 5201


@dataclass(frozen=True)
class Mode:
    train_mode: str
    aggregator: str
    description: str
    loss_bound: bool = False
    """The job gets ``--loss-bound`` and the links queue by DLCP class (Mininet; every mode's
    do under ``--congest``)."""
    priorities: bool = False
    """Workers mark every chunk with its DLCP class (``train --priorities``)."""


MODES = {
    "fp32": Mode("fp32", "none", "uncompressed FP32 all-reduce (Gloo ring)"),
    "fp16": Mode("fp16", "none", "FP16 all-reduce (Gloo ring, gradients cast to half by "
                 "torch's fp16_compress_hook)"),
    "thc": Mode("thc", "sharded", "THC through software aggregator shards, one on every "
                "worker host"),
    "thc-central": Mode("thc", "software", "THC through one central software aggregator on "
                        "its own host"),
    "thc-lossy": Mode("thc", "software", "THC through one central software aggregator, rounds "
                      "closing short at the loss bound (DLCP without priorities)",
                      loss_bound=True),
    "thc-dlcp": Mode("thc", "software", "THC through one central software aggregator, rounds "
                     "closing short at the loss bound, chunks marked by DLCP class",
                     loss_bound=True, priorities=True),
    "thc-bmv2": Mode("thc", "bmv2", "THC through the BMv2 switch"),
    "thc-dist": Mode("thc-dist", "none", "THC integer sums over the Gloo all-reduce"),
    "topk": Mode("topk", "none", "TopK 10% with error feedback (all-gather)"),
    "marsit": Mode("marsit", "none", "Marsit sign bits merged along a ring"),
    "marsit-vote": Mode("marsit-vote", "software",
                        "Marsit sign bits counted by the software aggregator (vote job)"),
    "marsit-vote-bmv2": Mode("marsit-vote", "bmv2",
                             "Marsit sign bits counted by the BMv2 switch (vote job)"),
}
OPT_IN = ("fp16", "thc-central", "thc-lossy", "thc-dlcp", "marsit-vote-bmv2")
DEFAULT_MODES = ",".join(m for m in MODES if m not in OPT_IN)
"""Every mode but FP16 (a baseline of the bandwidth sweep, ``thc sweep``), the central
aggregator's (plain and DLCP: a comparison under ``--congest``) and the BMv2 vote: at BMv2's
~2k packets/s of 256 lanes a step of 1.2M signs takes about 10 s (estimated), an epoch 20 min."""
BMV2_STEPS = 3
"""Steps a mode through BMv2 trains by default: its losses after two rounds of sums through
the switch are compared with ``thc``'s, which keeps the whole main job in minutes on 2 cores
(docs/results.md; a step takes about 9 s through a BMv2 built without logging macros, about
36 s with them on a loaded machine)."""
BMV2_TIMEOUT = 3600.0
LOSS_BOUND = 0.05
"""``--bmv2-timeout``'s and ``--loss-bound``'s defaults: a flag given with no mode that reads
it is refused."""
STOP_MARGIN = 25.0
"""Seconds before a mode's limit by which its workers stop training and evaluate: the last
evaluation fits in it (each worker stops after the last step it foresees, from its longest
step, to end before then: a step longer than the margin does not run past the limit)."""

FIXED_TARGET = {"fashion-mnist": 0.80, "digits": 0.95}
"""The fixed accuracy target of the time-to-accuracy table, per data set."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    testbed.add_arguments(parser, timeout=600.0,
                          timeout_help="per-mode limit, seconds: the workers stop training "
                                       f"{STOP_MARGIN:g} s before it and report how far they "
                                       "got; a mode still running at it failed")
    testbed.add_link_arguments(parser, bw=100.0)
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"comma-separated, from {','.join(MODES)} (default: all but "
                             f"{', '.join(OPT_IN)})")
    parser.add_argument("--data", default=AUTO, choices=(AUTO, *DATASETS),
                        help="data set (auto: fashion-mnist where installed, else digits, "
                             "saying so)")
    parser.add_argument("--epochs", type=positive_int, default=None,
                        help="epochs to train (default 2; 1 with --quick)")
    parser.add_argument("--batch", type=positive_int, default=128, help="per-worker batch size")
    parser.add_argument("--width", type=positive_int, default=None,
                        help="model width (default: the worker's, 768 for Fashion-MNIST's MLP: "
                             "1.2M parameters)")
    parser.add_argument("--evals", type=positive_int, default=6, help="evaluations per epoch")
    parser.add_argument("--quick", action="store_true",
                        help="about two minutes: 8192 training images (--train-subset given "
                             "wins), one epoch (--epochs given wins)")
    parser.add_argument("--train-subset", type=positive_int, default=None, metavar="N",
                        help="train on the first N images (step-time measurements: more "
                             "steps than --quick, less than an epoch)")
    parser.add_argument("--loss-bound", type=loss_bound_arg, default=LOSS_BOUND, metavar="F",
                        help="thc-lossy/thc-dlcp: fraction of a round's chunks, in [0, 1), "
                             "that may close short instead of being retransmitted")
    parser.add_argument("--congest", type=non_negative_float, default=0.0, metavar="F",
                        help="a competing UDP flow (iperf) from every worker at F x --bw, to "
                             "the aggregator's host (else the next worker); needs Mininet")
    parser.add_argument("--software-lanes", type=non_negative_int, default=0,
                        help="lanes per packet for the software aggregator (default 0: the "
                             f"most that fit one MTU, {MAX_SOFTWARE_LANES} for 8-bit sums, "
                             "half for 16-bit)")
    parser.add_argument("--out", default="out", help="directory for JSON and plot")
    parser.add_argument("--bmv2-steps", type=_steps, default=BMV2_STEPS, metavar="N|all",
                        help=f"modes through BMv2 train N steps, then evaluate (default "
                             f"{BMV2_STEPS}: a step of the 1.2M-parameter model takes 9-36 s "
                             f"through BMv2 on 2 cores); their losses are compared step by step "
                             f"with thc's. 'all' trains them for every epoch like the other "
                             f"modes (234 steps: 36 minutes or more; make run-bmv2)")
    parser.add_argument("--bmv2-timeout", type=positive_float, default=BMV2_TIMEOUT,
                        help="the limit for modes through BMv2 (default 3600 s; a lower limit "
                             "stops the mode where it got and still compares its losses with "
                             "THC's)")


def data_unavailable(args: argparse.Namespace, prog: str) -> str | None:
    """Why ``--data`` cannot be trained on (Fashion-MNIST named and not installed), else
    None with ``args.data`` resolved (:data:`AUTO`'s fallback to digits printed)."""
    name, note = resolve(args.data)
    if name == "fashion-mnist" and (why := fashion_missing()):
        return (f"{prog}: --data fashion-mnist: {why} (Debian package dataset-fashion-mnist, "
                f"`make system-deps` as root, or THC_FASHION_MNIST): install it, or choose "
                f"--data digits")
    if note:
        print(f"{prog}: {note}", flush=True)
    args.data = name
    return None


def check_args(args: argparse.Namespace, modes: list[str]) -> str | None:
    """Why the flags cannot run (None: they can), found before the first mode starts rather
    than when a mode's testbed or workers refuse them, after minutes of the others."""
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        return f"{'unknown mode(s) ' + str(unknown) if unknown else '--modes names no mode'}; " \
               f"choose from {list(MODES)}"
    if twice := sorted({m for m in modes if modes.count(m) > 1}):
        return f"--modes names {', '.join(twice)} more than once (each mode trains once)"
    # a flag no mode asked for reads is refused, not ignored
    if args.loss_bound != LOSS_BOUND and not any(MODES[m].loss_bound for m in modes):
        return (f"--loss-bound applies to {', '.join(m for m in MODES if MODES[m].loss_bound)}, "
                f"which --modes does not name")
    if (args.bmv2_steps != BMV2_STEPS or args.bmv2_timeout != BMV2_TIMEOUT) \
            and not any(MODES[m].aggregator == "bmv2" for m in modes):
        return (f"--bmv2-steps and --bmv2-timeout apply to "
                f"{', '.join(m for m in MODES if MODES[m].aggregator == 'bmv2')}, which "
                f"--modes does not name")
    if not 2 <= args.workers <= MAX_TESTBED_WORKERS:
        return (f"--workers {args.workers}: the modes compare gradient exchanges, which take "
                f"2..{MAX_TESTBED_WORKERS} workers (one exchanges nothing: its times and "
                f"winner would be noise)")
    if args.software_lanes:
        sum_bits = P.sum_bits_for(args.workers, THCParams().granularity)
        try:
            P.check_lanes(args.software_lanes, sum_bits=sum_bits)
        except ValueError as e:
            return f"--software-lanes {args.software_lanes} ({args.workers} workers, " \
                   f"{sum_bits}-bit sums): {e}"
    try:
        settings.current()                  # a bad THC_* variable
    except ValueError as e:
        return str(e)
    return None


def _steps(text: str) -> int | None:
    """A step count of at least 1, or ``all`` (None: no bound)."""
    return None if text == "all" else positive_int(text)


def _congest(tb, fraction: float, bw: float) -> tuple[list, dict]:
    """Start the competing flows (one per worker, best effort); (processes, what they are)."""
    rate = fraction * bw
    if tb.aggregator == "software":
        sinks = {"agg": tb.agg_addr[0]}
        dest = ["agg"] * tb.n_workers
        # The sink answers nothing: a slow ping keeps its MAC learnt (else the bridge floods).
        procs = [tb.popen("agg", ["ping", "-q", "-i", "0.5", worker_ip(0)], name="agg-ping")]
    else:
        sinks = {r: worker_ip(r) for r in range(tb.n_workers)}
        dest = [(r + 1) % tb.n_workers for r in range(tb.n_workers)]
        procs = []
    procs += [tb.popen(node, ["iperf", "-s", "-u", "-p", str(IPERF_PORT)],
                       name=f"iperf-server-{node}") for node in sinks]
    procs += [tb.popen(r, ["iperf", "-u", "-c", sinks[dest[r]], "-p", str(IPERF_PORT),
                           "-b", f"{rate * 1e6:.0f}", "-l", "1400", "-t", "3600"],
                          name=f"iperf{r}")   # bits/s: iperf 2's "M" is 2^20
              for r in range(tb.n_workers)]
    return procs, {"fraction": fraction, "mbit_per_worker": rate,
                   "sink": "aggregator host" if "agg" in sinks else "next worker"}


def probe_bmv2(seconds: float = 1.0) -> dict:
    """The BMv2 build's speed, measured before a mode through it starts: l2.p4 forwarding
    frames of a DATA packet's size, offered faster than it forwards, for ``seconds`` (the
    measurement of ``thc bench switch``, without its rate search). A build with logging
    macros forwards fewer, and the verdict says how to rebuild it."""
    import itertools

    from thc.controller import forwarding
    from thc.controller.bench import build_kind, measure
    from thc.controller.frames import udp_frame
    from thc.controller.testing.bmv2 import LocalBMv2
    from thc.wire import protocol as P
    size = 42 + P.HEADER_BYTES + P.payload_bytes(P.PktType.DATA)
    with LocalBMv2(2, program="l2", receive=False, preexec_fn=with_parent()) as bm:
        dst = "02:00:00:00:02:02"
        forwarding.install(bm.sw, {dst: 1})
        frame = udp_frame("02:00:00:00:02:01", dst, "10.0.2.1", "10.0.2.2", 1000, 2000,
                          bytes(size - 42))
        pps, _, cpu, _ = measure(lambda: bm.rx_packets(1), bm.send,
                                  itertools.repeat((0, frame)), 60_000, seconds,
                                  pid=bm.proc.pid)
    return {"l2_pps": pps, "cpu_us_per_packet": None if cpu is None else cpu * 1e6,
            "frame_bytes": size, "build": build_kind(pps)}


def _json_row(line: str) -> dict | None:
    """A worker's JSON row, or None for any other line: a library's print may start with
    "{" too, and failed the mode with a bare parser error."""
    if not line.startswith("{"):
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def _rows(stdout: str) -> tuple[dict, list[dict]]:
    info, rows = {}, []
    for line in stdout.splitlines():
        row = _json_row(line)
        if row is None:
            continue
        if "dataset" in row:
            info = row
        elif "accuracy" in row:
            rows.append(row)
    return info, rows


def _argv(args, mode: Mode, tb, cfg, bound, stop_at: float, rank: int) -> list[str]:
    """A worker's command line (thc.app.train)."""
    a = [sys.executable, "-m", "thc.app.train", "--mode", mode.train_mode,
         "--rank", str(rank), "--world", str(args.workers),
         "--rendezvous", f"{tb.master_addr[0]}:{tb.master_addr[1]}",
         "--epochs", str(args.epochs), "--batch", str(args.batch),
         "--evals", str(args.evals), "--data", args.data]
    if mode.train_mode in AGGREGATED:   # the others refuse the client's flags
        a += ["--config", str(cfg)]
        if tb.agg_addr is not None:
            a += ["--agg", f"{tb.agg_addr[0]}:{tb.agg_addr[1]}"]
    if args.width:
        a += ["--width", str(args.width)]
    if args.train_subset or args.quick:
        a += ["--train-subset", str(args.train_subset or 8192)]
    if mode.priorities:
        a.append("--priorities")
    if bound:
        a += ["--max-steps", str(bound)]
    return a + ["--stop-at", f"{stop_at:.3f}"]


def _show_progress(progress):
    """The workers' line handler: rank 0's progress and accuracy rows on the bar."""
    def on_line(rank: int, line: str) -> None:
        row = _json_row(line) if rank == 0 else None
        if row is None:
            return
        if "progress" in row:
            progress.total = row["of"]
            progress.n = row["progress"]
            progress.refresh()
        elif "accuracy" in row:
            progress.set_postfix(acc=f"{row['accuracy']:.3f}", t=f"{row['seconds']:.0f}s")
    return on_line


def _at_the_limit(e: WorkerError, limit: float, stop_in: float):
    """(results, why stopped) of workers still running at the limit, where rank 0 was in
    its final evaluation with rows to show; else raises the WorkerError that says what
    happened.

    The workers stop themselves STOP_MARGIN before the limit: one still running there is
    slow in its final evaluation (rank 0 marked its start, it has rows) or hung (a stopped
    peer or aggregator, a lost one: even a step longer than the margin cannot be told from
    that), unless a worker was stopped by a signal."""
    # a worker that failed on its own within the seconds before the limit, which the wait
    # gives the others to exit, is a failure, not a stop
    failed = [r.rank for r in e.results if r.rank not in e.states and r.returncode]
    if failed:
        raise WorkerError(f"worker(s) {failed} failed just before the {limit:.0f} s "
                          f"limit\n{e}", e.results, True, e.states) from None
    signalled = [r for r, st in e.states.items() if st.startswith("stopped")]
    evaluating = '"final_evaluation"' in e.results[0].stdout
    if signalled or not evaluating or not _rows(e.results[0].stdout)[1]:
        where = "in its final evaluation" if evaluating else \
            "before its final evaluation (a hang, or a step longer than that)"
        when = (f"{limit - stop_in:.0f} s after the workers were to stop and evaluate "
                f"(--stop-at), {where}" if stop_in < limit else
                f"before the workers' stop time ({stop_in:.0f} s after the launch: "
                f"--timeout is too short to start and train)")
        raise WorkerError(f"still running at the {limit:.0f} s limit, {when}\n{e}",
                          e.results, True, e.states) from None
    return e.results, (f"stopped at the {limit:.0f} s limit (its final evaluation did not "
                       f"end within {limit - stop_in:.0f} s)")


def _wire(tb, before, after, results, congestion) -> tuple[float, str]:
    """(bytes on the worker links, what counted them)."""
    if after:
        wire = sum(after[w][0] - before[w][0] + after[w][1] - before[w][1] for w in after)
        counters = ("shaper counters: every TCP segment and UDP datagram with its headers"
                    if getattr(tb, "bw_mbit", None) is not None else "interface counters")
        return wire, f"worker links, transmit + receive ({counters})" + (
            ", the competing flow included" if congestion else "")
    last_rows = (_rows(r.stdout)[1] for r in results)
    return (sum(rows[-1]["bytes_sent"] for rows in last_rows if rows),
            "bytes rank 0 sent, not received (its transport's counters; FP32 and FP16: the "
            "ring's formula): the loopback has no links to count")


def _run_mode(name: str, args, progress) -> dict:
    mode = MODES[name]
    lanes = args.software_lanes if mode.aggregator in ("software", "sharded") else None
    # Under --congest every mode gets the same class-queued links.
    queued = mode.loss_bound or bool(args.congest)
    limit = args.bmv2_timeout if mode.aggregator == "bmv2" else args.timeout
    bound = args.bmv2_steps if mode.aggregator == "bmv2" else None
    with open_testbed(args.workers, bw_mbit=args.bw, delay_ms=args.delay, loss_pct=args.loss,
                      aggregator=mode.aggregator, prefer_mininet=not args.loopback,
                      lanes=lanes, priorities=queued) as tb:
        if mode.train_mode == "marsit-vote":
            tb.use_vote_job()
        if mode.loss_bound:
            job = replace(tb.job, loss_bound=args.loss_bound).validate()
            tb.cluster = replace(tb.cluster, jobs=(job,))
        cfg = tb.logdir / "cluster.json"   # the testbed's cluster_path, removed with it
        tb.cluster.save(cfg)
        if mode.aggregator != "none":
            tb.start_aggregator()
        # the workers stop themselves in time to evaluate where they got to (the deadline
        # counts from here, start-up included, and is one time for every rank); the kill at
        # the limit stays as the backstop
        stop_in = max(10.0, limit - STOP_MARGIN)
        stop_at = time.time() + stop_in
        flows, congestion = _congest(tb, args.congest, args.bw) if args.congest else ([], None)
        before, agg_before = tb.wire_bytes(), _agg_bytes(tb)
        t0 = time.perf_counter()
        stopped = None
        try:
            results = tb.run_workers(
                lambda rank: _argv(args, mode, tb, cfg, bound, stop_at, rank),
                timeout=limit, on_line=_show_progress(progress))
        except WorkerError as e:
            if not e.timed_out:
                raise
            results, stopped = _at_the_limit(e, limit, stop_in)
        finally:
            for f in flows:
                f.kill()
        wall = time.perf_counter() - t0
        after, agg_after = tb.wire_bytes(), _agg_bytes(tb)
        kind = tb.kind
    info, history = _rows(results[0].stdout)
    if stopped is None and history and history[-1]["epoch"] < args.epochs - 1e-9:
        if bound and history[-1]["steps"] >= bound:
            stopped = f"bounded to {bound} steps (--bmv2-steps)"
        else:
            stopped = (f"stopped itself {limit - stop_in:.0f} s before the {limit:.0f} s "
                       f"limit (--stop-at)")
    if not history:
        raise RuntimeError(f"mode {name}: no evaluation row from rank 0 "
                           f"({stopped or 'it exited without one'})")
    wire, wire_source = _wire(tb, before, after, results, congestion)
    agg = None if agg_after is None else (agg_after[0] - agg_before[0]
                                          + agg_after[1] - agg_before[1])
    last = history[-1]
    return {"mode": name, "description": mode.description, "testbed": kind,
            "dataset": info.get("dataset"), "dataset_note": info.get("note", ""),
            "params": info.get("params"), "history": history, "wall_seconds": wall,
            "train_seconds": last["seconds"], "final_accuracy": last["accuracy"],
            "epochs_done": last["epoch"], "epochs_asked": args.epochs, "stopped": stopped,
            "step_bound": bound,
            "wire_bytes": int(wire), "wire_source": wire_source, "agg_link_bytes": agg,
            "comm_seconds": last.get("comm_seconds"),
            "exposed_comm_seconds": last.get("exposed_comm_seconds"),
            "loss_bound": args.loss_bound if mode.loss_bound else 0.0,
            "priorities": mode.priorities, "congestion": congestion,
            "class_queued_links": queued and kind == "mininet",
            "short_chunks": last.get("short_chunks"),
            "replicas_diverged_at": next((row["steps"] for row in history
                                          if row.get("replicas_agree") is False), None)}


def _agg_bytes(tb):
    fn = getattr(tb, "agg_wire_bytes", None)
    return fn() if fn else None


def epochs_of(args: argparse.Namespace) -> int:
    """--epochs where given (--quick once replaced it, and the report recorded the
    replacement), else 1 with --quick, else 2."""
    if args.epochs is not None:
        return args.epochs
    return 1 if args.quick else 2


def run(args: argparse.Namespace) -> int:
    """The main job: every mode trained in turn, then the table, the checks and the report
    (out/mainjob.json and its plot). 0 when every mode trained and every check held, 1 when
    one did not, 2 for arguments refused before any work."""
    from tqdm import tqdm

    args.epochs = epochs_of(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    mininet_why = "--loopback" if args.loopback else mininet_unavailable_reason("software")
    why = _refusal(args, modes, mininet_why)
    if why is None:
        _skip_unavailable(modes, mininet_why)
        why = None if modes else "thc run: every mode asked for was skipped: nothing to run"
    if why is None:
        out = Path(args.out)
        why = _out_refusal(out)
    if why:
        print(why, file=sys.stderr)
        return 2
    shaped = ("loopback, links not shaped" if mininet_why else f"at {args.bw:g} Mbit/s")
    print(f"thc run: {args.data}, {args.workers} workers {shaped}, "
          f"{args.epochs} epoch(s), modes {', '.join(modes)}"
          + (f", competing UDP flow {args.congest * args.bw:g} Mbit/s per worker"
             if args.congest else ""), flush=True)
    probe = None
    if any(MODES[m].aggregator == "bmv2" for m in modes):
        try:
            with signals_raise():
                probe = probe_bmv2()
            print(f"BMv2: {probe['build']}", flush=True)
        except (KeyboardInterrupt, Terminated) as e:
            return _stopped(e, "while measuring BMv2's forwarding rate; its switch stopped")
        except Exception as e:  # the probe is advisory
            print(f"BMv2: could not measure its forwarding rate ({e})", flush=True)
    runs, failed = [], []
    for name in modes:
        print(f"\n== {name}: {MODES[name].description}", flush=True)
        try:
            with tqdm(total=None, desc=name, unit="step", file=sys.stdout) as bar:
                run_ = _run_mode(name, args, bar)
        except (KeyboardInterrupt, Terminated) as e:
            when = f"during {name}; its testbed torn down"
            if not runs:
                return _stopped(e, when)
            # the modes that finished are kept: a stop late in a long run would lose them all
            written = _report(args, runs, failed, probe, out, stopped=when) != 2
            return _stopped(e, when, written)
        except Exception as e:  # one failed mode must not cost the others
            print(f"{name} FAILED: {e}", flush=True)
            failed.append({"mode": name, "error": str(e)})
            continue
        runs.append(run_)
        _print_mode(run_, args.epochs)
    return _report(args, runs, failed, probe, out)


def _report(args: argparse.Namespace, runs: list[dict], failed: list[dict], probe,
            out: Path, stopped: str | None = None) -> int:
    """The table, the checks and the report of the modes run (``stopped``: why the modes
    after them were not); the exit status of a run that was not stopped."""
    dataset = runs[0]["dataset"] if runs else args.data
    summary = summarize(runs, FIXED_TARGET.get(dataset, 0.9))
    summary["dlcp"] = dlcp_ratios(runs)
    print_table(runs, summary)
    if compared := compare_bmv2(runs):
        summary["bmv2_vs_thc"] = compared
    for f in failed:
        print(f"{f['mode']} FAILED (not in the table): {f['error']}")
    unchecked = failed_checks(runs, summary)
    for what in unchecked:
        print(f"CHECK FAILED: {what}")
    report = {"runs": runs, "failed": failed, "summary": summary, "args": vars(args),
              "bmv2_probe": probe, "stopped": stopped,
              "testbed": sorted({r["testbed"] for r in runs}), "recorded": provenance()}
    if (code := _write_report(out, report, dataset)) is not None:
        return code
    return 1 if failed or unchecked else 0


def _stopped(e: KeyboardInterrupt | Terminated, when: str, written: bool = False) -> int:
    """The line and exit status of a run ended by Ctrl-C, SIGTERM or SIGHUP ``when``."""
    said = "the report of the modes done written" if written else "no report written"
    how, code = stopped_by(e)
    print(f"\nthc run: {how} {when}, {said}", file=sys.stderr)
    return code


def _refusal(args: argparse.Namespace, modes: list[str],
             mininet_why: str | None) -> str | None:
    """Why these arguments cannot run (said before any work), or None. ``mininet_why``: why
    the workers run on the loopback, None on Mininet."""
    if why := check_args(args, modes):
        return f"thc run: {why}"
    if why := data_unavailable(args, "thc run"):
        return why
    if why := testbed.loopback_conflict(args):
        return f"thc run: {why}"
    if not mininet_why:
        try:
            links.plan(args.bw, args.delay, args.loss)
        except links.LinkError as e:
            return f"thc run: --bw/--delay/--loss: {e}"
    if args.congest and mininet_why:
        return ("thc run: --congest needs the Mininet testbed: not with --loopback"
                if args.loopback else
                f"thc run: --congest needs the Mininet testbed ({mininet_why})")
    if (not mininet_why and (args.delay or args.loss)
            and (args.congest or any(MODES[m].loss_bound for m in modes))):
        return ("thc run: --congest, thc-lossy and thc-dlcp queue links by DLCP class, which "
                "needs links without --delay/--loss (no netem)")
    return None


def _skip_unavailable(modes: list[str], mininet_why: str | None) -> None:
    """The BMv2 modes left out of ``modes`` where BMv2 cannot run, each said: its switch
    sits between Mininet hosts, so a run on the loopback has none."""
    for name in [m for m in modes if MODES[m].aggregator == "bmv2"]:
        why = (f"the BMv2 switch needs the Mininet testbed ({mininet_why})" if mininet_why
               else bmv2_unavailable_reason())
        if why:
            print(f"thc run: skipping {name}: {why}")
            modes.remove(name)


def _out_refusal(out: Path) -> str | None:
    """Why the report cannot be written to ``out`` (checked before the modes train)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"thc run: cannot create --out {out}: {e.strerror or e}"
    try:
        trial = out / f".thc-run-{os.getpid()}"
        try:
            trial.write_bytes(bytes(4096))   # not a directory modes train for, then cannot fill
        finally:
            trial.unlink(missing_ok=True)
    except OSError as e:
        return f"thc run: cannot write to --out {out}: {e.strerror or e}"
    return None


def _print_mode(run_: dict, epochs: int) -> None:
    """A trained mode's notes and its accuracy by epoch."""
    if run_["dataset_note"]:
        print(f"note: {run_['dataset_note']}")
    if run_["stopped"]:
        print(f"{run_['mode']} {run_['stopped']}: it got to epoch {run_['epochs_done']:.2f} of "
              f"{epochs} ({run_['history'][-1]['steps']} steps)")
    if run_["replicas_diverged_at"] is not None:
        print(f"{run_['mode']}: the workers' parameters differed at the evaluation after step "
              f"{run_['replicas_diverged_at']}: the exchange did not give every worker the "
              f"same update")
    print(f"{'epoch':>6} {'accuracy':>9} {'train s':>8}")
    for row in run_["history"]:
        print(f"{row['epoch']:>6.2f} {row['accuracy']:>9.4f} {row['seconds']:>8.1f}")


def _write_report(out: Path, report: dict, dataset: str) -> int | None:
    """out/mainjob.json and its plot; the exit status where either cannot be written."""
    runs, args = report["runs"], report["args"]
    shaped = (f"at {args['bw']:g} Mbit/s" if runs and runs[0]["testbed"] != "loopback" else
              "on the loopback, unshaped")
    title = (f"{dataset}, {args['workers']} workers {shaped} "
             f"({runs[0]['params'] / 1e6:.1f}M parameters)" if runs else dataset)
    text = json.dumps(report, indent=2)
    try:
        _write_whole(out / "mainjob.json", text)
    except OSError as e:
        print(f"thc run: cannot write to --out {out} ({e.strerror or e}); "
              f"{_keep_elsewhere(text)}", file=sys.stderr)
        return 2
    try:
        plot(runs, out / "mainjob.png", title, report["recorded"])
    except OSError as e:
        (out / "mainjob.png").unlink(missing_ok=True)
        print(f"thc run: wrote {out / 'mainjob.json'} but not its plot ({e.strerror or e})",
              file=sys.stderr)
        return 2
    print(f"\nwrote {out / 'mainjob.json'} and {out / 'mainjob.png'}")
    return None


def failed_checks(runs: list[dict], summary: dict) -> list[str]:
    """The main job's checks that failed: a mode whose workers' parameters differed, the
    BMv2 mode's losses unlike THC's through the software aggregators. A run that failed one
    exits nonzero, as a mode that failed does, though every mode is in the table."""
    out = [f"{r['mode']}: the workers' parameters differed after step "
           f"{r['replicas_diverged_at']}" for r in runs if r["replicas_diverged_at"] is not None]
    versus = summary.get("bmv2_vs_thc")
    if versus and not versus["identical_losses"]:
        out.append(f"thc-bmv2's losses differ from thc's from step "
                   f"{versus['first_difference']} of {versus['steps_compared']} compared"
                   if versus["steps_compared"] else "thc-bmv2 took no step to compare with thc")
    return out


def _keep_elsewhere(text: str) -> str:
    """Where the report went instead: a temporary directory, or, where that cannot take it
    either (one full disk), standard output."""
    try:
        kept = Path(tempfile.mkdtemp(prefix="thc-run-")) / "mainjob.json"
        _write_whole(kept, text)
        return f"the report of the runs is kept in {kept}"
    except OSError as e:
        print(text)
        return (f"nor in a temporary directory ({e.strerror or e}): the report of the runs "
                f"is on standard output")


def _write_whole(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all (a full disk left an empty report)."""
    part = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        part.write_text(text)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
