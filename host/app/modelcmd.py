"""``thc model``: the performance model's command. Its options and table live with the model
(host/app/perfmodel.py); ``--gpu-codec`` feeds it a GPU codec's measured speed
(host/app/gpucodec.py), which builds on the model and so cannot be reached from it."""
from __future__ import annotations

import argparse

from thc.app import gpucodec, perfmodel
from thc.argtypes import refusal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    perfmodel.add_arguments(parser)
    parser.add_argument("--gpu-codec", metavar="CODEC_JSON", default=None,
                        help="break-even bandwidths of 25M-, 100M- and 350M-parameter models "
                             "at the codec speed measured in this `thc bench codec --device "
                             "cuda --json` or `thc bench hook --json` report (with --workers, "
                             "--latency-us, --compute-ms, --overlap)")


SETUP = ("params", "workers", "bw", "latency_us", "compute_ms", "overlap", "codec_mbps")
CALIBRATION = ("alpha_ms", "efficiency", "agg_pps")
IGNORED = {"gpu_codec": ("calibrate", "params", "bw", "codec_mbps", *CALIBRATION),
           "calibrate": (*SETUP,),
           None: CALIBRATION}
"""What each way of running reads not: ``--calibrate`` takes its setups from the reports,
``--gpu-codec`` its sizes and codec speed from its own table and report."""


def _ignored(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The way ``args`` runs the model, and the flags given that it would not read."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    default = defaults.parse_args([])
    way = "gpu_codec" if args.gpu_codec else "calibrate" if args.calibrate else None
    return way, [f"--{n.replace('_', '-')}" for n in IGNORED[way]
                 if getattr(args, n) != getattr(default, n)]


def run(args: argparse.Namespace) -> int:
    way, ignored = _ignored(args)
    if ignored:
        said = f"--{way.replace('_', '-')}" if way else "without --calibrate"
        raise refusal(f"thc model {said} would ignore {', '.join(ignored)}")
    if args.gpu_codec:
        base = perfmodel.Setup(workers=args.workers, latency_us=args.latency_us,
                               compute_s=args.compute_ms / 1e3, overlap=args.overlap)
        return gpucodec.run(args.gpu_codec, base)
    return perfmodel.run(args)
