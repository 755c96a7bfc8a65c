"""The ``thc`` command: one dispatcher on top of every layer, each subcommand living in the
module it drives.

It sits above the emulation so that every subcommand it names points down (the architecture
test reads the tables below as imports). Modules are imported only when chosen, so
``thc --help`` stays fast and a missing optional piece (p4runtime-shell, Mininet) breaks only
the command that needs it. Each module provides ``add_arguments(parser)`` and
``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import select
import signal
import sys

from thc.argtypes import ShowDefaults
from thc.bench import lines_aside

BENCHES: dict[str, tuple[str, str]] = {
    "codec": ("thc.bench.codec", "THC encode/decode throughput vs FP16 cast and PowerSGD"),
    "kernels": ("thc.bench.kernels", "the codec's GPU kernels one by one: bytes, share of "
                                     "the copy's bandwidth, error"),
    "hook": ("thc.bench.hook", "what THC's DDP hook adds to a ResNet-50 step, against FP32 "
                               "and FP16, per bucket size"),
    "nmse": ("thc.bench.nmse", "NMSE of THC and the baselines"),
    "aggregator": ("thc.bench.aggregator", "compiled and Python aggregators vs UDP echoes"),
    "switch": ("thc.controller.bench", "BMv2 aggregation vs BMv2 L2 forwarding"),
    "install": ("thc.controller.bench_install", "job install time on BMv2; lookup entries "
                                            "serialized vs as protobuf messages"),
    "allreduce": ("thc.emu.bench_allreduce", "THC vs FP32 all-reduce over emulated links"),
    "dlcp": ("thc.emu.bench_dlcp", "DLCP: loss bound and priorities on a congested link"),
}

COMMANDS: dict[str, tuple[str | dict, str]] = {
    "table": ("thc.app.table", "print the optimal THC lookup table for (bits, granularity, p)"),
    "nmse": ("thc.bench.nmse", "NMSE of THC and the baselines on synthetic vectors"),
    "bench": (BENCHES, "benchmarks: " + ", ".join(BENCHES)),
    "aggregator": ("thc.net.aggregator", "run the software aggregator (THC's parameter server)"),
    "controller": ("thc.controller.cli", "program a BMv2 or Tofino switch over P4Runtime"),
    "model": ("thc.app.modelcmd", "iteration-time model: when does compression pay?"),
    "run": ("thc.emu.mainjob", "the main job: train a model with FP32, THC, TopK and Marsit, "
                                "compare"),
    "sweep": ("thc.emu.sweep", "the main job at several link bandwidths: where THC stops "
                               "paying, measured and modelled"),
    "faults": ("thc.emu.faults", "the fault matrix: exact sums under loss, restarts, ... "
                                "(docs/faults.md)"),
}
"""Subcommand -> (module, or a table of its own subcommands; one line of help)."""


def usage(prog: str, table: dict, about: str = "THC in-network aggregation.") -> str:
    width = max(map(len, table))
    lines = [f"usage: {prog} <command> [options]", "", about, "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in table.items()]
    lines += ["", f"Run '{prog} <command> --help' for a command's options."]
    return "\n".join(lines)


def dispatch(prog: str, table: dict, argv: list[str],
             about: str = "THC in-network aggregation.") -> int:
    """Run the subcommand ``argv[0]`` of ``table`` with the rest of ``argv``."""
    if not argv:   # no command: a usage error, as argparse makes a missing argument
        print(usage(prog, table, about), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage(prog, table, about))
        return 0
    if argv[0] == "--version" and table is COMMANDS:
        from importlib.metadata import version
        print(f"{prog} {version('thc-ina')}")
        return 0
    name = argv[0]
    if name not in table:
        print(f"{prog}: unknown command {name!r}\n\n{usage(prog, table, about)}",
              file=sys.stderr)
        return 2
    target, help_ = table[name]
    if isinstance(target, dict):
        return dispatch(f"{prog} {name}", target, argv[1:], help_[0].upper() + help_[1:] + ".")
    module = importlib.import_module(target)
    parser = argparse.ArgumentParser(prog=f"{prog} {name}", description=help_,
                                     formatter_class=ShowDefaults)
    module.add_arguments(parser)
    parser.set_defaults(command=parser.prog)   # one module may serve two commands
    args = parser.parse_args(argv[1:])
    with lines_aside(args):
        return int(module.run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C, SIGTERM and SIGHUP end any command with one line, not a traceback, and the
    status that names the signal (130 for Ctrl-C, 128 + its number else), each command's own
    cleanup run on the way out: SIGTERM's default action left a benchmark's switch serving.
    A reader of the standard output gone (``thc table | head -1``) ends it with status 141,
    as SIGPIPE ends other commands, and no traceback."""
    from thc.lifetime import Terminated, signals_raise, stopped_by
    try:
        with signals_raise():
            code = dispatch("thc", COMMANDS, list(sys.argv[1:] if argv is None else argv))
            if sys.stdout is not None:   # None: started with it closed (>&-)
                sys.stdout.flush()       # here, not at exit: a reader gone is seen below
        return code
    except (KeyboardInterrupt, Terminated) as e:
        words, code = stopped_by(e)
        print(f"thc: {words}", file=sys.stderr)
        if argv is None:   # the process is the command: it ends here, its cleanup done
            _exit_now(code)
        return code
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise                    # another pipe or socket's: the command's own error
        return 128 + signal.SIGPIPE


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown. The frames a signal cut short hold objects
    whose finalizers may wait for work it cut: a grpc channel whose pipeline push SIGTERM cut
    waited in its finalizer for good, after the command had said it was terminated."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    os._exit(code)


def _stdout_reader_gone() -> bool:
    """Whether the standard output's reader is gone; if so it now goes to /dev/null, so that
    the interpreter's last flush at exit raises nothing more."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    if not any(ev & select.POLLERR for _, ev in poll.poll(0)):
        return False
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return True


if __name__ == "__main__":
    sys.exit(main())
