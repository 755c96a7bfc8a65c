"""The ``thc`` command: one entry point, each subcommand living in the module it drives.

Subcommand modules are imported only when chosen, so ``thc --help`` stays fast and a
missing optional piece (p4runtime-shell, Mininet) breaks only the command that needs it.
Each module provides ``add_arguments(parser)`` and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "table": ("host.app.table", "print the optimal THC lookup table for (bits, granularity, p)"),
    "nmse": ("host.bench.nmse", "NMSE of THC and the baselines on synthetic vectors"),
    "bench": ("host.bench.cli", "benchmarks: codec, aggregator, switch, allreduce"),
    "aggregator": ("host.net.aggregator", "run the software aggregator (THC's parameter server)"),
    "controller": ("controller.cli", "program a BMv2 or Tofino switch over P4Runtime"),
    "model": ("host.app.modelcmd", "iteration-time model: when does compression pay?"),
    "run": ("thcnet.mainjob", "the main job: train a model with FP32, THC and TopK, compare"),
    "sweep": ("thcnet.sweep", "the main job at several link bandwidths: where THC stops "
                              "paying, measured and modelled"),
    "faults": ("thcnet.faults", "the fault matrix: exact sums under loss, restarts, ... "
                                "(docs/faults.md)"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: thc <command> [options]", "", "THC in-network aggregation.", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'thc <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"thc: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"thc {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
