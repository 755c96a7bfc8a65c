"""What the main job's runs show: the time to a target accuracy against FP32 and the verdict,
DLCP's step time against its baseline, every step's loss, each mode through BMv2 against its
twin in software, the table printed, the plot of accuracy against training time and bytes, and the
report (``out/mainjob.json``) written whole or kept elsewhere."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from thc.bench import figure, provenance, save_figure


def step_losses(run: dict) -> list[float]:
    """Every training step's loss of a mode, from its evaluation rows (each row carries the
    steps since the row before)."""
    return [x for row in run["history"] for x in row.get("step_losses", [])]


EPS = 1e-9
"""Accuracies are counts of test images over their number, targets one point below such a
count: compared within this, 0.4997 reaches 0.5097 - 0.01 (0.49969999... in floats)."""


def time_to(history: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation reaching ``target`` (None: never)."""
    return next((r["seconds"] for r in history if r["accuracy"] >= target - EPS), None)


def summarize(runs: list[dict], fixed: float, chance: float = 0.1) -> dict:
    """Time-to-accuracy table against FP32, and the verdict. ``chance``: the accuracy of a
    guess (the main job's data sets have 10 classes); an FP32 run that ends below twice it
    has not learnt, and its final accuracy is no target to race to."""
    base = next((r for r in runs if r["mode"] == "fp32"), None)
    target = base["final_accuracy"] - 0.01 if base else None
    rows = []
    for r in runs:
        row = {"mode": r["mode"], "final_accuracy": r["final_accuracy"],
               "train_seconds": r["train_seconds"], "wire_mb": r["wire_bytes"] / 1e6,
               "epochs_done": r["epochs_done"], "stopped": r["stopped"],
               "diverged_at": r.get("replicas_diverged_at"),
               "tta_fixed": time_to(r["history"], fixed)}
        if base:
            row["tta_fp32_minus_1pt"] = time_to(r["history"], target)
        rows.append(row)
    verdict = "no FP32 run: no comparison"
    unlearnt = base is not None and base["final_accuracy"] < 2 * chance
    diverged = base is not None and base.get("replicas_diverged_at") is not None
    if base and (base["stopped"] or unlearnt or diverged):
        # its final accuracy is where it stopped, near chance, or no one model's: no target,
        # no speedup
        verdict = (f"FP32 stopped at the time limit (epoch {base['epochs_done']}): no "
                   f"speedup against it is claimed" if base["stopped"] else
                   f"FP32's workers' replicas differed after step "
                   f"{base['replicas_diverged_at']}: it trained no one model, so no speedup "
                   f"against it is claimed" if diverged else
                   f"FP32 ended at {base['final_accuracy']:.4f}, below twice chance "
                   f"({2 * chance:g}): it did not learn in {base['history'][-1]['steps']} "
                   f"steps, so no speedup against it is claimed (train longer, or on "
                   f"Fashion-MNIST)")
        target = None
        for row in rows:
            row["tta_fp32_minus_1pt"] = row["speedup"] = None
            row["accuracy_vs_fp32_pp"] = 100 * (row["final_accuracy"] - base["final_accuracy"])
    elif base:
        b = time_to(base["history"], target)
        for row in rows:
            t = row["tta_fp32_minus_1pt"]
            row["accuracy_vs_fp32_pp"] = 100 * (row["final_accuracy"] - base["final_accuracy"])
            # a mode whose workers' replicas differed trained no one model, and a stopped
            # one no whole run: neither wins, nor has a speedup to print
            whole = not row["stopped"] and row["diverged_at"] is None
            row["speedup"] = (b / t) if (b and t and whole) else None
        fair = [row for row in rows if row["tta_fp32_minus_1pt"] is not None
                and row["final_accuracy"] >= target - EPS and not row["stopped"]
                and row["diverged_at"] is None]
        win = min(fair, key=lambda row: row["tta_fp32_minus_1pt"], default=None)
        if all(row["mode"] == "fp32" for row in rows):   # the others failed or never ran
            verdict = "no mode but FP32 ran to a report: nothing to compare it with"
        elif win is not None and win["mode"] == "fp32":
            rest = [row for row in fair if row["mode"] != "fp32"]
            best = min(rest, key=lambda row: row["tta_fp32_minus_1pt"], default=None)
            verdict = (f"no mode beat FP32: it reached {target:.4f} (its final accuracy minus "
                       f"1 point) in {b:.1f} s of training"
                       + (f"; the soonest other, {best['mode']}, in "
                          f"{best['tta_fp32_minus_1pt']:.1f} s ({best['speedup']:.2f}x)"
                          if best else ""))
        elif win is not None:
            verdict = (f"{win['mode']} won: it reached {target:.4f} (FP32's final accuracy "
                       f"minus 1 point) in {win['tta_fp32_minus_1pt']:.1f} s of training, "
                       f"{win['speedup']:.2f}x sooner than FP32 ({b:.1f} s), and ended at "
                       f"{win['final_accuracy']:.4f} ({win['accuracy_vs_fp32_pp']:+.2f} pp "
                       f"against FP32)")
        else:
            verdict = "no mode reached FP32's final accuracy minus 1 point"
    return {"target_fp32_minus_1pt": target, "target_fixed": fixed, "rows": rows,
            "verdict": verdict}


def dlcp_ratios(runs: list[dict]) -> list[dict]:
    """Each DLCP mode's chunks closed short and seconds per step (a step: the rounds of every
    bucket), against the retransmit-everything baseline of the same run (``thc-central``,
    else ``thc``) where one ran, and its accuracy at the last evaluation both reached (same
    step count)."""
    base = next((r for m in ("thc-central", "thc") for r in runs if r["mode"] == m), None)

    def per_step(r):
        return r["history"][-1]["seconds"] / max(1, r["history"][-1]["steps"])

    out = []
    for r in runs:
        if not r.get("loss_bound"):
            continue
        row = {"mode": r["mode"], "baseline": base and base["mode"],
               "step_seconds": per_step(r), "short_chunks": r.get("short_chunks")}
        if base:
            steps = {h["steps"]: h for h in base["history"]}
            common = [h for h in r["history"] if h["steps"] in steps]
            row.update(baseline_step_seconds=per_step(base),
                       speedup=per_step(base) / per_step(r) if per_step(r) else None)
            if common:
                h = common[-1]
                row.update(at_step=h["steps"], accuracy=h["accuracy"],
                           baseline_accuracy=steps[h["steps"]]["accuracy"])
        out.append(row)
    return out


def print_table(runs: list[dict], summary: dict) -> None:
    """The modes' table (final accuracy, training time, bytes, time to the targets and the
    speedup over FP32), the DLCP modes' step times against their baseline, and the verdict."""
    # links counted on Mininet; on the loopback, what rank 0 sent and received (wire_source)
    volume = "MB links" if all(r["wire_source"].startswith("worker links") for r in runs) \
        else "MB rank 0"
    print(f"\n{'mode':<16} {'testbed':<9} {'final acc':>9} {'train s':>8} {volume:>9} "
          f"{'t->fp32-1pt':>11} {'speedup':>8} {'t->' + format(summary['target_fixed'], 'g'):>8}")
    for r, row in zip(runs, summary["rows"]):
        tta = row.get("tta_fp32_minus_1pt")
        fixed = row["tta_fixed"]
        speed = row.get("speedup")
        print(f"{r['mode']:<16} {r['testbed']:<9} {r['final_accuracy']:>9.4f} "
              f"{r['train_seconds']:>8.1f} {r['wire_bytes'] / 1e6:>9.1f} "
              f"{(f'{tta:.1f}' if tta is not None else '-'):>11} "
              f"{(f'{speed:.2f}x' if speed else '-'):>8} "
              f"{(f'{fixed:.1f}' if fixed is not None else '-'):>8}")
    print(f"bytes: {runs[0]['wire_source'] if runs else '-'}")
    windows = [f"{r['mode']} {t['compiled_rounds']} of {t['rounds']}" for r in runs
               if (t := r["history"][-1].get("transport")) and "rounds" in t]
    if windows:   # an impaired round runs on Python's
        print(f"rounds on the compiled client window, the rest on Python's (rank 0): "
              f"{', '.join(windows)}")
    served = [f"{r['mode']} {r['aggregator_datapath']}" for r in runs
              if r.get("aggregator_datapath")]
    if served:   # the Python one is several times slower a packet: its time is in train s
        print(f"software aggregators' datapath: {'; '.join(served)}")
    for r in runs:
        if r["stopped"]:
            print(f"{r['mode']}: {r['stopped']} after {r['history'][-1]['steps']} steps, not "
                  f"a finished run (it never wins)")
    for row, r in zip(summary["dlcp"], [r for r in runs if r["loss_bound"]]):
        at = (f"; at step {row['at_step']} accuracy {row['accuracy']:.4f} against "
              f"{row['baseline_accuracy']:.4f}" if "at_step" in row else "")
        versus = ("no thc or thc-central run to compare it with" if not row["baseline"] else
                  f"{row['baseline']}'s {row['baseline_step_seconds']:.2f} s (same run){at}"
                  if row["speedup"] is None else
                  f"{row['speedup']:.2f}x {row['baseline']}'s "
                  f"{row['baseline_step_seconds']:.2f} s (same run){at}")
        print(f"{r['mode']}: loss bound {r['loss_bound']:g}, {row['short_chunks'] or 0} chunks "
              f"closed short (rank 0); {row['step_seconds']:.2f} s a step, {versus}")
    print(summary["verdict"])


BMV2_TWINS = {"thc-bmv2": "thc", "marsit-vote-bmv2": "marsit-vote"}
"""Each mode through BMv2 and its mode through the software aggregators: the switch's sums
are the software's, so their losses are equal step by step."""


def compare_bmv2(runs: list[dict]) -> list[dict]:
    """Each mode through BMv2 against its twin through the software aggregators, step by
    step, printed; one comparison for each pair that ran."""
    by_mode = {r["mode"]: r for r in runs}
    out = []
    for hw_mode, sw_mode in BMV2_TWINS.items():
        hw, sw = by_mode.get(hw_mode), by_mode.get(sw_mode)
        if hw and not sw:
            print(f"{hw_mode}: no {sw_mode} run to compare its losses with")
        if not (sw and hw):
            continue
        a, b = step_losses(sw), step_losses(hw)
        k = min(len(a), len(b))
        same = k > 0 and a[:k] == b[:k]
        compared = {"bmv2": hw_mode, "software": sw_mode, "steps_compared": k,
                    "identical_losses": same,
                    "first_difference": None if same else next(
                        (i + 1 for i in range(k) if a[i] != b[i]), None),
                    "bmv2_step_bound": hw["step_bound"]}
        bounded = f" (bounded to {hw['step_bound']} steps)" if hw["step_bound"] else ""
        print(f"{hw_mode}{bounded} vs {sw_mode}, first {k} training steps: "
              + ("identical losses (the switch's sums are bit-identical to the software "
                 "aggregator's)" if same else
                 f"DIFFERENT losses from step {compared['first_difference']}"
                 if k else "no step to compare"))
        out.append(compared)
    return out


def plot(runs: list[dict], path: Path, title: str, recorded: dict | None = None) -> None:
    fig, axes = figure(12, 4.5, 2)
    ax_t, ax_b = axes[0]
    for r in runs:
        h = r["history"]
        if r.get("step_bound") and r["stopped"]:
            label = f"{r['mode']} ({h[-1]['steps']} steps, bounded)"
        elif r["stopped"]:
            label = f"{r['mode']} (stopped at epoch {r['epochs_done']:.2f})"
        else:
            label = f"{r['mode']} ({r['final_accuracy']:.3f})"
        scale = r["wire_bytes"] / max(1, h[-1]["steps"]) / 1e6
        ax_t.plot([x["seconds"] for x in h], [x["accuracy"] for x in h], marker="o",
                  label=label)
        ax_b.plot([x["steps"] * scale for x in h], [x["accuracy"] for x in h], marker="o",
                  label=label)
    ax_t.set_xlabel("training time (s)")
    times = [x["seconds"] for r in runs for x in r["history"] if x["seconds"] > 0]
    if times and max(times) > 10 * min(times):
        ax_t.set_xscale("log")  # BMv2's modes take tens of times longer than the others
    ax_b.set_xlabel("MB on worker links, both directions" if not runs or
                    runs[0]["wire_source"].startswith("worker links") else
                    "MB rank 0 sent and received (the loopback has no links)")
    ax_b.set_xscale("log")
    for ax in (ax_t, ax_b):
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        if runs:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no mode finished", ha="center", transform=ax.transAxes)
    fig.suptitle(title)
    save_figure(fig, path, recorded)


FIXED_TARGET = {"fashion-mnist": 0.80, "digits": 0.95}
"""The fixed accuracy target of the time-to-accuracy table, per data set."""


def conclude(args: argparse.Namespace, runs: list[dict], failed: list[dict], probe,
            out: Path, stopped: str | None = None) -> int:
    """The table, the checks and the report of the modes run (``stopped``: why the modes
    after them were not); the exit status of a run that was not stopped."""
    dataset = runs[0]["dataset"] if runs else args.data
    summary = summarize(runs, FIXED_TARGET.get(dataset, 0.9))
    summary["dlcp"] = dlcp_ratios(runs)
    print_table(runs, summary)
    summary["bmv2_vs_software"] = compare_bmv2(runs)
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


def failed_checks(runs: list[dict], summary: dict) -> list[str]:
    """The main job's checks that failed: a mode whose workers' parameters differed, a BMv2
    mode's losses unlike its twin's through the software aggregators. A run that failed one
    exits nonzero, as a mode that failed does, though every mode is in the table."""
    out = [f"{r['mode']}: the workers' parameters differed after step "
           f"{r['replicas_diverged_at']}" for r in runs if r["replicas_diverged_at"] is not None]
    for v in summary.get("bmv2_vs_software", []):
        if not v["identical_losses"]:
            out.append(f"{v['bmv2']}'s losses differ from {v['software']}'s from step "
                       f"{v['first_difference']} of {v['steps_compared']} compared"
                       if v["steps_compared"] else
                       f"{v['bmv2']} took no step to compare with {v['software']}")
    return out


def print_mode(run_: dict, epochs: int) -> None:
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


def _keep_elsewhere(text: str) -> str:
    """Where the report went instead: a temporary directory, or, where that cannot take it
    either (one full disk), standard output."""
    kept = None
    try:
        kept = Path(tempfile.mkdtemp(prefix="thc-run-")) / "mainjob.json"
        _write_whole(kept, text)
        return f"the report of the runs is kept in {kept}"
    except OSError as e:
        if kept is not None:   # an empty folder is no report
            shutil.rmtree(kept.parent, ignore_errors=True)
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
