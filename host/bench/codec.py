"""``thc bench codec``: THC encode/decode throughput against a device copy and the FP16 cast.

For each size (2^20..2^26 float32 elements by default) the same run measures, on the same
tensor: a device copy (``x.clone()``, the memory-speed yardstick), the FP16 round trip
(``x.half().float()``), THC's norms, encode (norms + encode + packing to the wire form:
``prepare`` then ``encode_prepared``, the MAX round between them left out), decode (of four
workers' sums) and encode+decode, and PowerSGD. Figures are GB/s of float32
input (4 bytes per element, GB = 10^9 bytes) from the median of --repeat runs, and the speed
relative to the copy (1.0: as fast as copying the tensor once).

On a GPU the codec defers its input checks (no call waits for the device; the checks are read
once after the timing) and decode gets the sums in the narrowest integer type (uint8 for 4
workers at g = 30), as the torch.distributed transport delivers them. Two more rows per size
replay the copy and THC encode+decode from CUDA graphs over distinct inputs (``..., CUDA
graph``; their "of copy" is against the graph's copy): the device's time without launch or
Python costs, what a small bucket costs a hook captured in a graph. ``--configs`` replays
them again under other settings of the kernels (``thc bench kernels --configs``' syntax):
the figure to choose settings by at small sizes, where single kernels' times scatter.

``--device cpu`` (the default) runs on one core (torch.set_num_threads(1), BLAS limited to one
thread; the compiled codec is single-threaded), torch and numpy, each through the compiled
codec (``--backend auto``, host/codec/fastcodec.py) and, for comparison in the same run, the
reference path (``--reference``, on by default). ``--device cuda`` runs the fused Triton
kernels (``--backend auto``) and, with ``--reference`` (the default there too), the reference
path on the GPU. Labels name the path that ran ("compiled", "triton", "reference").
``--backend triton`` on the CPU times Triton's interpreter (TRITON_INTERPRET=1): a check that
the kernels run, not a speed.

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

from thc.argtypes import memory_refusal, positive_int, torch_device
from thc.bench import add_common, device_memory, emit_json, figure, save_figure
from thc.bench.tiles import applied, parse_configs
from thc.codec import backends, settings
from thc.codec.common import wire_sum_dtype
from thc.codec.params import THCParams
from thc.codec.thc import THCCodec


def ranks(text: str) -> list[int]:
    """Comma-separated PowerSGD ranks, each at least 1 (a rank-0 PowerSGD sends nothing and
    is no baseline); '' for none."""
    return [positive_int(r.strip()) for r in text.split(",") if r.strip()]


BYTES_PER_ELEMENT = 16
"""Memory a size takes per element, an estimate: the float32 input, its encoding, decoding
and a baseline's copy."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=torch_device, default="cpu",
                        help="cpu (default, one core) or cuda (or cuda:N)")
    parser.add_argument("--backend", choices=backends.BACKENDS,
                        default="auto", help="THC path: auto (compiled on the CPU, kernels on "
                        "CUDA), reference, compiled, triton")
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the reference path (default: yes)")
    parser.add_argument("--sizes", default=None,
                        help="log2 sizes, e.g. 20-26 or 20,24 (default 20-26; 16 with --quick)")
    parser.add_argument("--size", type=positive_int, default=None, help="one size in elements")
    parser.add_argument("--repeat", type=positive_int, default=None,
                        help="runs per figure, the median kept (default 5; 2 with --quick)")
    THCParams.add_arguments(parser, seed=False)
    parser.add_argument("--configs", default="",
                        help="cuda only: kernel settings to replay the CUDA-graph rows under "
                             "as well, ';' between them, e.g. 'COLS_LOG=0,TILE=1024;"
                             "NUM_WARPS=8' (see thc bench kernels --configs)")
    parser.add_argument("--ranks", type=ranks, default="1,4",
                        help="PowerSGD ranks (default 1,4; '' none)")
    add_common(parser, plot="out/bench_codec.png")


def parse_sizes(text: str) -> list[int]:
    """``20-26`` or ``20,22,24`` (log2 of the element count) -> element counts."""
    logs: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            logs += list(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            logs = []
            break
    if not logs or any(not 0 <= v <= 34 for v in logs):
        raise ValueError(f"sizes must be log2 values in 0..34, got {text!r}")
    return [1 << v for v in logs]


def _one_blas_thread():
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - scikit-learn (a dependency) brings it
        return contextlib.nullcontext()
    return threadpool_limits(1)


def _time_interleaved(ops: list[tuple[str, str, object]], repeat: int,
                     sync=lambda: None) -> dict[str, dict]:
    """Median and best time per op, running the ops round-robin so that a background load
    that comes and goes hits every op (and so every ratio) alike. ``sync`` waits for the
    device before and after each op."""
    for _, _, fn in ops:
        fn()
    runs: dict[str, list[float]] = {name: [] for name, _, _ in ops}
    for _ in range(repeat):
        for name, _, fn in ops:
            sync()
            t = time.perf_counter()
            fn()
            sync()
            runs[name].append(time.perf_counter() - t)
    return {name: {"median_s": statistics.median(r), "best_s": min(r), "runs_s": r}
            for name, r in runs.items()}


def _stats(times: dict) -> dict:
    """An op's row figures: its median and best, not the runs behind them."""
    return {"median_s": times["median_s"], "best_s": times["best_s"]}


def _size(n: int) -> str:
    """``n`` elements as the table prints them: a power of two as 2^k, else the number."""
    return f"2^{n.bit_length() - 1}" if n > 0 and n & (n - 1) == 0 else str(n)


def _matrix_shape(n: int) -> tuple[int, int]:
    rows = 1 << ((n.bit_length() - 1) // 2)
    while n % rows:
        rows //= 2
    return rows, n // rows


def powersgd_steps(x, rank: int, seed: int = 0):
    """(compress, decompress) closures doing one PowerSGD step on x viewed as a matrix,
    with warm-started Q and error feedback, as torch's DDP hook does per bucket: the error
    added into the bucket in place, the estimate written over the bucket, the new error a
    new tensor (the bucket then holds x again at every compress)."""
    import torch
    try:   # torch's own step, private: what its hook runs
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize
    except ImportError:   # renamed: QR (torch's uses Gram-Schmidt at rank 2 or less, so
        def _orthogonalize(m):   # timings there would differ)
            m.copy_(torch.linalg.qr(m).Q)
    n, m = _matrix_shape(x.numel())
    r = min(rank, n, m)
    bucket = x.reshape(1, n, m).clone()
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, m, r, generator=gen).to(x.device)
    p = torch.empty(1, n, r, device=x.device)
    state: dict = {"error": torch.zeros_like(bucket)}

    def compress():
        bucket.add_(state["error"])
        state["copy"] = bucket.detach().clone()
        _orthogonalize(q)
        torch.bmm(bucket, q, out=p)
        _orthogonalize(p)
        torch.bmm(bucket.transpose(1, 2), p, out=q)

    def decompress():
        torch.bmm(p, q.transpose(1, 2), out=bucket)
        state["error"] = state["copy"] - bucket

    return compress, decompress, (n, m, r)


def resolved(backend: str, x) -> str:
    """The path ``backend`` runs for x: compiled, triton or reference."""
    return backends.pick(x, backend, settings.current().codec_cpu).name


def _thc_ops(params, label: str, x, n: int, backend: str) -> tuple[list, tuple]:
    """THC's steps on one backend; each encode uses a new round (a fresh rotation). On a GPU
    the codec defers its checks (nothing waits for the device) and decode gets the sums as
    the torch.distributed transport hands them over: the narrowest integer type."""
    import numpy as np
    cuda = not isinstance(x, np.ndarray) and x.device.type == "cuda"
    c = THCCodec(params, backend=backend, deferred_checks=cuda)
    m = c.norms(x)
    rounds = iter(range(10 ** 9))
    gen = np.random.default_rng(2) if isinstance(x, np.ndarray) else None
    idx = c.encode(x, m, 0, gen)
    sums = c.aggregate([idx] * 4)
    if cuda:
        sums = sums.to(wire_sum_dtype(4, params))
    enc, dec = f"THC encode ({label})", f"THC decode, 4 workers ({label})"
    ops = [(f"THC norms ({label})", label, lambda: c.norms(x)),
           (enc, label, lambda: c.encode_prepared(c.prepare(x, next(rounds)), m, gen)),
           (dec, label, lambda: c.decode(sums, 4, m, n, 0))]
    return ops, (f"THC encode+decode ({label})", label, enc, dec), c


def graph_rows(n: int, x, params, repeat: int) -> list[dict]:
    """The copy and THC encode+decode replayed from CUDA graphs (no launch or Python cost),
    over enough distinct inputs that they are not served from L2."""
    import torch
    k = max(1, min(16, (1 << 24) // n))
    xs = [x.roll(i) for i in range(k)]
    c = THCCodec(params, deferred_checks=True)
    ms = [c.norms(v) for v in xs]
    sums = [c.aggregate([c.encode(v, m, 0, 5)] * 4).to(wire_sum_dtype(4, params))
            for v, m in zip(xs, ms)]
    outs = [torch.empty(n, device=x.device) for _ in xs]

    def thc():
        for v, m, s, o in zip(xs, ms, sums, outs):
            c.encode_prepared(c.prepare(v, 1), m, 5)
            c.decode(s, 4, m, n, 1, out=o)

    rows = []
    for name, fn in (("copy, CUDA graph", lambda: [v.clone() for v in xs]),
                     ("THC encode+decode, CUDA graph (triton)", thc)):
        rows.append({"name": name, "group": "graph", "median_s": _replay(fn, repeat) / k})
    c.check()
    return rows


REPLAYS = 25


def _replay(fn, repeat: int) -> float:
    """Median seconds of one replay of a CUDA graph of ``fn``, over at least :data:`REPLAYS`
    (a replay takes about a millisecond: a median of five was as wide as a headline's margin)."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    runs = []
    for _ in range(max(repeat, REPLAYS)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / 1e3)
    return statistics.median(runs)


def run(args: argparse.Namespace) -> int:
    import torch

    try:
        params = THCParams.from_args(args)
        if args.size is not None and args.sizes is not None:
            raise ValueError("--size and --sizes: give one of them")
        if args.size is not None:
            sizes = [args.size]
        else:
            sizes = parse_sizes(("16" if args.quick else "20-26") if args.sizes is None
                                else args.sizes)
        device = torch.device(args.device)
        if device.type == "cuda" and args.backend == "compiled":
            raise ValueError("--backend compiled is the CPU codec; on cuda use auto or triton")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda but torch sees no CUDA device (--device cpu runs "
                             "the codec on this machine)")
        if why := memory_refusal(BYTES_PER_ELEMENT * max(sizes), f"a size of {max(sizes)} elements",
                                 device_memory(device)):
            raise ValueError(why)
        configs = _configs(args.configs, device)
        chosen = settings.current()         # ValueError: a bad THC_* variable
        resolved(args.backend, torch.zeros(1, device=device))   # RuntimeError: cannot run here
    except (ValueError, RuntimeError) as e:
        print(f"thc bench codec: {e}", file=sys.stderr)
        return 2
    print(f"thc bench codec: {chosen.describe()}", file=sys.stderr)
    repeat = args.repeat if args.repeat is not None else 2 if args.quick else 5
    cuda = device.type == "cuda"
    reference = args.reference
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)
    rows: list[dict] = []
    try:
        with (_one_blas_thread() if not cuda else contextlib.nullcontext()):
            for n in sizes:
                rows += _measure(n, device, args.backend, reference, args.ranks, params,
                                 repeat, sync, configs)
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(threads)

    where = torch.cuda.get_device_name(device) if cuda else "one core"
    print(f"codec throughput on {device.type} ({where}), median of {repeat}; "
          f"THC {params.describe()}; GB/s of float32 input, speed relative to a copy")
    width = max([48] + [len(r["name"]) for r in rows])
    head = f"{'operation':<{width}} {'elements':>9} {'ms':>9} {'GB/s':>8} {'of copy':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['name']:<{width}} {_size(r['elements']):>9} "
              f"{r['median_s'] * 1e3:>9.3f} {r['gb_per_s']:>8.2f} {r['speed_vs_copy']:>8.3f}")
    if args.plot:
        plot(rows, args.plot, f"{device.type} ({where}), {params.describe()}")
        print(f"wrote {args.plot}")
    emit_json(args, {"device": str(device), "device_name": where, "backend": args.backend,
                     "reference": reference,
                     "sizes": sizes, "repeat": repeat,
                     "params": {"bits": params.bits, "granularity": params.granularity,
                                "p": params.p},
                     "torch": torch.__version__, "results": rows})
    return 0


PLOTTED = ("copy", "fp16 round trip", "THC encode+decode")
"""Rows whose names start so are drawn: the yardsticks and the codec's round trip."""


def plot(rows: list[dict], path: str, title: str, recorded: dict | None = None) -> None:
    """GB/s of float32 input against the size, one line per operation of :data:`PLOTTED`."""
    fig, axes = figure()
    ax = axes[0][0]
    names = [n for n in dict.fromkeys(r["name"] for r in rows) if n.startswith(PLOTTED)]
    for name in names:
        pts = sorted((r["elements"], r["gb_per_s"]) for r in rows if r["name"] == name)
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=name,
                linestyle="--" if "graph" in name else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("elements (float32)")
    ax.set_ylabel("GB/s of float32 input")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path, recorded)


def _configs(text: str, device) -> list[dict]:
    """The kernel settings of ``--configs`` (none: [])."""
    if not text:
        return []
    if device.type != "cuda":
        raise ValueError("--configs sets the CUDA kernels' settings: use it with --device cuda")
    from thc.codec import triton_kernels
    return [c for c in parse_configs(text, triton_kernels) if c]


def _config_rows(n, x, params, repeat, configs) -> list[dict]:
    """:func:`graph_rows` under each of ``configs``, its THC row named after the settings."""
    from thc.codec import triton_kernels
    rows = []
    for config in configs:
        label = ",".join(f"{k}={v}" for k, v in config.items())
        with applied(triton_kernels, config):
            copy, thc = graph_rows(n, x, params, repeat)
        thc["name"] = f"THC encode+decode, CUDA graph (triton, {label})"
        thc["speed_vs_copy"] = copy["median_s"] / thc["median_s"]
        rows.append(thc)
    return rows


def _measure(n, device, backend, reference, ranks, params, repeat, sync,
             configs=()) -> list[dict]:
    """All figures of one size, timed round-robin in one run."""
    import numpy as np
    import torch
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(device)
    ops: list[tuple[str, str, object]] = [
        ("copy (x.clone())", "baseline", lambda: x.clone()),
        ("fp16 round trip (x.half().float())", "baseline", lambda: x.half().float())]
    inputs = [(device.type, x)]
    if device.type == "cpu":
        xn = x.numpy().copy()
        ops.append(("fp16 round trip (numpy astype)", "baseline",
                    lambda: xn.astype(np.float16).astype(np.float32)))
        inputs.append(("numpy", xn))
    pairs, codecs = [], []
    for name, inp in inputs:
        labels = {}   # without the extension, auto resolves to the reference: time it once
        for path in [backend] + (["reference"] if reference else []):
            if name == "numpy" and path == "triton":
                continue   # the kernels take tensors
            labels.setdefault(f"{name}, {resolved(path, inp)}", path)
        for label, path in labels.items():
            thc_ops, pair, codec = _thc_ops(params, label, inp, n, path)
            ops += thc_ops
            pairs.append(pair)
            codecs.append(codec)
    for rank in ranks:
        comp, decomp, shape = powersgd_steps(x, rank)
        name = f"PowerSGD rank {rank} ({shape[0]}x{shape[1]})"
        ops.append((f"{name} compress", "powersgd", comp))
        ops.append((f"{name} decompress", "powersgd", decomp))
        pairs.append((f"{name} compress+decompress", "powersgd",
                      f"{name} compress", f"{name} decompress"))
    times = _time_interleaved(ops, repeat, sync)
    rows = [dict(name=name, group=group, **_stats(times[name])) for name, group, _ in ops]
    for c in codecs:
        c.check()
    if device.type == "cuda":
        graphs = graph_rows(n, x, params, repeat)
        copy = graphs[0]["median_s"]
        for r in graphs:
            r["speed_vs_copy"] = copy / r["median_s"]
        rows += graphs + _config_rows(n, x, params, repeat, configs)
    for name, group, first, second in pairs:
        # a round trip's run is the sum of its halves timed in the same pass: the
        # median and best of their sums (a sum of medians is no run's, nor of bests)
        trips = [a + b for a, b in zip(times[first]["runs_s"], times[second]["runs_s"])]
        at = max(i for i, r in enumerate(rows) if r["name"] in (first, second)) + 1
        rows.insert(at, {"name": name, "group": group, "median_s": statistics.median(trips),
                         "best_s": min(trips)})
    copy = times["copy (x.clone())"]["median_s"]
    for r in rows:
        r["elements"] = n
        r["gb_per_s"] = 4 * n / 1e9 / r["median_s"]
        r.setdefault("speed_vs_copy", copy / r["median_s"])
    return rows
