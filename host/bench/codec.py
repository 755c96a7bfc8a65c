"""``thc bench codec``: THC encode/decode throughput against the FP16 cast and PowerSGD.

All figures are per core: torch.set_num_threads(1) and BLAS limited to one thread, measured
in the same run on the same 2^24-element float32 tensor (2^20 with --quick). MB/s counts the
float32 input (4 bytes per element, MB = 10^6 bytes); each figure is the median of --repeat
runs. Ratios are time / time of the FP16 cast (x.half().float()), so "3.0" means three times
as long as the cast.

PowerSGD is measured with the steps of torch's own hook
(torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook), without a process
group: error-feedback add and copy, orthogonalize Q (the hook's own ``_orthogonalize``),
P = M Q, orthogonalize P, Q = M^T P (compression), then M = P Q^T and the new error
(decompression), with M the tensor viewed as a square-ish matrix. The all-reduces between
the steps are left out, as THC's aggregation is.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

from host.bench import add_common, emit_json
from host.codec import thc as codec
from host.codec.params import THCParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=None,
                        help="elements (default 2^24, 2^20 with --quick)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--granularity", type=int, default=30)
    parser.add_argument("--ranks", default="1,4", help="PowerSGD ranks (default 1,4)")
    add_common(parser)


def _one_blas_thread():
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - scikit-learn (a dependency) brings it
        return contextlib.nullcontext()
    return threadpool_limits(1)


def _time_interleaved(ops: list[tuple[str, str, object]], repeat: int) -> dict[str, dict]:
    """Median and best time per op, running the ops round-robin so that a background load
    that comes and goes hits every op (and so every ratio) alike."""
    for _, _, fn in ops:
        fn()
    runs: dict[str, list[float]] = {name: [] for name, _, _ in ops}
    for _ in range(repeat):
        for name, _, fn in ops:
            t = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t)
    return {name: {"median_s": statistics.median(r), "best_s": min(r)}
            for name, r in runs.items()}


def _matrix_shape(n: int) -> tuple[int, int]:
    rows = 1 << ((n.bit_length() - 1) // 2)
    while n % rows:
        rows //= 2
    return rows, n // rows


def powersgd_steps(x, rank: int, seed: int = 0):
    """(compress, decompress) closures doing one PowerSGD step on x viewed as a matrix,
    with warm-started Q and error feedback, as the DDP hook does per bucket."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize
    n, m = _matrix_shape(x.numel())
    r = min(rank, n, m)
    grad = x.reshape(1, n, m)
    error = torch.zeros_like(grad)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, m, r, generator=gen)
    p = torch.empty(1, n, r)
    state: dict = {}

    def compress():
        tensor = grad + error
        state["copy"] = tensor.detach().clone()
        _orthogonalize(q)
        torch.bmm(tensor, q, out=p)
        _orthogonalize(p)
        torch.bmm(tensor.transpose(1, 2), p, out=q)
        state["tensor"] = tensor

    def decompress():
        tensor = state["tensor"]
        torch.bmm(p, q.transpose(1, 2), out=tensor)
        error.copy_(state["copy"] - tensor)

    return compress, decompress, (n, m, r)


def _thc_ops(codec, params, backend: str, x, n: int) -> list:
    """THC's steps on one backend; encode uses a new round each call (fresh diagonal)."""
    import numpy as np
    import torch
    m = codec.slice_norms(x, params)
    rng = np.random.default_rng(2) if backend == "numpy" else torch.Generator().manual_seed(2)
    rounds = iter(range(10 ** 9))
    idx = codec.encode(x, m, params, 0, rng)
    sums = codec.aggregate([idx], params)
    buf = torch.empty(n) if backend == "torch" else np.empty(n, np.float32)
    return [
        (f"THC norms ({backend})", backend, lambda: codec.slice_norms(x, params)),
        (f"THC encode ({backend})", backend,
         lambda: codec.encode(x, m, params, next(rounds), rng)),
        (f"THC decode ({backend})", backend, lambda: codec.decode(sums, 1, m, n, params, 0)),
        (f"THC decode into buffer ({backend})", backend,
         lambda: codec.decode(sums, 1, m, n, params, 0, out=buf)),
        (f"THC pack b={params.bits} ({backend})", backend,
         lambda: codec.pack_bits(idx, params.bits)),
    ]


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch


    n = args.size or (2 ** 20 if args.quick else 2 ** 24)
    repeat = max(1, min(args.repeat, 2) if args.quick else args.repeat)
    try:
        params = THCParams(bits=args.bits, granularity=args.granularity)
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError as e:
        print(f"thc bench codec: {e}")
        return 2
    if n < 1:
        print("thc bench codec: --size must be >= 1")
        return 2
    out = sys.stderr if args.json == "-" else sys.stdout
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    mb = 4 * n / 1e6
    ops: list[tuple[str, str, object]] = []
    pairs: list[tuple[str, str, str, str]] = []   # (combined name, group, first, second)
    try:
        with _one_blas_thread():
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(n, generator=gen)
            xn = x.numpy().copy()
            fp16_name = "fp16 cast (torch x.half().float())"
            ops.append((fp16_name, "baseline", lambda: x.half().float()))
            ops.append(("fp16 cast (numpy astype)", "baseline",
                        lambda: xn.astype(np.float16).astype(np.float32)))
            for backend, xx in (("torch", x), ("numpy", xn)):
                ops += _thc_ops(codec, params, backend, xx, n)
                pairs.append((f"THC encode+decode ({backend})", backend,
                              f"THC encode ({backend})", f"THC decode ({backend})"))
            for rank in ranks:
                comp, decomp, shape = powersgd_steps(x, rank)
                label = f"PowerSGD rank {rank} ({shape[0]}x{shape[1]})"
                ops.append((f"{label} compress", "powersgd", comp))
                ops.append((f"{label} decompress", "powersgd", decomp))
                pairs.append((f"{label} compress+decompress", "powersgd",
                              f"{label} compress", f"{label} decompress"))
            times = _time_interleaved(ops, repeat)
    finally:
        torch.set_num_threads(threads)

    rows: list[dict] = []
    for name, group, _ in ops:
        rows.append(dict(name=name, group=group, **times[name]))
    for name, group, first, second in pairs:
        med = times[first]["median_s"] + times[second]["median_s"]
        best = times[first]["best_s"] + times[second]["best_s"]
        at = max(i for i, r in enumerate(rows) if r["name"] in (first, second)) + 1
        rows.insert(at, {"name": name, "group": group, "median_s": med, "best_s": best})
    fp16 = times[fp16_name]
    for r in rows:
        r["mb_per_s"] = mb / r["median_s"]
        r["ratio_to_fp16"] = r["median_s"] / fp16["median_s"]
    print(f"codec throughput, {n} float32 elements ({mb:.1f} MB), one core, "
          f"median of {repeat}; THC {params.describe()}", file=out)
    head = f"{'operation':<48} {'ms':>9} {'MB/s':>9} {'x fp16':>8}"
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        print(f"{r['name']:<48} {r['median_s'] * 1e3:>9.1f} {r['mb_per_s']:>9.0f} "
              f"{r['ratio_to_fp16']:>8.1f}", file=out)
    emit_json(args, {"elements": n, "mb": mb, "repeat": repeat, "threads": 1,
                     "params": {"bits": params.bits, "granularity": params.granularity,
                                "p": params.p},
                     "torch": torch.__version__, "results": rows})
    return 0
