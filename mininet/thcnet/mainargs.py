"""The main job's modes and flags (``thc run``, and ``thc sweep`` over it): the table of
modes, the arguments, and every refusal said before the first mode starts rather than when a
mode's testbed or workers meet it, after minutes of the others."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from thc.argtypes import non_negative_float, non_negative_int, positive_int, seconds
from thc.app.datasets import AUTO, DATASETS, TRAIN_IMAGES, fashion_missing, resolve
from thc.codec import settings
from thc.codec.params import THCParams
from thc.wire import protocol as P
from thc.wire.jobs import loss_bound_arg
from thc.wire.protocol import MAX_SOFTWARE_LANES
from thc.emu.base import MAX_TESTBED_WORKERS
from thc.emu import links, testbed


@dataclass(frozen=True)
class Mode:
    train_mode: str
    aggregator: str
    description: str
    loss_bound: bool = False
    """The job gets ``--loss-bound`` and the links queue by DLCP class (Mininet; every mode's
    do under ``--congest``)."""
    priorities: bool = False
    """Workers mark every chunk with its DLCP class (``train --priorities``)."""


MODES = {
    "fp32": Mode("fp32", "none", "uncompressed FP32 all-reduce (Gloo ring)"),
    "fp16": Mode("fp16", "none", "FP16 all-reduce (Gloo ring, gradients cast to half by "
                 "torch's fp16_compress_hook)"),
    "thc": Mode("thc", "sharded", "THC through software aggregator shards, one on every "
                "worker host"),
    "thc-central": Mode("thc", "software", "THC through one central software aggregator on "
                        "its own host"),
    "thc-lossy": Mode("thc", "software", "THC through one central software aggregator, rounds "
                      "closing short at the loss bound (DLCP without priorities)",
                      loss_bound=True),
    "thc-dlcp": Mode("thc", "software", "THC through one central software aggregator, rounds "
                     "closing short at the loss bound, chunks marked by DLCP class",
                     loss_bound=True, priorities=True),
    "thc-bmv2": Mode("thc", "bmv2", "THC through the BMv2 switch"),
    "thc-dist": Mode("thc-dist", "none", "THC integer sums over the Gloo all-reduce"),
    "topk": Mode("topk", "none", "TopK 10% with error feedback (all-gather)"),
    "marsit": Mode("marsit", "none", "Marsit sign bits merged along a ring"),
    "marsit-vote": Mode("marsit-vote", "software",
                        "Marsit sign bits counted by the software aggregator (vote job)"),
    "marsit-vote-bmv2": Mode("marsit-vote", "bmv2",
                             "Marsit sign bits counted by the BMv2 switch (vote job)"),
}
OPT_IN = ("fp16", "thc-central", "thc-lossy", "thc-dlcp", "marsit-vote-bmv2")
DEFAULT_MODES = ",".join(m for m in MODES if m not in OPT_IN)
"""Every mode but FP16 (a baseline of the bandwidth sweep, ``thc sweep``), the central
aggregator's (plain and DLCP: a comparison under ``--congest``) and the BMv2 vote: at BMv2's
~2k packets/s of 256 lanes a step of 1.2M signs takes about 10 s (estimated), an epoch 20 min."""
BMV2_STEPS = 3
"""Steps a mode through BMv2 trains by default: its losses after two rounds of sums through
the switch are compared with ``thc``'s, which keeps the whole main job in minutes on 2 cores
(docs/results.md; a step takes about 9 s through a BMv2 built without logging macros, about
36 s with them on a loaded machine)."""
BMV2_TIMEOUT = 3600.0
LOSS_BOUND = 0.05
"""``--bmv2-timeout``'s and ``--loss-bound``'s defaults: a flag given with no mode that reads
it is refused."""
QUICK_IMAGES = 8192
"""Training images of ``--quick`` (``--train-subset`` given wins)."""
BW = 100.0
"""``--bw``'s default, Mbit/s: with the loopback (where no link is shaped), a ``--bw`` other
than it is refused."""
STOP_MARGIN = 25.0
"""Seconds before a mode's limit by which its workers stop training and evaluate: the last
evaluation fits in it (each worker stops after the last step it foresees, from its longest
step, to end before then: a step longer than the margin does not run past the limit)."""


def step_count(text: str) -> int | None:
    """A step count of at least 1, or ``all`` (None: no bound)."""
    return None if text == "all" else positive_int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    testbed.add_arguments(parser, timeout=600.0,
                          timeout_help="per-mode limit, seconds: the workers stop training "
                                       f"{STOP_MARGIN:g} s before it and report how far they "
                                       "got; a mode still running at it failed")
    testbed.add_link_arguments(parser, bw=BW)
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"comma-separated, from {','.join(MODES)} (default: all but "
                             f"{', '.join(OPT_IN)})")
    parser.add_argument("--data", default=AUTO, choices=(AUTO, *DATASETS),
                        help="data set (auto: fashion-mnist where installed, else digits, "
                             "saying so)")
    parser.add_argument("--epochs", type=positive_int, default=None,
                        help="epochs to train (default 2; 1 with --quick)")
    parser.add_argument("--batch", type=positive_int, default=128, help="per-worker batch size")
    parser.add_argument("--width", type=positive_int, default=None,
                        help="model width (default: the worker's, 768 for Fashion-MNIST's MLP: "
                             "1.2M parameters)")
    parser.add_argument("--evals", type=positive_int, default=6, help="evaluations per epoch")
    parser.add_argument("--quick", action="store_true",
                        help=f"about two minutes: {QUICK_IMAGES} training images "
                             "(--train-subset given wins), one epoch (--epochs given wins)")
    parser.add_argument("--train-subset", type=positive_int, default=None, metavar="N",
                        help="train on the first N images (step-time measurements: more "
                             "steps than --quick, less than an epoch)")
    parser.add_argument("--loss-bound", type=loss_bound_arg, default=LOSS_BOUND, metavar="F",
                        help="thc-lossy/thc-dlcp: fraction of a round's chunks, in [0, 1), "
                             "that may close short instead of being retransmitted")
    parser.add_argument("--congest", type=non_negative_float, default=0.0, metavar="F",
                        help="a competing UDP flow (iperf) from every worker at F x --bw, to "
                             "the aggregator's host (else the next worker); needs Mininet")
    parser.add_argument("--software-lanes", type=non_negative_int, default=0,
                        help="lanes per packet for the software aggregator (default 0: the "
                             f"most that fit one MTU, {MAX_SOFTWARE_LANES} for 8-bit sums, "
                             "half for 16-bit)")
    parser.add_argument("--out", default="out", help="directory for JSON and plot")
    parser.add_argument("--bmv2-steps", type=step_count, default=BMV2_STEPS, metavar="N|all",
                        help=f"modes through BMv2 train N steps, then evaluate (default "
                             f"{BMV2_STEPS}: a step of the 1.2M-parameter model takes 9-36 s "
                             f"through BMv2 on 2 cores); their losses are compared step by step "
                             f"with their twins' in software (thc, marsit-vote). 'all' trains "
                             f"them for every epoch like the other modes (234 steps: 36 "
                             f"minutes or more; make run-bmv2)")
    parser.add_argument("--bmv2-timeout", type=seconds, default=BMV2_TIMEOUT,
                        help="the limit for modes through BMv2 (default 3600 s; a lower limit "
                             "stops the mode where it got and still compares its losses with "
                             "THC's)")


def data_unavailable(args: argparse.Namespace, prog: str) -> str | None:
    """Why ``--data`` cannot be trained on (Fashion-MNIST named and not installed), else
    None with ``args.data`` resolved (:data:`AUTO`'s fallback to digits printed, and kept as
    ``args.data_note``: the report's arguments say it, where ``data`` alone reads as asked)."""
    name, note = resolve(args.data)
    if name == "fashion-mnist" and (why := fashion_missing()):
        return (f"{prog}: --data fashion-mnist: {why} (Debian package dataset-fashion-mnist, "
                f"`make system-deps` as root, or THC_FASHION_MNIST): install it, or choose "
                f"--data digits")
    if note:
        print(f"{prog}: {note}", flush=True)
    args.data, args.data_note = name, note or None
    return None


def check_args(args: argparse.Namespace, modes: list[str]) -> str | None:
    """Why the flags cannot run (None: they can), found before the first mode starts rather
    than when a mode's testbed or workers refuse them, after minutes of the others."""
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        return f"{'unknown mode(s) ' + str(unknown) if unknown else '--modes names no mode'}; " \
               f"choose from {list(MODES)}"
    if twice := sorted({m for m in modes if modes.count(m) > 1}):
        return f"--modes names {', '.join(twice)} more than once (each mode trains once)"
    # a flag no mode asked for reads is refused, not ignored
    if args.loss_bound != LOSS_BOUND and not any(MODES[m].loss_bound for m in modes):
        return (f"--loss-bound applies to {', '.join(m for m in MODES if MODES[m].loss_bound)}, "
                f"which --modes does not name")
    if (args.bmv2_steps != BMV2_STEPS or args.bmv2_timeout != BMV2_TIMEOUT) \
            and not any(MODES[m].aggregator == "bmv2" for m in modes):
        return (f"--bmv2-steps and --bmv2-timeout apply to "
                f"{', '.join(m for m in MODES if MODES[m].aggregator == 'bmv2')}, which "
                f"--modes does not name")
    software = ("software", "sharded")
    if args.software_lanes and not any(MODES[m].aggregator in software for m in modes):
        return (f"--software-lanes applies to "
                f"{', '.join(m for m in MODES if MODES[m].aggregator in software)}, which "
                f"--modes does not name")
    if not 2 <= args.workers <= MAX_TESTBED_WORKERS:
        return (f"--workers {args.workers}: the modes compare gradient exchanges, which take "
                f"2..{MAX_TESTBED_WORKERS} workers (one exchanges nothing: its times and "
                f"winner would be noise)")
    if args.software_lanes:
        sum_bits = P.sum_bits_for(args.workers, THCParams().granularity)
        try:
            P.check_lanes(args.software_lanes, sum_bits=sum_bits)
        except ValueError as e:
            return f"--software-lanes {args.software_lanes} ({args.workers} workers, " \
                   f"{sum_bits}-bit sums): {e}"
        if any(MODES[m].train_mode == "marsit-vote" and MODES[m].aggregator in software
               for m in modes):
            try:   # the vote job's lanes are sign bits: whole bytes of them
                P.check_lanes(args.software_lanes, sum_bits=P.sum_bits_for(args.workers, 1),
                              aggregation="vote")
            except ValueError as e:
                return f"--software-lanes {args.software_lanes} (marsit-vote's job): {e}"
    try:
        settings.current()                  # a bad THC_* variable
    except ValueError as e:
        return str(e)
    return None


def epochs_of(args: argparse.Namespace) -> int:
    """--epochs where given (--quick once replaced it, and the report recorded the
    replacement), else 1 with --quick, else 2."""
    if args.epochs is not None:
        return args.epochs
    return 1 if args.quick else 2


def refusal(args: argparse.Namespace, modes: list[str],
             mininet_why: str | None) -> str | None:
    """Why these arguments cannot run (said before any work), or None. ``mininet_why``: why
    the workers run on the loopback, None on Mininet."""
    if why := check_args(args, modes):
        return f"thc run: {why}"
    if why := data_unavailable(args, "thc run"):
        return why
    if why := batch_unfilled(args):
        return f"thc run: {why}"
    if why := testbed.loopback_conflict(args, mininet_why, bw_default=BW):
        return f"thc run: {why}"
    if args.congest and mininet_why:
        return ("thc run: --congest needs the Mininet testbed: not with --loopback"
                if args.loopback else
                f"thc run: --congest needs the Mininet testbed ({mininet_why})")
    if not mininet_why:
        try:
            links.plan(args.bw, args.delay, args.loss)
        except links.LinkError as e:
            return f"thc run: --bw/--delay/--loss: {e}"
    return None


def links_refusal(args: argparse.Namespace, modes: list[str],
                  mininet_why: str | None) -> str | None:
    """Why the testbed of one of ``modes`` (those left to run) would refuse the links, or
    None: said before the first mode trains, not after the modes before it (by ``thc run``
    and, at each bandwidth, ``thc sweep``)."""
    if mininet_why:
        return None
    link_plan = links.plan(args.bw, args.delay, args.loss)
    flags = "--bw/--delay/--loss" + (" under --congest" if args.congest else "")
    for m in modes:
        queued = MODES[m].loss_bound or bool(args.congest)
        if why := links.refusal(link_plan, args.bw, MODES[m].aggregator, queued):
            return f"{m} with {flags}: {why}"
    return None


def batch_unfilled(args: argparse.Namespace) -> str | None:
    """Why the training images (the data set's, at most ``--train-subset``'s) cannot fill one
    global batch (each mode's workers found it, one mode after another), or None."""
    subset = args.train_subset or (QUICK_IMAGES if args.quick else None)
    images = min(TRAIN_IMAGES[args.data], subset or TRAIN_IMAGES[args.data])
    if images >= args.batch * args.workers:
        return None
    cap = (f", --train-subset {subset}" if args.train_subset else
           f", --quick's {subset}" if subset else "")
    return (f"{images} training images ({args.data}{cap}) cannot fill one global batch of "
            f"{args.workers} workers x --batch {args.batch}")


def out_refusal(out: Path) -> str | None:
    """Why the report cannot be written to ``out`` (checked before the modes train)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"thc run: cannot create --out {out}: {e.strerror or e}"
    try:
        trial = out / f".thc-run-{os.getpid()}"
        try:
            trial.write_bytes(bytes(4096))   # not a directory modes train for, then cannot fill
        finally:
            trial.unlink(missing_ok=True)
    except OSError as e:
        return f"thc run: cannot write to --out {out}: {e.strerror or e}"
    return None
