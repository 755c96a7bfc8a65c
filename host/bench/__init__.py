"""Benchmarks that print figures against a baseline measured in the same run.

Every benchmark module offers ``add_arguments(parser)`` (calling :func:`add_common`) and
``run(args)``; heavy imports happen inside ``run`` so ``thc --help`` stays fast. Other
commands that write JSON or a plot take the same output flags from here.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from thc.argtypes import figure_path, writable_path


def add_common(parser: argparse.ArgumentParser, *, quick: bool = True,
               plot: str | None = None) -> None:
    """The output flags: ``--json`` (see :func:`emit_json`), ``--quick`` where the command has
    small sizes, and ``--plot`` where it draws one (``plot``: its default file)."""
    group = parser.add_argument_group("output")
    group.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                       type=writable_path,
                       help="write results as JSON to FILE (stdout when no FILE is given)")
    parser.set_defaults(json_stdout=True)   # "-" is the standard output (emit_json)
    if quick:
        group.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    if plot:
        group.add_argument("--plot", nargs="?", const=plot, default=None, metavar="FILE",
                           type=figure_path,
                           help=f"draw the plot into FILE (default {plot})")


def device_memory(device) -> int | None:
    """Bytes free on a CUDA ``device`` (a torch.device); None on the CPU, where
    ``argtypes.memory_refusal`` reads the host's."""
    if device.type != "cuda":
        return None
    import torch
    return torch.cuda.mem_get_info(device)[0]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), "" where it does not say."""
    try:
        return next((line.split(":", 1)[1].strip() for line in
                     Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), "")
    except OSError:
        return ""


def provenance() -> dict:
    """When (written, at the end of the run), by which command, from which commit and on what
    machine a report was made: a figure carries them, and a report read back later has them
    beside its numbers (``gpu_present``: the machine's GPU, whether or not the run used it)."""
    try:
        commit = subprocess.run(["git", "--no-optional-locks", "describe", "--always",
                                 "--dirty"],
                                cwd=Path(__file__).resolve().parent, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    argv = sys.argv or [""]
    if Path(argv[0]).name in ("thc", "cli.py"):
        argv = ["thc"] + argv[1:]
    out = {"utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": shlex.join(argv), "commit": commit, "cpu": cpu_model(),
           "cores": os.cpu_count()}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        out["gpu_present"] = torch.cuda.get_device_name()
    return out


_JSON_OUT: list = []
"""The standard output a ``--json`` with no FILE writes to, while :func:`lines_aside` holds."""


@contextlib.contextmanager
def lines_aside(args: argparse.Namespace):
    """With ``--json`` and no FILE, the command's printed lines go to standard error, so
    that the standard output holds the JSON alone (a table above it broke its readers)."""
    if not (getattr(args, "json_stdout", False) and args.json == "-"):
        yield          # (a command's own --json may take "-" as a file's name)
        return
    _JSON_OUT.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _JSON_OUT.pop()


def emit_json(args: argparse.Namespace, result: dict) -> None:
    """Write ``result`` where ``--json`` asked for it, with its :func:`provenance` (a report
    read back and written again keeps the one it had)."""
    if args.json is None:
        return
    result = {**result, "recorded": result.get("recorded") or provenance()}
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.json == "-":
        out = _JSON_OUT[-1] if _JSON_OUT else sys.stdout
        out.write(text + "\n")
        out.flush()
    else:
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text + "\n")
        except OSError as e:   # checked writable before the work; a full disk comes later
            print(text, flush=True)
            raise SystemExit(f"cannot write {args.json} ({e.strerror or e}): the report is "
                             f"above, on standard output") from None
        print(f"wrote {args.json}")


def figure(width: float = 7.5, height: float = 4.5, cols: int = 1):
    """A new matplotlib figure and its axes (one row of ``cols``), drawn without a display."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(1, cols, figsize=(width, height), squeeze=False)


def footer(recorded: dict) -> str:
    """A figure's last lines: the command, commit, machine and time its numbers came from
    (a report's :func:`provenance`)."""
    cores = recorded.get("cores")
    machine = ", ".join(x for x in (recorded.get("cpu"), cores and f"{cores} cores",
                                    recorded.get("gpu_present")) if x)
    commit = recorded.get("commit")
    return " | ".join(x for x in (recorded.get("command"), commit and f"commit {commit}",
                                  machine, recorded.get("utc")) if x)


def save_figure(fig, path, recorded: dict | None = None) -> None:
    """Lay out, sign with :func:`footer` (``recorded``: the report's provenance, where the
    figure is drawn from one read back; else this run's), write (the folder made if
    needed) and close ``fig``."""
    import textwrap

    import matplotlib.pyplot as plt
    width, height = fig.get_size_inches()
    lines = textwrap.wrap(footer(recorded or provenance()), int(width * 19)) or [""]
    fig.tight_layout(rect=(0, (8 * len(lines) + 4) / (72 * height), 1, 1))
    fig.text(0.005, 0.005, "\n".join(lines), fontsize=6, color="0.4", va="bottom")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
