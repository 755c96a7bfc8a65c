"""``thc bench kernels``: the codec's four Triton kernels one by one, the bytes each moves
and its share of the device's copy bandwidth, for each way of running the Hadamard products
(``triton_kernels.PRECISIONS``), with each way's error.

Per size (whole slices of ``--slice-size``) and precision it times, with
``triton.testing.do_bench`` (CUDA events, L2 cleared before every run, the median):
encode pass 1 on float32 and on bfloat16 input, the slice norms from its parts, encode
pass 2 (packed indices; with the slices' own norms, as a prepared encode runs it, and
without, when it checks every coordinate for overflow), decode pass 1 on 8-bit and on
32-bit sums, decode pass 2, and a device copy (``x.clone()``) as the yardstick. Bytes are
the fewest the kernel can move (each input read once, each output written once); GB/s count
reads plus writes, as the copy's do (8 bytes an element).

Error, per precision: the decode of four workers' sums against the same decode in float64
(relative L2 error), and the share of indices that differ from the reference path's
(float32 on the CPU; a few in a million move across a rounding threshold at float32).

Needs CUDA; ``--quick`` on the CPU runs it under Triton's interpreter as a check, not a speed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from thc.argtypes import non_negative_int, torch_device
from thc.bench import add_common, emit_json
from thc.bench.codec import parse_sizes
from thc.bench.tiles import applied, parse_configs
from thc.codec import backends, settings
from thc.codec.params import THCParams


ON_CPU = ("TRITON_INTERPRET=1 thc bench kernels --device cpu --quick checks the kernels "
          "run, it does not time a GPU")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=torch_device, default="cuda",
                        help=f"cuda (default), or cpu under Triton's interpreter ({ON_CPU})")
    parser.add_argument("--sizes", default=None, help="log2 sizes (default 20,23,26)")
    parser.add_argument("--precisions", default="tf32x2,ieee",
                        help="comma-separated ways of the Hadamard products (default "
                             "tf32x2,ieee; also tf32x3, tf32)")
    parser.add_argument("--configs", default="",
                        help="tile settings to compare, ';' between them, e.g. "
                             "'TILE_COLS=16384,NUM_WARPS_COLS=16,COLS_FIRST=1;FORM=transpose' "
                             "(names of triton_kernels' module settings; default: as they "
                             "are)")
    parser.add_argument("--error-size", type=non_negative_int, default=None,
                        help="log2 elements of the error check (default 22; 12 with "
                             "--quick)")
    THCParams.add_arguments(parser, seed=False)
    add_common(parser)


def _timer(device):
    """Median seconds of fn: do_bench on CUDA, perf_counter on the CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

    def cpu(fn):
        fn()
        runs = []
        for _ in range(2):
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        return statistics.median(runs)
    return cpu


def _kernel_rows(tk, n: int, params: THCParams, device, timer) -> list[dict]:
    import torch
    from thc.codec.common import WHOLE, layout, status_word
    from thc.codec.thc import aggregate
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen).to(device)
    xb = x.to(torch.bfloat16)
    grp = next(layout(n, params).groups(WHOLE))
    word = status_word(device)
    tmp, part = tk.encode_rows(x, grp, params.seed, 0, word)
    norms = torch.empty(grp.count, dtype=torch.float32, device=device)
    tk.finish_norms(part, grp, params, word, norms)
    packed = torch.empty(n // 2, dtype=torch.uint8, device=device)
    idx = torch.empty(n, dtype=torch.uint8, device=device)
    tk.encode_cols(tmp, grp, norms, params, 0, 5, idx, False, word)
    s32 = aggregate([idx] * 4, params)
    s8 = s32.to(torch.uint8)
    dtmp = tk.decode_rows(s8, grp, 4, params, word)
    out = torch.empty(n, dtype=torch.float32, device=device)
    ops = [("copy (x.clone())", 8 * n, lambda: x.clone()),
           ("copy in pass 2's tiles", 8 * n, lambda: column_copy(tk, x, out, grp)),
           ("encode pass 1, float32 x", 8 * n,
            lambda: tk.encode_rows(x, grp, params.seed, 0, word)),
           ("encode pass 1, bfloat16 x", 6 * n,
            lambda: tk.encode_rows(xb, grp, params.seed, 0, word)),
           ("encode: slice norms from pass 1's parts", 8 * part.numel() + 4 * grp.count,
            lambda: tk.finish_norms(part, grp, params, word, norms)),
           ("encode pass 2, packed", 4 * n + n // 2,
            lambda: tk.encode_cols(tmp, grp, norms, params, 0, 5, packed, True, word, norms)),
           ("encode pass 2, packed, no own norms", 4 * n + n // 2,
            lambda: tk.encode_cols(tmp, grp, norms, params, 0, 5, packed, True, word)),
           ("decode pass 1, 8-bit sums", 5 * n,
            lambda: tk.decode_rows(s8, grp, 4, params, word)),
           ("decode pass 1, 32-bit sums", 8 * n,
            lambda: tk.decode_rows(s32, grp, 4, params, word)),
           ("decode pass 2", 8 * n,
            lambda: tk.decode_cols(dtmp, grp, norms, 4, params, 0, out, word))]
    rows = [{"name": name, "elements": n, "bytes": b, "median_s": timer(fn)}
            for name, b, fn in ops]
    copy = rows[0]["bytes"] / rows[0]["median_s"]
    for r in rows:
        r["gb_per_s"] = r["bytes"] / r["median_s"] / 1e9
        r["of_copy"] = r["bytes"] / r["median_s"] / copy
    if word.tolist()[0]:
        raise RuntimeError(f"the kernels flagged bad input: {word.tolist()}")
    return rows


def column_copy(tk, src, dst, grp):
    """``src`` into ``dst`` through pass 2's tiles, grid and warps with no arithmetic: what
    its memory access alone costs."""
    sh = tk.Shape(grp.padded)
    _column_copy()[(grp.count * (sh.C // sh.BN),)](src, dst, grp.count, grp.padded, R=sh.R,
                                                   C=sh.C, BN=sh.BN, FIRST=tk.COLS_FIRST,
                                                   num_warps=tk.NUM_WARPS_COLS)


_KERNEL: list = []


def _column_copy():
    if not _KERNEL:
        import triton
        import triton.language as tl

        @triton.jit
        def copy(SRC, DST, count, d, R: tl.constexpr, C: tl.constexpr, BN: tl.constexpr,
                 FIRST: tl.constexpr):
            pid = tl.program_id(0)
            s = pid // (C // BN) if FIRST else pid % count
            nb = pid % (C // BN) if FIRST else pid // count
            i = tl.arange(0, R)[:, None] * C + (nb * BN + tl.arange(0, BN))[None, :]
            tl.store(DST + s.to(tl.int64) * d + i, tl.load(SRC + s.to(tl.int64) * d + i))
        _KERNEL.append(copy)
    return _KERNEL[0]


def _errors(n: int, params: THCParams, device) -> dict:
    """Decode against float64, and indices against the reference path (see the docstring)."""
    import torch
    from thc.codec import rng, thc
    from thc.codec.hadamard import fwht
    x = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(device)
    m = thc.slice_norms(x, params)
    idx = thc.encode(x, m, params, 3, 11, backend="triton")
    ref_idx = thc.encode(x.cpu(), m.cpu(), params, 3, 11, backend="reference")
    sums = thc.aggregate([idx] * 4, params)
    got = thc.decode(sums, 4, m, n, params, 3, backend="triton").cpu().double()
    d, g = params.slice_size, params.granularity
    s = sums.cpu().double().reshape(-1, d) - 4 * g / 2.0
    alpha = 2.0 * params.t_p * m.cpu().double()[:, None] / (g * d * 4)
    signs = torch.from_numpy(rng.signs(d, params.seed, 3, range(n // d))).double()
    want = (signs * fwht(s * alpha, normalized=False)).reshape(-1)
    return {"decode_rel_error": float((got - want).norm() / want.norm()),
            "indices_differing": float((idx.cpu() != ref_idx).double().mean())}


def run(args: argparse.Namespace) -> int:
    import torch
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"thc bench kernels: --device cuda but torch sees no CUDA device; {ON_CPU}")
        return 2
    if device.type == "cpu" and not backends.triton_interpreted():
        print(f"thc bench kernels: on the CPU the kernels run only under Triton's interpreter: "
              f"{ON_CPU}")
        return 2
    from thc.codec import triton_kernels as tk
    precisions = [p for p in args.precisions.split(",") if p]
    bad = [p for p in precisions if p not in tk.PRECISIONS]
    if bad or not precisions:
        print(f"thc bench kernels: --precisions {args.precisions!r}: unknown precision "
              f"{bad}; known: {tk.PRECISIONS}")
        return 2
    try:
        settings.current()                  # a bad THC_* variable, before any kernel runs
        params = THCParams.from_args(args, **({"slice_size": 1 << 10} if args.quick else {}))
        sizes = parse_sizes(args.sizes or ("12" if args.quick else "20,23,26"))
        err_log = args.error_size if args.error_size is not None else \
            12 if args.quick else 22
        if err_log > 34:
            raise ValueError(f"--error-size is a log2 value in 0..34, not {err_log}")
        err_n = 1 << err_log
    except ValueError as e:
        print(f"thc bench kernels: {e}")
        return 2
    if any(n % params.slice_size for n in sizes + [err_n]):
        print(f"thc bench kernels: --sizes and --error-size must be whole slices of "
              f"{params.slice_size}")
        return 2
    try:
        configs = parse_configs(args.configs, tk)
    except ValueError as e:
        print(f"thc bench kernels: {e}")
        return 2
    timer = _timer(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "interpreter"
    report = {"device": str(device), "device_name": where, "slice_size": params.slice_size,
              "precisions": {}}
    for prec in precisions:
        with applied(tk, {"PRECISION": prec}):
            rows = []
            for config in configs:
                label = ",".join(f"{k}={v}" for k, v in config.items()) or "as set"
                with applied(tk, config):
                    for n in sizes:
                        rows += [dict(r, config=label)
                                 for r in _kernel_rows(tk, n, params, device, timer)]
                        print(f"  {prec} {label} 2^{n.bit_length() - 1} done",
                              file=sys.stderr, flush=True)
            report["precisions"][prec] = {"rows": rows, **_errors(err_n, params, device)}
    print(f"codec kernels on {where}, slices of {params.slice_size}; GB/s of bytes read plus "
          f"written; 'of copy': that rate over the copy's")
    width = max(len(r["name"]) for rep in report["precisions"].values() for r in rep["rows"])
    head = (f"{'precision':<9} {'kernel':<{width}} {'elements':>8} {'us':>9} "
            f"{'GB/s':>8} {'of copy':>8}")
    for prec, rep in report["precisions"].items():
        config = None
        for r in rep["rows"]:
            if r["config"] != config:
                config = r["config"]
                print(f"tiles: {config}\n{head}")
            print(f"{prec:<9} {r['name']:<{width}} 2^{r['elements'].bit_length() - 1:<6} "
                  f"{r['median_s'] * 1e6:>9.1f} {r['gb_per_s']:>8.0f} {r['of_copy']:>8.2f}")
        print(f"{prec:<9} decode error vs float64 {rep['decode_rel_error']:.2e}, indices "
              f"differing from the reference {rep['indices_differing']:.2e} (2^"
              f"{err_n.bit_length() - 1} elements)")
    emit_json(args, report)
    return 0
