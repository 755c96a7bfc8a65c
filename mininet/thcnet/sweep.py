"""``thc sweep``: the main job's training at several link bandwidths, and where THC stops
paying.

At each bandwidth (Mininet, every worker link shaped alike) it trains the main job's model
with each mode (default FP32, FP16 and THC through the software aggregator shards) for a
bounded number of steps (``--steps``: the first ``steps x workers x batch`` training images,
one pass), through the main job's own per-mode runner, so the runs are the main job's runs.
Each run records its steady-state seconds a step (first evaluation to last, as ``thc model
--calibrate`` reads them), its accuracy at every evaluation and the bytes on the worker
links; each point its time to an accuracy (``--target``, else FP32's final accuracy minus one
point at that bandwidth, the main job's target; a bounded run reaches it or not, and the
table says how many points did). The modes of one
bandwidth run back to back, so a load that comes and goes hits them alike; the load average
before every run is recorded with it.

It then computes the measured break-even (host/app/breakeven.py: interpolated between the
bracketing points) and the performance model's prediction from the sweep's own calibrated
inputs, prints both and a table, and writes the JSON of all points (after every point, so an
interrupted sweep keeps what it measured) and a plot. ``--report JSON`` redoes the analysis,
table and plot of a sweep already run, without running anything.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from thc.argtypes import (DAMAGED, figure_path, fraction, positive_float, positive_floats,
                          positive_int, read_json, seconds, writable_path)
from thc.app.breakeven import analyse
from thc.app.datasets import AUTO, DATASETS
from thc.bench import cpu_model, provenance
from thc.emu import links, mainargs, mainjob
from thc.emu.mainreport import summarize, time_to
from thc.emu.sweepreport import markdown, plot
from thc.lifetime import Terminated, signals_raise, stopped_by
from thc.emu.testbed import mininet_unavailable_reason, workers_arg

DEFAULT_BW = "50,100,200,500,1000"
DEFAULT_MODES = "fp32,fp16,thc"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bw", type=positive_floats, default=DEFAULT_BW,
                        help=f"link bandwidths, Mbit/s (default {DEFAULT_BW})")
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"main-job modes (default {DEFAULT_MODES}); the first THC mode "
                             f"is the one whose break-even is computed against fp32 and fp16")
    parser.add_argument("--workers", type=workers_arg, default=4)
    parser.add_argument("--steps", type=positive_int, default=40,
                        help="training steps a run (default 40; bounds the sweep's time: 15 "
                             "runs of 40 steps took 9.4 minutes on 2 cores)")
    parser.add_argument("--evals", type=positive_int, default=4,
                        help="evaluations a run (step time: first to last; at least 2)")
    parser.add_argument("--batch", type=positive_int, default=128, help="per-worker batch size")
    parser.add_argument("--data", default=AUTO, choices=(AUTO, *DATASETS),
                        help="data set (auto: fashion-mnist where installed, else digits, "
                             "saying so)")
    parser.add_argument("--width", type=positive_int, default=None, help="model width (main job's)")
    parser.add_argument("--target", type=fraction, default=None,
                        help="accuracy of the time-to-accuracy figures (default: FP32's final "
                             "accuracy minus one point at each bandwidth, the main job's)")
    parser.add_argument("--timeout", type=seconds, default=600.0,
                        help="limit a run, seconds")
    parser.add_argument("--agg-pps", type=positive_float, default=86e3,
                        help="software aggregator packets/s for the model (default: an "
                             "assumed rate, `thc model --calibrate`'s; `thc bench "
                             "aggregator` measures one alone)")
    parser.add_argument("--out", default="out", help="directory of sweep.json and sweep.png")
    parser.add_argument("--json", default=None, help="the JSON's path (default OUT/sweep.json)")
    parser.add_argument("--plot", default=None, help="the plot's path (default OUT/sweep.png)")
    parser.add_argument("--report", metavar="SWEEP_JSON", default=None,
                        help="analyse a sweep already run: print its table and break-even, "
                             "write --json and --plot (default OUT/sweep.json, OUT/sweep.png)")


def machine() -> dict:
    """What the figures were measured on."""
    mem = None
    try:
        kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
        mem = round(kb / 2 ** 20, 1)
    except (OSError, StopIteration):
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu_model(), "memory_gib": mem,
            "kernel": platform.release(), "python": platform.python_version()}


def fp16_cast_s(params: int, repeat: int = 15) -> float:
    """Median seconds of the FP16 round trip (``x.half().float()``) of ``params`` float32 on
    one thread, as a worker casts its gradients (the model's FP16 cost)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(params, generator=torch.Generator().manual_seed(0))
        x.half().float()
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            x.half().float()
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times)


def _job_args(args: argparse.Namespace, bw: float, modes: list[str]) -> argparse.Namespace:
    """The main job's arguments for one run of the sweep: every mode, BMv2's too, trains the
    sweep's steps under its limit."""
    parser = argparse.ArgumentParser()
    mainargs.add_arguments(parser)
    argv = ["--workers", str(args.workers), "--epochs", "1", "--batch", str(args.batch),
            "--evals", str(args.evals), "--data", args.data, "--bw", repr(bw),
            "--train-subset", str(args.steps * args.workers * args.batch),
            "--timeout", f"{args.timeout:g}", "--out", args.out]
    if args.width:
        argv += ["--width", str(args.width)]
    if any(mainargs.MODES[m].aggregator == "bmv2" for m in modes if m in mainargs.MODES):
        argv += ["--bmv2-steps", "all", "--bmv2-timeout", f"{args.timeout:g}"]
    return parser.parse_args(argv)


def _tta(runs: list[dict], target: float | None) -> dict:
    """Each mode's training seconds to ``target`` accuracy, else to FP32's final accuracy
    minus one point (the main job's target); None where the mode never got there."""
    if target is not None:
        return {r["mode"]: time_to(r["history"], target) for r in runs}
    rows = summarize(runs, 1.0)["rows"]
    return {row["mode"]: row.get("tta_fp32_minus_1pt") for row in rows}


def sweep(args: argparse.Namespace, bws: list[float], modes: list[str], path: Path) -> dict:
    """Run every (bandwidth, mode), saving the JSON after every point."""
    from tqdm import tqdm
    data = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": "thc sweep " + " ".join(shlex.quote(a) for a in sys.argv[2:])
            if sys.argv[1:2] == ["sweep"] else " ".join(map(shlex.quote, sys.argv)),
            "machine": machine(), "modes": modes, "steps": args.steps,
            "args": vars(_job_args(args, bws[0], modes)), "points": [], "failed": []}
    total, k, t_start = len(bws) * len(modes), 0, time.monotonic()
    for bw in bws:
        job = _job_args(args, bw, modes)
        point = {"bw_mbit": bw, "runs": [], "load_before": {}}
        for name in modes:
            k += 1
            load = os.getloadavg()
            point["load_before"][name] = list(load)
            took = time.monotonic() - t_start
            print(f"\n[{k}/{total}] {bw:g} Mbit/s, {name}: {mainargs.MODES[name].description} "
                  f"(load {load[0]:.2f}; {took / 60:.1f} min so far)", flush=True)
            try:
                with tqdm(total=args.steps, desc=f"{name}@{bw:g}", unit="step",
                          file=sys.stdout) as bar:
                    run = mainjob.run_mode(name, job, bar)
            except Exception as e:  # one failed run must not cost the others
                print(f"{name} at {bw:g} Mbit/s FAILED: {e}", flush=True)
                data["failed"].append({"bw_mbit": bw, "mode": name, "error": str(e)})
                continue
            if run["testbed"] != "mininet":
                raise RuntimeError(f"the run used the {run['testbed']} testbed: its links "
                                   f"were not shaped")
            h = run["history"]
            if len({row["steps"] for row in h}) < 2:
                why = (f"{len(h)} evaluation(s), at step(s) {[row['steps'] for row in h]}: no "
                       f"steady-state step time (first evaluation to last)")
                print(f"{name} at {bw:g} Mbit/s FAILED: {why}", flush=True)
                data["failed"].append({"bw_mbit": bw, "mode": name, "error": why})
                continue
            print(f"{name} at {bw:g} Mbit/s: {h[-1]['steps']} steps, "
                  f"{run['train_seconds'] / h[-1]['steps']:.3f} s a step, accuracy "
                  f"{run['final_accuracy']:.4f}", flush=True)
            point["runs"].append(run)
        point["tta_s"] = _tta(point["runs"], args.target)
        data["points"].append(point)
        path.write_text(json.dumps(data, indent=1))
    params = next((r["params"] for p in data["points"] for r in p["runs"]), None)
    if params:
        data["fp16_cast_s"] = fp16_cast_s(int(params))
    data["wall_seconds"] = time.monotonic() - t_start
    data["recorded"] = provenance()
    return data


def _thc_mode(modes: list[str]) -> str | None:
    """The swept mode whose break-even is computed: the first THC mode."""
    return next((m for m in modes if mainargs.MODES[m].train_mode.startswith("thc")), None)


def _drop_diverged(data: dict) -> None:
    """Runs whose workers' parameters differed (a check the main job fails on) out of the
    points and into ``failed``, each kept whole there: their step times are not a
    data-parallel training's."""
    for point in data["points"]:
        bad = [r for r in point["runs"] if r.get("replicas_diverged_at") is not None]
        point["runs"] = [r for r in point["runs"] if r not in bad]
        data["failed"] += [{"bw_mbit": point["bw_mbit"], "mode": r["mode"],
                            "error": f"the workers' parameters differed after step "
                                     f"{r['replicas_diverged_at']}", "run": r} for r in bad]


def _links_refusal(args: argparse.Namespace, bws: list[float], modes: list[str]) -> str | None:
    """Why the links of some bandwidth cannot carry some mode (checked before any run, as
    each run's testbed would, after the runs before it)."""
    for bw in bws:
        try:
            links.plan(bw, 0.0, 0.0)
        except links.LinkError as e:
            return f"--bw {bw:g}: {e}"
        if why := mainargs.links_refusal(_job_args(args, bw, modes), modes, None):
            return f"at {bw:g} Mbit/s, {why}"
    return None


def _paths_refusal(json_path: Path, plot_path: Path) -> str | None:
    """Why the report or the plot cannot be written (checked before any run)."""
    try:
        writable_path(str(json_path))
        figure_path(str(plot_path))
    except argparse.ArgumentTypeError as e:
        return f"thc sweep: {e}"
    return None


REPORT_READS = ("target", "agg_pps", "out", "json", "plot", "report", "command")
"""What ``--report`` reads of the flags: the analysis's and the outputs'; the runs' flags
were the sweep's own."""


def _ignored_by_report(args: argparse.Namespace) -> list[str]:
    """The run flags given beside ``--report``, which has no runs to give them to."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))   # as parsed: a default string through its type
    return [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
            if name not in REPORT_READS and value != defaults.get(name)]


def run(args: argparse.Namespace) -> int:
    if args.report and (ignored := _ignored_by_report(args)):
        print(f"thc sweep --report analyses runs already made: it would ignore "
              f"{', '.join(ignored)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    json_path = Path(args.json) if args.json else out / "sweep.json"
    plot_path = Path(args.plot) if args.plot else out / "sweep.png"
    if why := _paths_refusal(json_path, plot_path):
        print(why, file=sys.stderr)
        return 2
    if args.report:
        data = read_json(args.report, "a sweep's report (sweep.json of `thc sweep`)",
                         ("modes", "points"), "thc sweep")
        data.setdefault("failed", [])
        data["analysed_by"] = "thc sweep " + " ".join(map(shlex.quote, sys.argv[2:]))
    else:
        bws = sorted(set(args.bw))
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if why := mainargs.check_args(_job_args(args, bws[0], modes), modes):
            print(f"thc sweep: {why}", file=sys.stderr)
            return 2
        if args.evals < 2 or args.steps < 2:
            print("thc sweep: --evals and --steps must be at least 2: a run's step time is "
                  "read from its first evaluation to its last", file=sys.stderr)
            return 2
        if why := _links_refusal(args, bws, modes):
            print(f"thc sweep: {why}", file=sys.stderr)
            return 2
        if not _thc_mode(modes):
            print("thc sweep: --modes names no THC mode: there is no break-even to find",
                  file=sys.stderr)
            return 2
        if "fp32" not in modes or len(bws) < 2:
            print("thc sweep: the break-even fits the links to FP32's step times: sweep fp32 "
                  "at two bandwidths or more", file=sys.stderr)
            return 2
        if why := mininet_unavailable_reason("sharded"):
            print(f"thc sweep: needs the Mininet testbed to shape links ({why})",
                  file=sys.stderr)
            return 2
        if why := mainargs.data_unavailable(args, "thc sweep"):
            print(why, file=sys.stderr)
            return 2
        try:
            out.mkdir(parents=True, exist_ok=True)
            json_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"thc sweep: cannot create {e.filename}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"thc sweep: {args.data}, {args.workers} workers, {args.steps} steps a run, "
              f"modes {', '.join(modes)} at {', '.join(f'{b:g}' for b in bws)} Mbit/s "
              f"({len(bws) * len(modes)} runs)", flush=True)
        started = time.time()
        try:
            with signals_raise():
                data = sweep(args, bws, modes, json_path)
        except (KeyboardInterrupt, Terminated) as e:
            how, code = stopped_by(e)
            done = json_path.exists() and json_path.stat().st_mtime >= started
            kept = (f"the bandwidths done are in {json_path} (`thc sweep --report` reads it)"
                    if done else "no bandwidth was done")
            print(f"\nthc sweep: {how}; {kept}", file=sys.stderr)
            return code
    try:
        thc = _thc_mode(data["modes"])
        if thc is None:
            print("thc sweep: no THC mode swept: no break-even to compute")
            return 1 if data["failed"] else 0
        data["tta_target"] = ("FP32's final accuracy minus one point" if args.target is None
                              else f"accuracy {args.target:g}")
        baselines = tuple(m for m in ("fp32", "fp16") if m in data["modes"])
        _drop_diverged(data)
        for p in data["points"]:
            p["tta_s"] = _tta(p["runs"], args.target)
        data["analysis"] = analyse(data, thc, baselines, args.agg_pps)
        table = markdown(data)
        failed = [f"{f['mode']} at {f['bw_mbit']:g} Mbit/s FAILED (not in the table): "
                  f"{f['error']}" for f in data["failed"]]
        print()
        print(table)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=1))
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        plot(data, plot_path)
    except DAMAGED as e:   # runs no break-even can be read from, or a damaged report
        what = f"lacks {e}" if isinstance(e, KeyError) else \
            f"{e}" if type(e) is ValueError else f"{type(e).__name__}: {e}"
        print(f"thc sweep: no analysis of the runs in {args.report or json_path}: {what}",
              file=sys.stderr)
        return 1
    print(f"\nwrote {json_path} and {plot_path}")
    for f in failed:
        print(f)
    return 1 if failed else 0
