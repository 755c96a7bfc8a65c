"""``thc bench <name>``: dispatch to one benchmark module (same add_arguments/run contract)."""
from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "codec": ("host.bench.codec", "THC encode/decode throughput vs FP16 cast and PowerSGD"),
    "nmse": ("host.bench.nmse", "NMSE of THC and the baselines"),
    "aggregator": ("host.bench.aggregator", "software aggregator vs a UDP echo ceiling"),
    "switch": ("host.bench.switch", "BMv2 aggregation vs BMv2 L2 forwarding"),
    "allreduce": ("host.bench.allreduce", "THC vs FP32 all-reduce over emulated links"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(BENCHES) + "}")
    for name, (module, help_) in BENCHES.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._module).run(args) or 0)
