"""``thc nmse`` / ``thc bench nmse``: accuracy of THC against the baselines on synthetic vectors.

NMSE = ||mean - estimate||^2 / mean_i ||x_i||^2 for n workers with independent vectors, each
scheme seeing the same vectors in a trial. THC's own figures are printed next to the
figures of an independent numpy implementation (d = 2^18) and to the analytic model of
thc.codec.table.
``--plot FILE`` draws NMSE against bits per coordinate (THC and UHC at b = 2..8 with p tuned
per b by the analytic model, QSGD at several s, TopK at several ratios, TernGrad, sign, FP16).
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from thc.argtypes import memory_refusal, positive_int, positive_ints
from thc.bench import add_common, emit_json, figure, save_figure
from thc.codec.baselines import make_scheme
from thc.codec.params import THCParams
from thc.codec.table import expected_nmse, optimal_table, uniform_table
from thc.wire import protocol as P

DEFAULT_SCHEMES = "thc,uhc,qsgd,terngrad,topk,sign,fp16"
REFERENCE = {"thc": {1: 0.0204, 10: 0.0020}, "uhc": {1: 0.0206, 10: 0.0021},
             "qsgd": {1: 0.079, 10: 0.0079}}
"""An independent numpy implementation's figures (b=4, g=30, p=1/32, QSGD s=7; Gaussian
vectors, d = 2^18)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    THCParams.add_arguments(parser)
    parser.add_argument("--dim", type=positive_int, default=None,
                        help="vector length (default 2^18; 2^14 with --quick)")
    parser.add_argument("--workers", type=positive_ints, default="1,10",
                        help="comma-separated worker counts (default 1,10)")
    parser.add_argument("--dist", choices=("normal", "lognormal"), default="normal")
    parser.add_argument("--trials", type=positive_int, default=None,
                        help="independent trials per point (default 3; 2 with --quick)")
    parser.add_argument("--schemes", default=DEFAULT_SCHEMES,
                        help="comma-separated scheme specs, e.g. thc,uhc:p=1/1024,qsgd:s=15 "
                             f"(default {DEFAULT_SCHEMES})")
    add_common(parser, plot="out/nmse.png")


def make_vectors(rng: np.random.Generator, n: int, dim: int, dist: str) -> list[np.ndarray]:
    if dist == "lognormal":
        return [rng.lognormal(0.0, 1.0, dim).astype(np.float32) for _ in range(n)]
    return [rng.standard_normal(dim, dtype=np.float32) for _ in range(n)]


def nmse(xs: list[np.ndarray], estimate) -> float:
    est = estimate.numpy() if hasattr(estimate, "numpy") else np.asarray(estimate)
    stack = np.stack(xs).astype(np.float64)
    mean = stack.mean(axis=0)
    return float(np.sum((mean - est.astype(np.float64)) ** 2)
                 / np.mean(np.sum(stack * stack, axis=1)))


def measure(scheme, workers: list[int], dim: int, dist: str, trials: int, seed: int) -> dict:
    """Mean NMSE over trials per worker count (same vectors for every scheme given the seed)."""
    import torch
    out = {}
    for n in workers:
        vals = []
        for trial in range(trials):
            rng = np.random.default_rng([seed, n, trial])
            xs = make_vectors(rng, n, dim, dist)
            est = scheme.aggregate_mean([torch.from_numpy(x) for x in xs],
                                        rng=np.random.default_rng([seed, n, trial, 1]))
            vals.append(nmse(xs, est))
        out[n] = {"nmse": float(np.mean(vals)),
                  "stderr": float(np.std(vals, ddof=1) / math.sqrt(len(vals)))
                  if len(vals) > 1 else None}
    return out


def best_p(bits: int, granularity: int, kind: str) -> float:
    """The truncation probability 2^-k (k = 3..14) with the lowest modelled NMSE."""
    cands = [2.0 ** -k for k in range(3, 15)]

    def model(p: float) -> float:
        table = uniform_table(bits, granularity) if kind == "uniform" \
            else optimal_table(bits, granularity, p)
        return expected_nmse(table, p, granularity)
    return min(cands, key=model)


def sweep_specs(quick: bool) -> list[tuple[str, str]]:
    """(family, spec) pairs for the plot."""
    specs = []
    bit_range = (2, 4, 8) if quick else range(2, 9)
    for b in bit_range:
        g = 2 * ((1 << b) - 1)
        specs.append(("THC", f"thc:bits={b}:granularity={g}:p={best_p(b, g, 'optimal')!r}"))
        specs.append(("UHC", f"uhc:bits={b}:granularity={g}:p={best_p(b, g, 'uniform')!r}"))
    for s in ((3, 7, 127) if quick else (3, 7, 15, 31, 127)):
        specs.append(("QSGD", f"qsgd:s={s}"))
    for r in ((0.1,) if quick else (0.01, 0.03, 0.1)):
        specs.append(("TopK", f"topk:ratio={r}:error_feedback=false"))
    specs += [("TernGrad", "terngrad"), ("sign", "sign"), ("FP16", "fp16")]
    return specs


def plot(sweep: list[dict], workers: list[int], path: str, title: str) -> None:
    fig, axes = figure(6 * len(workers), 4.5, len(workers))
    families = list(dict.fromkeys(r["family"] for r in sweep))
    markers = dict(zip(families, "osD^v<>px*"))
    for ax, n in zip(axes[0], workers):
        for fam in families:
            pts = sorted((r["bits_per_coord"], r["nmse"][str(n)]) for r in sweep
                         if r["family"] == fam)
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker=markers[fam], label=fam,
                    linestyle="-" if len(pts) > 1 else "none")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bits per coordinate (uplink)")
        ax.set_ylabel("NMSE")
        ax.set_title(f"{title}, n = {n}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    """One intra-op thread: the vectors are small enough that torch's thread pool costs more
    than it gives (80x slower element-wise ops seen on a busy two-core machine)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


BYTES_PER_ELEMENT = 24
"""Memory a point takes per worker and element, an estimate (20 measured at 100 to 400
workers of 2^16: the vectors, their float64 stack, a scheme's work)."""


def _check_memory(workers: int, dim: int) -> None:
    """ValueError where the largest point would not fit the memory available."""
    if why := memory_refusal(BYTES_PER_ELEMENT * workers * dim,
                             f"--workers {workers} of --dim {dim}"):
        raise ValueError(why)


def _run(args: argparse.Namespace) -> int:
    prog = getattr(args, "command", "thc nmse")
    workers = args.workers
    dim = args.dim if args.dim is not None else 2 ** (14 if args.quick else 18)
    trials = args.trials if args.trials is not None else 2 if args.quick else 3
    specs = [s.strip() for s in args.schemes.split(",") if s.strip()]
    try:
        params = THCParams.from_args(args)
        if not specs:
            raise ValueError(f"--schemes {args.schemes!r} names no scheme")
        thc_kw = {"bits": params.bits, "granularity": params.granularity, "p": params.p,
                  "seed": params.seed}
        schemes = [make_scheme(spec, thc_kw if spec.split(":")[0].strip() in ("thc", "uhc")
                               else None)
                   for spec in specs]     # every spec checked before the first is measured
        _check_memory(max(workers), dim)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = []
    for spec, scheme in zip(specs, schemes):
        name = spec.split(":")[0]
        res = measure(scheme, workers, dim, args.dist, trials, params.seed)
        row = {"spec": spec, "scheme": scheme.describe(), "name": name,
               "bits_per_coord": scheme.bits_per_coord(dim),
               "nmse": {str(n): r["nmse"] for n, r in res.items()},
               "stderr": {str(n): r["stderr"] for n, r in res.items()}}
        if name in ("thc", "uhc"):
            table = scheme.params.table
            one = expected_nmse(table, scheme.params.p, scheme.params.granularity)
            row["model"] = {str(n): one / n for n in workers}
        ref = REFERENCE.get(name)
        defaults = (params.bits, params.granularity, params.p) == (4, 30, 1 / 32)
        # QSGD's error grows with d (THC's slices do not): its figure holds at 2^18 only
        if ref and args.dist == "normal" and ":" not in spec and \
                (dim == 2 ** 18 if name == "qsgd" else defaults):
            row["reference"] = {str(n): ref[n] for n in workers if n in ref}
        rows.append(row)
    result = {"dim": dim, "dist": args.dist, "trials": trials, "workers": workers,
              "params": {"bits": params.bits, "granularity": params.granularity,
                         "p": params.p, "t_p": params.t_p, "seed": params.seed},
              "results": rows}

    width = max([34] + [len(row["scheme"]) for row in rows])
    head = f"{'scheme':<{width}} {'bits up':>7}" + "".join(f" {'n=' + str(n):>10}"
                                                         for n in workers)
    print(f"NMSE, {args.dist} vectors, d = {dim}, {trials} trial(s); "
          f"THC {params.describe()}; bits up: a coordinate's uplink, norms included")
    print(head)
    print("-" * len(head))
    for row in rows:
        line = f"{row['scheme']:<{width}} {row['bits_per_coord']:>7.2f}"
        line += "".join(f" {row['nmse'][str(n)]:>10.4g}" for n in workers)
        print(line)
        for label, shown in (("model", "model"), ("reference", "reference, d = 2^18")):
            if label in row:
                vals = "".join(f" {row[label].get(str(n), float('nan')):>10.4g}"
                               for n in workers)
                print(f"{'  ' + shown:<{width}} {'':>6}{vals}")

    down = {}
    for n in workers:
        try:
            down[str(n)] = P.sum_bits_for(n, params.granularity)
        except ValueError:
            down[str(n)] = None
    result["thc_bits_down"] = down
    print("bits down: THC's, the sums a coordinate ("
          + ", ".join(f"n={n}: {b if b else 'over 16-bit sums'}" for n, b in down.items())
          + "); the others' depend on the exchange (a parameter server's FP32 mean, an "
            "all-gather of every worker's payload)")

    if args.plot:
        sweep = []
        for fam, spec in sweep_specs(args.quick):
            scheme = make_scheme(spec)
            res = measure(scheme, workers, dim, args.dist, trials, params.seed)
            sweep.append({"family": fam, "spec": spec, "bits_per_coord":
                          scheme.bits_per_coord(dim),
                          "nmse": {str(n): r["nmse"] for n, r in res.items()}})
        plot(sweep, workers, args.plot, f"{args.dist}, d = {dim}")
        result["sweep"] = sweep
        print(f"wrote {args.plot}")
    result["seconds"] = time.perf_counter() - t0
    emit_json(args, result)
    return 0
