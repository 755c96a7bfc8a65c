"""One data-parallel training worker: Fashion-MNIST (or digits) with DDP over Gloo.

The gradient exchange is chosen by ``--mode``: ``fp32`` (DDP's own all-reduce), ``fp16``
(the same all-reduce of gradients cast to half precision: torch's ``fp16_compress_hook``, as
torch has it: a gradient beyond float16's 65504 becomes inf on every rank, unsaid), ``thc``
(THC through the aggregator at ``--agg``: switch or software), ``thc-dist`` (THC integer
sums over the Gloo all-reduce), ``topk`` (10% TopK with error feedback), ``marsit`` (sign
bits merged along a ring) or ``marsit-vote`` (sign bits counted by a vote job at ``--agg``:
switch or software aggregator). With ``--mode thc``, ``--loss-bound`` (else the job's) lets
a round close short (DLCP's bounded loss) and ``--priorities`` marks every chunk with its DLCP
class by layer position. Marsit modes train with their own learning rate and momentum
(:data:`OPTIMIZER`): a sign-bit estimate puts the full scale on every coordinate and the
global compensation already carries past gradients forward, so momentum 0.9 on top of it
amplifies the sign noise tenfold; at the shared (0.05, 0.9) Marsit diverged (0.30 after two
epochs). Accuracy after one epoch of Fashion-MNIST, 4 workers on loopback: (0.05, 0.9) 0.37
(one scale a bucket then; a scale a tensor since), (0.01, 0.9) 0.72, (0.003, 0.9) 0.72,
(0.05, 0) 0.75, (0.1, 0) 0.80. Data comes from local files (thc.app.datasets): nothing is
downloaded. Rank 0 prints JSON lines: ``{"dataset": ...}`` first, ``{"progress": ...}``
every few steps, and one evaluation row ``{"epoch": ...}`` ``--evals`` times per epoch (with
``replicas_agree``: whether every rank held the same parameters then). At each evaluation the
ranks also check that no image of the epoch went to two of them (:func:`shards_disjoint`).

Run by ``thc run`` (the main job) inside emulated hosts, or by hand, e.g. under torchrun:
``torchrun --nproc-per-node 4 -m thc.app.train --mode thc-dist``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

from thc.app import datasets
from thc.app.datasets import DatasetError
from thc.app.modes import AGGREGATED, MODES
from thc.argtypes import (ShowDefaults, fraction, non_negative_float, positive_float,
                          positive_int)
from thc.codec import settings
from thc.codec.params import THCParams
from thc.codec.thc import check_feedback
from thc.collective import worker
from thc.collective.allreduce import THCAllReduce
from thc.collective.ddp import HookOptions, MarsitHook, MarsitVoteHook, THCHook, TopKHook
from thc.collective.transports import codec_mismatch
from thc.net.client import AggregationClient

OPTIMIZER = {"marsit": (0.1, 0.0), "marsit-vote": (0.1, 0.0)}
"""(learning rate, momentum) of the modes that do not train with the default (0.05, 0.9)."""
DEFAULT_OPTIMIZER = (0.05, 0.9)


_THC = ("thc", "thc-dist")
READ_BY = {"topk_ratio": ("topk",), "no_error_feedback": _THC, "slice_size": _THC,
           "bits": _THC, "granularity": _THC, "p": _THC,
           "uncompressed": tuple(m for m in MODES if m not in ("fp32", "fp16")),
           "codec_cpu": _THC,
           **{name: AGGREGATED for name in ("config", "agg", "run", "deadline", "window",
                                            "rto", "client_datapath")}}
"""The flags (by dest) only some modes read: given to another, they are refused, not
ignored."""
FLAG_OF = {"run": "--run-id"}
"""Flags whose dest is not their name."""


def momentum(text: str) -> float:
    """SGD momentum, in [0, 1): at 1 or above the velocity never decays and training
    diverges; NaN compared unequal to itself, so the ranks' flag check refused a NaN that
    every rank was given alike."""
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"momentum lies in [0, 1), not {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=MODES, default="thc")
    worker.add_arguments(parser)
    parser.add_argument("--data", choices=(datasets.AUTO, *datasets.DATASETS),
                        default=datasets.AUTO,
                        help="data set (auto: fashion-mnist where installed, else digits, "
                             "saying so)")
    parser.add_argument("--train-subset", type=positive_int, default=None, metavar="N",
                        help="train on the first N training images only (quick runs)")
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--evals", type=positive_int, default=4,
                        help="test-set evaluations per epoch")
    parser.add_argument("--batch", type=positive_int, default=64, help="per-worker batch size")
    parser.add_argument("--lr", type=positive_float, default=None,
                        help=f"learning rate (default {DEFAULT_OPTIMIZER[0]}; Marsit modes: "
                             f"{OPTIMIZER['marsit'][0]})")
    parser.add_argument("--momentum", type=momentum, default=None,
                        help=f"SGD momentum (default {DEFAULT_OPTIMIZER[1]}; Marsit modes: "
                             f"{OPTIMIZER['marsit'][1]})")
    parser.add_argument("--width", type=positive_int, default=None,
                        help="hidden width (default: 768 for 28x28 images, 64 for digits)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=positive_int, default=None,
                        help="stop after this many optimizer steps (evaluating then)")
    parser.add_argument("--stop-at", type=non_negative_float, default=None, metavar="UNIX_TIME",
                        help="stop training, and evaluate, after the last step that ends by "
                             "this wall-clock time as foreseen from the longest step so far "
                             "(every rank after the same step)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")
    parser.add_argument("--topk-ratio", type=fraction, default=0.1,
                        help="share of each bucket's entries TopK sends")
    parser.add_argument("--slice-size", type=int, default=1 << 16,
                        help="THC rotation slice (power of two; small slices waste less padding)")
    parser.add_argument("--no-error-feedback", action="store_true")
    parser.add_argument("--priorities", action="store_true",
                        help="mode thc: mark every chunk with its DLCP class (layer position)")
    parser.add_argument("--uncompressed", default="",
                        help="comma-separated parameter-name parts left in FP32 (e.g. bias)")
    settings.add_arguments(parser, "client_datapath", "codec_cpu")
    THCParams.add_arguments(parser, seed=False)


def make_model(image_side: int, width: int | None = None, classes: int = 10):
    """For 28x28 images an MLP with two hidden layers of ``width`` (768: 1.2M parameters,
    communication-heavy at 100 Mbit/s); for 8x8 ones the small digits CNN."""
    import torch.nn as nn
    if image_side == 8:
        w = width or 64
        return nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * w * 4, 256), nn.ReLU(), nn.Linear(256, classes))
    w = width or 768
    return nn.Sequential(nn.Flatten(), nn.Linear(image_side * image_side, w), nn.ReLU(),
                         nn.Linear(w, w), nn.ReLU(), nn.Linear(w, classes))


def _hook(args, model, ddp):
    """The mode's communication hook, and its aggregator client (None for collectives)."""
    opts = HookOptions(uncompressed=tuple(s for s in args.uncompressed.split(",") if s))
    try:
        opts.check_names(model)
    except ValueError as e:
        raise SystemExit(f"--uncompressed: {e}") from None
    if args.mode == "topk":
        return TopKHook(model, ratio=args.topk_ratio, options=opts), None
    import torch
    if args.mode == "marsit":
        return MarsitHook(model, opts,
                          generator=torch.Generator().manual_seed(1000 + args.rank)), None
    if args.mode == "marsit-vote":
        client = _client(args)
        return MarsitVoteHook(model, client, opts), client
    params = THCParams.from_args(args, seed=args.seed, slice_size=args.slice_size)
    ef = not args.no_error_feedback
    gen = torch.Generator().manual_seed(1000 + args.rank)
    if args.mode == "thc-dist":
        make = lambda group: THCAllReduce.through_torch_distributed(  # noqa: E731
            group, params=params, error_feedback=ef, generator=gen)
        return THCHook(model, make, opts), None
    client = _client(args)
    make = lambda group: THCAllReduce.through_aggregator(  # noqa: E731
        client, params, group, error_feedback=ef, generator=gen)
    return THCHook(model, make, opts, priorities=args.priorities), client


def _client(args) -> AggregationClient:
    """This worker's client of the cluster's job of the mode's aggregation (vote or thc)."""
    want = "vote" if args.mode == "marsit-vote" else "thc"
    try:
        return worker.client_from_args(args, aggregation=want)
    except ValueError as e:
        raise SystemExit(f"--mode {args.mode}: {e}") from None


def optimizer_settings(args) -> tuple[float, float]:
    """(learning rate, momentum): the flags, else the mode's defaults."""
    lr, momentum = OPTIMIZER.get(args.mode, DEFAULT_OPTIMIZER)
    return (lr if args.lr is None else args.lr,
            momentum if args.momentum is None else args.momentum)


def _tensors(ds: datasets.Dataset, subset: int | None):
    import torch
    n = len(ds.y_train) if subset is None else min(subset, len(ds.y_train))
    return (torch.from_numpy(ds.x_train[:n]), torch.from_numpy(ds.y_train[:n]),
            torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test))


def evaluation_steps(steps: int, evals: int) -> set[int]:
    """The steps of an epoch after which it evaluates: ``evals`` spread evenly, at most one a
    step (--evals 1000000000 built a set of a billion first)."""
    evals = min(evals, steps)
    return {round(steps * (k + 1) / evals) for k in range(evals)}


def _note(note: str, args, images: int, steps: int, evals: int) -> str:
    """The data set's note, and what of the asked the training set could not give: fewer
    images than ``--train-subset``, fewer evaluations an epoch than ``--evals``."""
    parts = [note] if note else []
    if args.train_subset is not None and images < args.train_subset:
        parts.append(f"{images} training images, the whole set: fewer than the "
                     f"{args.train_subset} asked")
    if evals < args.evals:
        parts.append(f"{evals} evaluations an epoch of {steps} steps, fewer than the "
                     f"--evals {args.evals} asked")
    return "; ".join(parts)


def _accuracy(model, x, y, batch: int = 4096) -> float:
    import torch
    with torch.no_grad():
        right = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
                    for i in range(0, len(y), batch))
    return right / len(y)


def replicas_agree(model, group=None) -> bool:
    """Whether every rank of ``group`` holds the same parameters, bit for bit: a synchronous
    data-parallel exchange gives every rank the same update, so replicas that differ mean
    an exchange that did not reduce (or reduced unlike) somewhere. One all-gather of an
    8-byte digest a rank."""
    import torch
    import torch.distributed as dist
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():   # as bytes: numpy has no bfloat16
        h.update(p.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    mine = torch.tensor([int.from_bytes(h.digest(), "big", signed=True)], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return len({int(d) for d in every}) == 1


def shards_disjoint(seen, group=None) -> bool:
    """Whether no image was trained on twice so far this epoch, by one rank or by two:
    ``seen`` (int32) counts the times this rank took each training image. Ranks that share
    images still agree on every update and learn (each takes the same mean), so neither
    :func:`replicas_agree` nor the accuracy shows it. One all-reduce of a count an image."""
    import torch
    import torch.distributed as dist
    total = torch.tensor(seen)   # a copy: the all-reduce sums in place
    dist.all_reduce(total, group=group)
    return int(total.max()) <= 1


GROUP_TIMEOUT_S = 600.0
"""Seconds a collective (the group's rendezvous included, within
:data:`thc.collective.worker.RENDEZVOUS_GRACE`) may wait without ``--stop-at``:
no step or evaluation of this trainer keeps a peer waiting that long, so a peer gone (or a
restart's rendezvous that never completes) ends in Gloo's error instead of torch's 30
minutes of silence."""


def _group_timeout(deadline: float | None) -> float:
    """Seconds one collective may wait (:data:`GROUP_TIMEOUT_S` without a deadline). With a
    deadline, the time from the start to 15 s past it: a peer that stops answering early in
    the run fails this rank with Gloo's error naming it, before the orchestrator's kill (a
    collective begun later may outlast the kill: thc run reads the final evaluation's mark
    instead)."""
    if deadline is None:
        return GROUP_TIMEOUT_S
    return min(1800.0, max(30.0, deadline - time.time() + 15.0))


def _out_of_time(deadline: float | None, step_s: float = 0.0) -> bool:
    """Whether any rank's next step, as long as ``step_s`` (its longest yet), would end past
    ``deadline``: they agree (one tiny all-reduce a step), so every rank stops after the
    same step and the collectives stay matched. Foreseen, not found past: a step longer
    than the margin a caller leaves after the deadline (a BMv2 step, a slow link) would
    otherwise run past it, and the caller's limit with it."""
    if deadline is None:
        return False
    import torch
    import torch.distributed as dist
    flag = torch.tensor([int(time.time() + step_s >= deadline)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


AGREED = ("mode", "train_subset", "epochs", "evals", "batch", "seed", "max_steps",
          "topk_ratio", "slice_size", "no_error_feedback", "uncompressed", "priorities",
          "loss_bound", "bits", "granularity", "p")
"""Flags every rank must be given alike: each rank decides from them alone when it steps,
evaluates and stops, so ranks given unlike ones would wait in unlike collectives (a hang
until the group's timeout, :data:`GROUP_TIMEOUT_S` without ``--stop-at``). ``--stop-at`` may
differ (the ranks agree each step whether any is past its own), but not whether it is
given. What a flag resolves to is compared where a default resolves it (the data set,
the model's size for its width, the optimizer's settings), not the flag."""


def job_mismatch(args) -> str | None:
    """Why the cluster file's THC job cannot take this worker's codec (None where it can, or
    where the mode runs no THC job): the job's lookup table comes from its own granularity
    and p, the codec's from ``--bits``, ``--granularity`` and ``--p``; told before training,
    not at the first backward."""
    if args.mode != "thc" or not args.config:   # the one mode whose THC job is in the file
        return None
    from thc.wire.jobs import Cluster, ConfigError
    try:
        job = next((j for j in Cluster.load(args.config).jobs if j.aggregation == "thc"), None)
    except (ConfigError, OSError, ValueError):
        return None   # the client's build names it, on every rank
    try:
        params = THCParams.from_args(args, seed=args.seed, slice_size=args.slice_size)
    except ValueError:
        return None   # a flag THC refuses: compared across ranks, then refused by the build
    why = None if job is None else codec_mismatch(job, params)
    return why and (f"{args.config}, --bits {params.bits} --granularity {params.granularity} "
                    f"--p {params.p:g}: {why}; give every worker the flags the job was made "
                    f"with (--mode thc-dist takes other widths)")


def check_flags_agree(args, facts: dict, problem: str | None = None) -> None:
    """Raise on every rank, naming the flag and each rank's value, unless the ranks were
    given the same :data:`AGREED` flags and came to the same ``facts`` (the data set
    ``auto`` chose, its size, the model's), or where any rank has a ``problem``, naming
    it."""
    import torch.distributed as dist
    mine = {**{k: getattr(args, k, None) for k in AGREED}, **facts}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mine, problem))
    told: dict = {}
    for r, (_, why) in enumerate(every):
        if why:
            told.setdefault(why, []).append(str(r))
    if told:
        raise SystemExit("; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(rs)}: {why}"
                                   for why, rs in told.items()))
    every = [e for e, _ in every]
    unlike = [k for k in mine if any(e.get(k) != mine[k] for e in every)]
    if unlike:
        shown = "; ".join(f"{k}: " + ", ".join(f"rank {r} {e.get(k)!r}"
                                              for r, e in enumerate(every)) for k in unlike)
        raise SystemExit(f"the ranks were given unlike settings ({shown}): every rank must "
                         f"train alike, or they wait in unlike collectives")


def train(args) -> list[dict]:
    """Train, evaluating ``args.evals`` times per epoch; rank 0 prints JSON lines.

    The process group outlives the model's DDP wrapper: DDP's reducer holds the group from
    C++ and frees it with the GIL held, and Gloo's destructor joins worker threads that may
    need the GIL to drop the Python objects of their last work, a deadlock at the end of the
    run. With the wrapper gone first, the group's last reference is the registry's, which
    :func:`torch.distributed.destroy_process_group` drops with the GIL released.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    worker.init_group(args, timeout=_group_timeout(args.stop_at))
    history = _train_model(args)
    dist.barrier()
    dist.destroy_process_group()
    return history


def rank_batch(perm, step: int, rank: int, batch: int, world: int):
    """Rank ``rank``'s share of the epoch's global batch ``step`` (from 1) in ``perm``: the
    ranks' shares are disjoint, and an epoch's steps take ``perm``'s first steps x world x
    batch images each once."""
    lo = ((step - 1) * world + rank) * batch
    return perm[lo: lo + batch]


@dataclass
class _Tally:
    """What the loop has counted so far; each evaluation row reports it."""

    step_losses: list = field(default_factory=list)
    reported: int = 0   # each row carries the losses of the steps since the one before
    trained: float = 0.0
    comm: float = 0.0
    exposed: float = 0.0
    longest: float = 0.0


def _wrap(args, model):
    """(DDP wrapper, THC or baseline hook, aggregator client) of ``args.mode``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # the digits CNN's first weight has one input channel: its gradient's strides differ
    # from the parameter's only along that size-1 dimension (the same layout in memory);
    # DDP's warning about it would fill the stderr tail a failing run's error quotes
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    ddp = DDP(model)
    hook = client = None
    if args.mode == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            fp16_compress_hook,
        )
        ddp.register_comm_hook(None, fp16_compress_hook)
    elif args.mode != "fp32":
        hook, client = _hook(args, model, ddp)
        hook.register(ddp)
    return ddp, hook, client


def _row(args, epoch: float, acc: float, alike: bool, tally: _Tally, hook, client,
         n_params: int, steps: int) -> dict:
    """One evaluation row; ``bytes_sent`` from the hook, or DDP's ring all-reduce's (4
    bytes a coordinate, 2 in fp16); ``bytes_received``: a ring's as many, an aggregator
    client's as its counters say."""
    n = len(tally.step_losses)
    if hook is None:
        width = 2 if args.mode == "fp16" else 4
        sent = 2 * (args.world - 1) * n_params * width * n // args.world
    else:
        sent = hook.bytes_sent
    received = sent if client is None else \
        sent - client.stats.bytes_sent + client.stats.bytes_received
    row = {"mode": args.mode, "rank": args.rank, "epoch": epoch, "accuracy": acc,
           "loss": tally.step_losses[-1], "seconds": tally.trained, "bytes_sent": int(sent),
           "bytes_received": int(received),
           "params": n_params, "steps_per_epoch": steps, "steps": n, "replicas_agree": alike,
           "comm_seconds": tally.comm, "exposed_comm_seconds": tally.exposed,
           "codec_seconds": getattr(hook, "codec_seconds", None),
           "short_chunks": getattr(hook, "short_chunks", None),
           # the aggregator client's counters: resends, spurious timeouts, ...
           "transport": vars(client.stats).copy() if client else None,
           "step_losses": tally.step_losses[tally.reported:]}
    tally.reported = n
    return row


def _train_model(args) -> list[dict]:
    """The training loop of :func:`train`, whose DDP wrapper ends with it.

    ``seconds`` in a row is training time: evaluation time is left out, so time-to-accuracy
    compares the gradient exchanges, not how often the test set was scored.
    """
    import numpy as np
    import torch

    ds = datasets.load(args.data, args.seed, settings.current())
    xtr, ytr, xte, yte = _tensors(ds, args.train_subset)
    model = make_model(xtr.shape[-1], args.width, ds.classes)
    n_params = sum(p.numel() for p in model.parameters())
    check_flags_agree(args, {"stop_at given": args.stop_at is not None, "dataset": ds.name,
                             "train_images": len(ytr), "params": n_params,
                             "optimizer": optimizer_settings(args)}, job_mismatch(args))
    ddp, hook, client = _wrap(args, model)
    say = print if args.rank == 0 else (lambda *a, **k: None)
    lr, momentum = optimizer_settings(args)
    global_batch = args.batch * args.world
    steps = len(ytr) // global_batch
    if steps < 1:
        raise SystemExit(f"{len(ytr)} training images cannot fill one global batch of "
                         f"{global_batch}")
    eval_at = evaluation_steps(steps, args.evals)
    say(json.dumps({"dataset": ds.name, "note": _note(ds.note, args, len(ytr), steps,
                                                       len(eval_at - {0})),
                    "train_images": len(ytr), "test_images": len(yte), "params": n_params,
                    "mode": args.mode, "lr": lr, "momentum": momentum}),
        flush=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    progress_every = max(1, steps // 50)
    history = []
    tally = _Tally()
    losses = tally.step_losses
    for epoch in range(1, args.epochs + 1):
        perm = torch.from_numpy(np.random.default_rng([args.seed, epoch]).permutation(len(ytr)))
        seen = np.zeros(len(ytr), np.int32)
        for s in range(1, steps + 1):
            if args.max_steps is not None and len(losses) >= args.max_steps:
                return history
            t0 = time.perf_counter()
            ddp.train()
            idx = rank_batch(perm, s, args.rank, args.batch, args.world)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            # the stop's agreement waits for the slowest rank: timed with the step, as the
            # wait it takes over from the next step's collectives would have been
            last = ((args.max_steps is not None and len(losses) >= args.max_steps)
                    or _out_of_time(args.stop_at, max(tally.longest, time.perf_counter() - t0)))
            took = time.perf_counter() - t0
            np.add.at(seen, idx.numpy(), 1)
            tally.trained += took
            tally.longest = max(tally.longest, took)
            if hook is not None:
                br = hook.step_breakdown()
                tally.comm, tally.exposed = tally.comm + br.comm, tally.exposed + br.exposed
            if s % progress_every == 0:
                say(json.dumps({"progress": len(losses), "of": steps * args.epochs,
                                "seconds": tally.trained}), flush=True)
            if s not in eval_at and not last:
                continue
            if last:   # thc run takes a limit reached after this for a slow evaluation
                say(json.dumps({"final_evaluation": len(losses)}), flush=True)
            ddp.eval()
            if not shards_disjoint(seen):
                raise RuntimeError(f"epoch {epoch}: an image went to two ranks, or twice to one, "
                                   f"by step {s}: the ranks' batches are not the disjoint "
                                   f"shares of rank_batch")
            row = _row(args, epoch - 1 + s / steps, _accuracy(model, xte, yte),
                       replicas_agree(model), tally, hook, client, n_params, steps)
            history.append(row)
            say(json.dumps(row), flush=True)
            if last:
                return history
    return history


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m thc.app.train", description=__doc__,
                                     formatter_class=ShowDefaults)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        chosen = settings.use(settings.from_args(args))
    except ValueError as e:
        parser.error(str(e))
    if args.rank == 0:
        print(f"train: {chosen.describe()}", file=sys.stderr, flush=True)
    if args.mode in AGGREGATED and not args.config:
        parser.error(f"--mode {args.mode} needs --config (the aggregator's cluster JSON)")
    if args.mode != "thc" and (args.loss_bound is not None or args.priorities):
        parser.error("--loss-bound and --priorities apply to --mode thc (through an aggregator)")
    for name, modes in READ_BY.items():
        if args.mode not in modes and getattr(args, name) != parser.get_default(name):
            flag = FLAG_OF.get(name, f"--{name.replace('_', '-')}")
            parser.error(f"{flag} applies to --mode {' and '.join(modes)}: "
                         f"--mode {args.mode} would ignore it")
    if args.mode in _THC:
        try:
            params = THCParams.from_args(args, seed=args.seed, slice_size=args.slice_size)
            if not args.no_error_feedback:
                check_feedback(params)
        except ValueError as e:
            parser.error(str(e))   # here, not in every rank after its process group formed
    try:
        train(args)
    except DatasetError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        why = hook_failure(e)
        if why is None:
            raise
        print(f"[rank{args.rank}]: {why}", file=sys.stderr)   # as torch prefixes a rank's
        return 1
    return 0


HOOK_ERROR = "Got the following error when running the callback: "
"""How DDP re-raises what a communication hook's future raised: a RuntimeError with that
exception's name and message in its text, then the hook's frames ("At:")."""


def hook_failure(e: RuntimeError) -> str | None:
    """The exception a communication hook raised, as one line (``AggregationTimeout: ...``),
    from DDP's RuntimeError; None for any other error: its traceback stays."""
    text = str(e)
    if HOOK_ERROR not in text:
        return None
    return " ".join(text.split(HOOK_ERROR, 1)[1].split("\nAt:", 1)[0].split())


def _exit_done(code: int) -> None:
    """Exit a finished run without the interpreter's teardown: torch's c10d threads (rank
    0's TCPStore server) can outlive it and abort the process with std::terminate after
    the run completed and printed everything (exit code -6 in about one run in ten of two
    quick workers), which the job then counted as a failed worker."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_done(main())
