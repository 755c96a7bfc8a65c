"""``thc run``: the main job. Train the same model with each gradient exchange and compare.

Modes: uncompressed FP32 (DDP's Gloo all-reduce), THC through the software aggregator,
THC through the BMv2 switch (when p4c/BMv2 and Mininet are present), and TopK 10% as a
compression baseline. Workers run in Mininet hosts behind emulated links when possible,
else as loopback processes (said so). Prints accuracy per epoch, wall time and bytes on the
wire, a summary table, and plots accuracy against time.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from host.wire.protocol import MAX_SOFTWARE_LANES
from thcnet.testbed import bmv2_unavailable_reason, open_testbed

MODES = {
    "fp32": ("fp32", "none", "uncompressed FP32 all-reduce (Gloo)"),
    "thc": ("thc", "software", "THC through the software aggregator"),
    "thc-bmv2": ("thc", "bmv2", "THC through the BMv2 switch"),
    "topk": ("topk", "none", "TopK 10% with error feedback (all-gather)"),
    "thc-dist": ("thc-dist", "none", "THC integer sums over the Gloo all-reduce"),
}
DEFAULT_MODES = "fp32,thc,thc-bmv2,topk"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"comma-separated, from {','.join(MODES)}")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--bmv2-steps", type=int, default=None,
                        help="training steps for thc-bmv2 (default: one epoch; BMv2 forwards "
                             "1-5k packets/s); its losses are compared step by step with the "
                             "software run")
    parser.add_argument("--bw", type=float, default=100.0, help="link bandwidth, Mbit/s")
    parser.add_argument("--delay", type=float, default=0.0,
                        help="link delay, ms (needs netem in the kernel)")
    parser.add_argument("--loss", type=float, default=0.0, help="link loss, percent")
    parser.add_argument("--loopback", action="store_true",
                        help="do not use Mininet even where it is available")
    parser.add_argument("--software-lanes", type=int, default=0,
                        help="lanes per packet for the software aggregator (default 0: the "
                             f"most that fit one MTU, {MAX_SOFTWARE_LANES} for 8-bit sums, "
                             "half for 16-bit)")
    parser.add_argument("--out", default="out", help="directory for JSON and plot")
    parser.add_argument("--timeout", type=float, default=900.0, help="per-mode limit, seconds")


def _run_mode(name: str, args, progress) -> dict:

    train_mode, aggregator, _ = MODES[name]
    epochs = 1 if aggregator == "bmv2" else args.epochs
    # The switch is compiled for protocol.json's lanes; software takes the largest packets.
    lanes = args.software_lanes if aggregator == "software" else None
    with open_testbed(args.workers, bw_mbit=args.bw, delay_ms=args.delay, loss_pct=args.loss,
                      aggregator=aggregator, prefer_mininet=not args.loopback,
                      lanes=lanes) as tb:
        tmp = Path(tempfile.mkdtemp(prefix="thc-run-"))
        cfg = tmp / "cluster.json"
        tb.cluster.save(cfg)
        if aggregator != "none":
            tb.start_aggregator()
        master = f"{tb.master_addr[0]}:{tb.master_addr[1]}"

        def argv(rank: int) -> list[str]:
            a = [sys.executable, "-m", "host.app.train", "--mode", train_mode, "--rank", str(rank),
                 "--world", str(args.workers), "--master", master, "--epochs", str(epochs),
                 "--config", str(cfg)]
            if tb.agg_addr is not None:
                a += ["--agg", f"{tb.agg_addr[0]}:{tb.agg_addr[1]}"]
            if aggregator == "bmv2" and args.bmv2_steps:
                a += ["--max-steps", str(args.bmv2_steps)]
            return a

        def on_line(rank: int, line: str) -> None:
            if rank == 0 and line.startswith("{"):
                row = json.loads(line)
                progress.update(1)
                progress.set_postfix(acc=f"{row['accuracy']:.3f}", t=f"{row['seconds']:.0f}s")

        before = tb.wire_bytes()
        t0 = time.perf_counter()
        results = tb.run_workers(argv, timeout=args.timeout, on_line=on_line)
        wall = time.perf_counter() - t0
        after = tb.wire_bytes()
        kind = tb.kind
    history = [json.loads(line) for line in results[0].stdout.splitlines()
               if line.startswith("{")]
    if after:
        wire = sum(after[w][0] - before[w][0] for w in after)
        wire_source = "interface counters"
    else:
        wire = sum(json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
                   ["bytes_sent"] for r in results)
        wire_source = "transport counters"
    return {"mode": name, "testbed": kind, "history": history, "wall_seconds": wall,
            "train_seconds": history[-1]["seconds"], "final_accuracy": history[-1]["accuracy"],
            "wire_bytes_sent": int(wire), "wire_source": wire_source}


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        h = r["history"]
        ax.plot([0] + [x["seconds"] for x in h], [0.1] + [x["accuracy"] for x in h],
                marker="o", label=f"{r['mode']} ({h[-1]['steps']} steps only)"
                if MODES[r["mode"]][1] == "bmv2" else f"{r['mode']} ({r['final_accuracy']:.3f})")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.8, 1.0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("digits CNN, data-parallel: accuracy against time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"thc run: unknown mode(s) {unknown}; choose from {list(MODES)}", file=sys.stderr)
        return 2
    if "thc-bmv2" in modes and (why := bmv2_unavailable_reason()):
        print(f"thc run: skipping thc-bmv2: {why}")
        modes.remove("thc-bmv2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for name in modes:
        print(f"\n== {name}: {MODES[name][2]}", flush=True)
        epochs = 1 if MODES[name][1] == "bmv2" else args.epochs
        with tqdm(total=epochs, desc=name, unit="epoch", file=sys.stdout) as bar:
            run_ = _run_mode(name, args, bar)
        runs.append(run_)
        print(f"{'epoch':>5} {'accuracy':>9} {'seconds':>8}")
        for row in run_["history"]:
            print(f"{row['epoch']:>5} {row['accuracy']:>9.4f} {row['seconds']:>8.1f}")
    base = next((r for r in runs if r["mode"] == "fp32"), None)
    print(f"\n{'mode':<9} {'testbed':<9} {'final acc':>9} {'train s':>8} {'MB sent':>9} "
          f"{'vs fp32 bytes':>13}")
    for r in runs:
        partial = MODES[r["mode"]][1] == "bmv2"
        ratio = (f"{base['wire_bytes_sent'] / r['wire_bytes_sent']:.2f}x"
                 if base and r["wire_bytes_sent"] and not partial else
                 f"{r['history'][-1]['steps']} steps" if partial else "-")
        print(f"{r['mode']:<9} {r['testbed']:<9} {r['final_accuracy']:>9.4f} "
              f"{r['train_seconds']:>8.1f} {r['wire_bytes_sent'] / 1e6:>9.1f} {ratio:>13}")
    if base:
        for r in runs:
            if r["mode"].startswith("thc") and MODES[r["mode"]][1] != "bmv2":
                diff = 100 * (r["final_accuracy"] - base["final_accuracy"])
                verdict = "within 1 pp" if diff >= -1.0 else "MORE than 1 pp below"
                print(f"{r['mode']}: final accuracy {r['final_accuracy']:.4f} vs FP32 "
                      f"{base['final_accuracy']:.4f}: {diff:+.2f} pp ({verdict})")
    sw = next((r for r in runs if r["mode"] == "thc"), None)
    hw = next((r for r in runs if r["mode"] == "thc-bmv2"), None)
    if sw and hw:
        a, b = sw["history"][0]["step_losses"], hw["history"][-1]["step_losses"]
        k = min(len(a), len(b))
        same = k > 0 and a[:k] == b[:k]
        print(f"thc-bmv2 vs thc, first {k} training steps: "
              + ("identical losses (the switch's sums are bit-identical to the software "
                 "aggregator's)" if same else f"DIFFERENT losses: {a[:k]} vs {b[:k]}"))
    (out / "mainjob.json").write_text(json.dumps({"runs": runs, "args": vars(args)}, indent=2))
    _plot(runs, out / "mainjob.png")
    print(f"\nwrote {out / 'mainjob.json'} and {out / 'mainjob.png'}")
    return 0
