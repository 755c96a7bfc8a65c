"""``thc run``: the main job. Train the same model with each gradient exchange and compare.

Modes (one table, :data:`thc.emu.mainargs.MODES`): uncompressed FP32 (DDP's Gloo all-reduce),
on request FP16 (the same all-reduce of gradients cast to half precision), THC through
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
and queues every mode's links by class (the links are alike, and so is the client window).
Workers run in Mininet hosts behind emulated links when possible, else as loopback processes
(said so).

For each mode it reports the time to reach a target accuracy (FP32's final accuracy minus
one point, and a fixed one), the speedup over FP32, the final accuracy, and the bytes on the
worker links in both directions; it plots accuracy against training time and against
bytes, and says plainly which mode won. Everything lands in ``out/mainjob.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from thc.app.modes import AGGREGATED
from thc.emu import links
from thc.emu.base import worker_ip
from thc.lifetime import Terminated, signals_deferred, signals_raise, stopped_by
from thc.emu.mainargs import (MODES, QUICK_IMAGES, STOP_MARGIN, Mode, add_arguments,
                              epochs_of, links_refusal, out_refusal, refusal)
from thc.emu.mainreport import conclude, print_mode
from thc.emu.procs import WorkerError
from thc.emu.testbed import bmv2_unavailable_reason, mininet_unavailable_reason, open_testbed

__all__ = ["add_arguments", "run"]   # the command thc.cli dispatches to


def run(args: argparse.Namespace) -> int:
    """The main job: every mode trained in turn, then the table, the checks and the report
    (out/mainjob.json and its plot). 0 when every mode trained and every check held, 1 when
    one did not, 2 for arguments refused before any work."""
    from tqdm import tqdm

    args.epochs = epochs_of(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    mininet_why = "--loopback" if args.loopback else mininet_unavailable_reason("software")
    why = refusal(args, modes, mininet_why)
    if why is None:
        _skip_unavailable(modes, mininet_why)
        if not modes:
            why = "thc run: every mode asked for was skipped: nothing to run"
        elif why := links_refusal(args, modes, mininet_why):
            why = f"thc run: {why}"
    if why is None:
        out = Path(args.out)
        why = out_refusal(out)
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
    runs, failed, current = [], [], None
    try:
        with signals_raise():   # SIGTERM between modes too ends with a line and the report
            for name in modes:
                print(f"\n== {name}: {MODES[name].description}", flush=True)
                current = name
                try:
                    with tqdm(total=None, desc=name, unit="step", file=sys.stdout) as bar:
                        run_ = run_mode(name, args, bar)
                except Exception as e:  # one failed mode must not cost the others
                    current = None
                    print(f"{name} FAILED: {e}", flush=True)
                    failed.append({"mode": name, "error": str(e)})
                    continue
                current = None
                runs.append(run_)
                print_mode(run_, args.epochs)
    except (KeyboardInterrupt, Terminated) as e:
        when = f"during {current}; its testbed torn down" if current else "between modes"
        if not runs:
            return _stopped(e, when)
        # the modes that finished are kept: a stop late in a long run would lose them all
        written = _report(args, runs, failed, probe, out, stopped=when)[0] != 2
        return _stopped(e, when, written)
    code, signalled = _report(args, runs, failed, probe, out)
    if signalled is not None:
        return _stopped(signalled, "while its report was written", code != 2)
    return code


def _report(args, runs, failed, probe, out,
            stopped=None) -> tuple[int | None, BaseException | None]:
    """:func:`conclude` with Ctrl-C and SIGTERM held (a report half written is none), and the
    signal that came meanwhile, if one did."""
    code = None
    try:
        with signals_deferred():
            code = conclude(args, runs, failed, probe, out, stopped=stopped)
    except (KeyboardInterrupt, Terminated) as e:
        return code, e
    return code, None


def _skip_unavailable(modes: list[str], mininet_why: str | None) -> None:
    """The BMv2 modes left out of ``modes`` where BMv2 cannot run, each said: its switch
    sits between Mininet hosts, so a run on the loopback has none."""
    for name in [m for m in modes if MODES[m].aggregator == "bmv2"]:
        why = (f"the BMv2 switch needs the Mininet testbed ({mininet_why})" if mininet_why
               else bmv2_unavailable_reason())
        if why:
            print(f"thc run: skipping {name}: {why}")
            modes.remove(name)


def _stopped(e: KeyboardInterrupt | Terminated, when: str, written: bool = False) -> int:
    """The line and exit status of a run ended by Ctrl-C, SIGTERM or SIGHUP ``when``."""
    said = "the report of the modes done written" if written else "no report written"
    how, code = stopped_by(e)
    print(f"\nthc run: {how} {when}, {said}", file=sys.stderr)
    return code


def run_mode(name: str, args, progress) -> dict:
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
        agg_datapath = tb.aggregator_datapath()
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
            "aggregator_datapath": agg_datapath,
            "comm_seconds": last.get("comm_seconds"),
            "exposed_comm_seconds": last.get("exposed_comm_seconds"),
            "loss_bound": args.loss_bound if mode.loss_bound else 0.0,
            "priorities": mode.priorities, "congestion": congestion,
            "class_queued_links": queued and kind == "mininet",
            "short_chunks": last.get("short_chunks"),
            "replicas_diverged_at": next((row["steps"] for row in history
                                          if row.get("replicas_agree") is False), None)}


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
        if args.delay:
            a += ["--rto", f"{links.client_timeout(args.delay, mode.aggregator == 'bmv2'):g}"]
    if args.width:
        a += ["--width", str(args.width)]
    if args.train_subset or args.quick:
        a += ["--train-subset", str(args.train_subset or QUICK_IMAGES)]
    if mode.priorities:
        a.append("--priorities")
    if bound:
        a += ["--max-steps", str(bound)]
    return a + ["--stop-at", f"{stop_at:.3f}"]


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
    procs += [tb.popen(node, links.competing_sink(), name=f"iperf-server-{node}")
              for node in sinks]
    procs += [tb.popen(r, links.competing_flow(sinks[dest[r]], rate), name=f"iperf{r}")
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
    size = P.ETH_IP_UDP_BYTES + P.HEADER_BYTES + P.payload_bytes(P.PktType.DATA)
    with LocalBMv2(2, program="l2", receive=False) as bm:
        dst = "02:00:00:00:02:02"
        forwarding.install(bm.sw, {dst: 1})
        frame = udp_frame("02:00:00:00:02:01", dst, "10.0.2.1", "10.0.2.2", 1000, 2000,
                          bytes(size - P.ETH_IP_UDP_BYTES))
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
    return (sum(rows[-1]["bytes_sent"] + rows[-1]["bytes_received"]
                for rows in last_rows if rows),
            "bytes rank 0 sent and received (its transport's counters; FP32 and FP16: the "
            "ring's formula): the loopback has no links to count")


def _agg_bytes(tb):
    fn = getattr(tb, "agg_wire_bytes", None)
    return fn() if fn else None
