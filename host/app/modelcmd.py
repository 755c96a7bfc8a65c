"""``thc model``: the performance model's command. Its options and table live with the model
(host/app/perfmodel.py); ``--gpu-codec`` feeds it a GPU codec's measured speed
(host/app/gpucodec.py), which builds on the model and so cannot be reached from it."""
from __future__ import annotations

import argparse

from thc.app import gpucodec, perfmodel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    perfmodel.add_arguments(parser)
    parser.add_argument("--gpu-codec", metavar="CODEC_JSON", default=None,
                        help="break-even bandwidths of 25M-, 100M- and 350M-parameter models "
                             "at the codec speed measured in this `thc bench codec --device "
                             "cuda --json` or `thc bench hook --json` report (with --workers, "
                             "--latency-us, --compute-ms, --overlap)")


def run(args: argparse.Namespace) -> int:
    if args.gpu_codec:
        base = perfmodel.Setup(workers=args.workers, latency_us=args.latency_us,
                               compute_s=args.compute_ms / 1e3, overlap=args.overlap)
        return gpucodec.run(args.gpu_codec, base)
    return perfmodel.run(args)
