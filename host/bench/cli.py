"""``thc bench <name>``: dispatch to one benchmark module (same add_arguments/run contract).

Only the chosen module is imported, so one benchmark's missing dependency (p4runtime-shell,
a switch) never breaks the others.
"""
from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "codec": ("host.bench.codec", "THC encode/decode throughput vs FP16 cast and PowerSGD"),
    "nmse": ("host.bench.nmse", "NMSE of THC and the baselines"),
    "aggregator": ("host.bench.aggregator", "compiled and Python aggregators vs UDP echoes"),
    "switch": ("controller.bench", "BMv2 aggregation vs BMv2 L2 forwarding"),
    "install": ("controller.bench_install", "job install time on BMv2; lookup entries "
                                            "serialized vs as protobuf messages"),
    "allreduce": ("thcnet.bench_allreduce", "THC vs FP32 all-reduce over emulated links"),
    "dlcp": ("thcnet.bench_dlcp", "DLCP: loss bound and priorities on a congested link"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "benchmarks:\n" + "\n".join(f"  {k:<11} {h}" for k, (_, h) in BENCHES.items())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("bench", choices=list(BENCHES), metavar="BENCH")
    parser.add_argument("options", nargs=argparse.REMAINDER,
                        help="options of that benchmark (thc bench BENCH --help)")


def run(args: argparse.Namespace) -> int:
    module_name, help_ = BENCHES[args.bench]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"thc bench {args.bench}", description=help_)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(args.options)) or 0)
