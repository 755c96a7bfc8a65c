"""``thc bench hook``: what THC's DDP hook adds to a training step, on one device.

ResNet-50 (host/bench/resnet.py, 25.6M parameters), SGD with momentum, synthetic batches,
in one process with a process group of one (NCCL on CUDA, Gloo on the CPU): every
all-reduce is a local sum, so what differs between the modes is the work around it. Per DDP
bucket size (``--buckets``, MB), the step time (forward, backward, optimizer step, waited
for; the median of ``--steps``, the modes taking turns step by step) of:

- ``ddp``: DDP's own all-reduce, no hook;
- ``fp16``: torch's ``fp16_compress_hook``, DDP's machinery plus the cast down and back;
- ``fp32 hook``: the project's hook machinery (a communication thread, bucket copies,
  :class:`thc.collective.ddp.FP32Hook`) with the plain all-reduce;
- ``thc hook``: the same machinery with THC (:class:`thc.collective.ddp.THCHook` over
  torch.distributed, error feedback on);
- ``thc graphed`` (CUDA only): the same hook, each bucket's round replayed from a CUDA graph
  (:class:`thc.collective.graphed.GraphedAllReduce`) and waited for;
- ``thc deferred`` (CUDA only): the same, its checks deferred (``deferred_checks``): no round
  is waited for.

Each mode's cost on the critical path is its step time less ``ddp``'s: DDP's own all-reduce
is the FP32 baseline ``thc model`` compares THC and FP16 with, and THC's hook needs its
machinery (printed beside: THC's cost against ``fp32 hook``, the codec's alone).
The JSON's ``results`` give the costs per bucket (elements, seconds) under the row names
``thc model --gpu-codec`` reads ("THC encode+decode (DDP hook, B MB buckets)" and FP16's
round trip), so the model can take the hook's measured cost in place of the codec alone.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from thc.argtypes import memory_refusal, non_negative_int, positive_int, positive_ints, torch_device
from thc.bench import add_common, device_memory, emit_json, figure, save_figure
from thc.codec.params import THCParams

MODES = ("ddp", "fp16", "fp32 hook", "thc hook", "thc graphed", "thc deferred")
GRAPHED = ("thc graphed", "thc deferred")
"""The modes that need CUDA (the kernels, NCCL, graphs)."""
SIZES = {"batch": (64, 2), "image": (224, 32), "steps": (20, 2), "warmup": (5, 1)}
"""Each size flag's default, and its default with ``--quick`` (a size given wins)."""
THC_ROWS = (("thc hook", "THC encode+decode (DDP hook, {} MB buckets)"),
            ("thc graphed", "THC encode+decode (DDP hook, CUDA graphs, {} MB buckets)"),
            ("thc deferred",
             "THC encode+decode (DDP hook, CUDA graphs, checks deferred, {} MB buckets)"))


def modes(device) -> tuple[str, ...]:
    return MODES if device.type == "cuda" else tuple(m for m in MODES if m not in GRAPHED)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=torch_device, default="cuda",
                        help="cuda (default, or cuda:N) or cpu")
    parser.add_argument("--buckets", type=positive_ints, default="5,25,100",
                        help="DDP bucket sizes, MB")
    parser.add_argument("--batch", type=positive_int, default=None,
                        help="images a step (default 64; 2 with --quick)")
    parser.add_argument("--image", type=positive_int, default=None,
                        help="image side (default 224; 32 with --quick)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="timed steps a mode (default 20; 2 with --quick)")
    parser.add_argument("--warmup", type=non_negative_int, default=None,
                        help="untimed steps a mode first (default 5; 1 with --quick)")
    THCParams.add_arguments(parser, seed=False)
    add_common(parser, plot="out/bench_hook.png")


def _group(device):
    """A process group of this one process (a store in memory, no network)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)


def _ddp(mode: str, model, bucket_mb: int, params: THCParams, calls: list):
    """``model`` wrapped for ``mode``; ``calls`` counts the buckets its hook is handed."""
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import FP32Hook, THCHook
    from thc.collective.graphed import GraphedAllReduce
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    if mode == "ddp":
        return ddp, None
    if mode == "fp16":
        def fp16(state, bucket):
            calls.append(1)
            return default.fp16_compress_hook(state, bucket)
        ddp.register_comm_hook(None, fp16)
        return ddp, None
    if mode == "fp32 hook":
        hook = FP32Hook(model)
    elif mode in GRAPHED:
        hook = THCHook(model, lambda group: GraphedAllReduce.through_torch_distributed(
            group, params=params, deferred_checks=mode == "thc deferred"))
    else:
        hook = THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
            group, params=params))
    inner = hook.hook

    def counted(state, bucket):
        calls.append(1)
        return inner(state, bucket)
    hook.hook = counted   # what register installs
    hook.register(ddp)
    return ddp, hook


def _measure(bucket_mb: int, args, params: THCParams, device) -> list[dict]:
    """Every mode at one bucket size, the modes taking turns step by step."""
    import torch
    from thc.bench.resnet import ResNet50
    torch.manual_seed(0)
    base = ResNet50().to(device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(args.batch, 3, args.image, args.image, device=device, generator=gen)
    y = torch.randint(0, 1000, (args.batch,), device=device, generator=gen)
    runs = {}
    for mode in modes(device):
        model = ResNet50().to(device)
        model.load_state_dict(base.state_dict())
        calls: list = []
        ddp, hook = _ddp(mode, model, bucket_mb, params, calls)
        # lr 0: a step does the optimizer's work and leaves the model as it was; a step of
        # 0.01 took a small --image (batch norms of two values) to NaN within a step
        opt = torch.optim.SGD(ddp.parameters(), lr=0.0, momentum=0.9)
        runs[mode] = {"ddp": ddp, "hook": hook, "opt": opt, "calls": calls, "times": []}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in range(args.warmup + args.steps):
        for mode, r in runs.items():
            if step == args.warmup:
                r["calls"].clear()
            sync()
            t = time.perf_counter()
            r["opt"].zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(r["ddp"](x), y)
            loss.backward()
            r["opt"].step()
            sync()
            if step >= args.warmup:
                r["times"].append(time.perf_counter() - t)
        print(f"  {bucket_mb} MB buckets: step {step + 1} of {args.warmup + args.steps}",
              file=sys.stderr, flush=True)
    rows = []
    for mode, r in runs.items():
        if hasattr(r["hook"], "check"):
            r["hook"].check()   # a round refused with its checks deferred: no figure
        rows.append({"bucket_mb": bucket_mb, "mode": mode,
                     "median_s": statistics.median(r["times"]), "min_s": min(r["times"]),
                     "buckets": len(r["calls"]) / args.steps if r["calls"] else None})
    return rows


def costs(rows: list[dict], n_params: int) -> list[dict]:
    """Per bucket size: THC's and FP16's cost a step and a bucket against DDP's own
    all-reduce (THC's also against the FP32 hook), and the codec rows of ``thc model
    --gpu-codec`` (only where the cost is above the noise: the larger of the two modes'
    spreads, median less fastest step, ``noise_s``)."""
    out = []
    for mb in sorted({r["bucket_mb"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["bucket_mb"] == mb}
        named = [(name, mode) for mode, name in THC_ROWS if mode in by]
        for name, mode in named + [("fp16 round trip (x.half().float())", "fp16")]:
            cost = by[mode]["median_s"] - by["ddp"]["median_s"]
            noise = max(by[m]["median_s"] - by[m]["min_s"] for m in (mode, "ddp"))
            buckets = by[mode]["buckets"] or 1
            row = {"name": name.format(mb), "mode": mode, "bucket_mb": mb, "step_cost_s": cost,
                   "noise_s": noise, "buckets": buckets, "elements": round(n_params / buckets)}
            if mode in dict(THC_ROWS):
                row["vs_fp32_hook_s"] = by[mode]["median_s"] - by["fp32 hook"]["median_s"]
            if cost > noise:
                row["median_s"] = cost / buckets
                row["mb_per_s"] = 4 * n_params / cost / 1e6
            out.append(row)
    return out


def plot(rows: list[dict], path: str, title: str, recorded: dict | None = None) -> None:
    """Median step time of each mode, grouped by bucket size."""
    fig, axes = figure(7.5, 4.2)
    ax = axes[0][0]
    sizes = sorted({r["bucket_mb"] for r in rows})
    shown = [m for m in MODES if any(r["mode"] == m for r in rows)]
    width = 0.8 / len(shown)
    for i, mode in enumerate(shown):
        ys = [next(r["median_s"] for r in rows if r["bucket_mb"] == mb and r["mode"] == mode)
              * 1e3 for mb in sizes]
        ax.bar([k + (i - (len(shown) - 1) / 2) * width for k in range(len(sizes))], ys,
               width, label=mode)
    ax.set_xticks(range(len(sizes)), [f"{mb} MB buckets" for mb in sizes])
    ax.set_ylabel("step time, ms (median)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_ylim(0, 1.3 * max(r["median_s"] for r in rows) * 1e3)   # room for the legend
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    save_figure(fig, path, recorded)


def run(args: argparse.Namespace) -> int:
    import torch

    from thc.codec import settings
    device = torch.device(args.device)
    try:
        params = THCParams.from_args(args)
        settings.current()                  # ValueError: a bad THC_* variable
    except ValueError as e:
        print(f"thc bench hook: {e}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("thc bench hook: --device cuda but torch sees no CUDA device (--device cpu "
              "--quick times the hook on this machine)")
        return 2
    for name, (full, quick) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    side = -(-args.image // 32)   # the last stage's side, after five halvings
    if args.batch * side * side < 2:
        print(f"thc bench hook: ResNet-50's last batch norm needs 2 values a channel or more: "
              f"--batch {args.batch} of --image {args.image} leaves it {side}x{side} a "
              f"channel and image (take --batch 2, or --image 33 or more)", file=sys.stderr)
        return 2
    image_bytes = 3 * args.image * args.image * 4
    if why := memory_refusal(args.batch * image_bytes, f"--batch {args.batch} of --image "
                             f"{args.image} (the input alone)", device_memory(device)):
        print(f"thc bench hook: {why}", file=sys.stderr)
        return 2
    buckets = args.buckets
    _group(device)
    from thc.bench.resnet import ResNet50
    n_params = sum(p.numel() for p in ResNet50().parameters())
    rows = []
    for mb in buckets:
        rows += _measure(mb, args, params, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results = costs(rows, n_params)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"DDP hooks on {where}: ResNet-50 ({n_params / 1e6:.1f}M parameters), batch "
          f"{args.batch} of {args.image}x{args.image}, a process group of one (local sums); "
          f"median of {args.steps} steps")
    if GRAPHED[0] not in modes(device):
        print(f"{' and '.join(GRAPHED)} left out: CUDA graphs need a CUDA device")
    print(f"{'buckets':>8} {'mode':<12} {'step ms':>9} {'buckets':>8}")
    for r in rows:
        print(f"{r['bucket_mb']:>6}MB {r['mode']:<12} {r['median_s'] * 1e3:>9.2f} "
              f"{r['buckets'] or '-':>8}")
    for r in results:
        beside = (f" ({r['vs_fp32_hook_s'] * 1e3:.2f} against the FP32 hook)"
                  if "vs_fp32_hook_s" in r else "")
        print(f"{r['bucket_mb']:>6}MB {r['mode']} costs {r['step_cost_s'] * 1e3:.2f} ms a step "
              f"against DDP's all-reduce{beside}"
              + (f", {r['mb_per_s']:.0f} MB/s of float32 gradient" if "mb_per_s" in r else
                 f" (not above the noise: the step times spread {r['noise_s'] * 1e3:.2f} ms)"))
    if args.plot:
        plot(rows, args.plot, f"ResNet-50, batch {args.batch}, {where}: DDP hooks")
        print(f"wrote {args.plot}")
    emit_json(args, {"device": str(device), "device_name": where, "model": "resnet50",
                     "params": n_params, "batch": args.batch, "image": args.image,
                     "steps": args.steps, "torch": torch.__version__, "rows": rows,
                     "results": [r for r in results if "median_s" in r]})
    return 0
