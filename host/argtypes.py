"""argparse types shared by the commands: counts, rates and lists that must make sense, and
the JSON reports commands read back."""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import threading
from pathlib import Path


class ShowDefaults(argparse.RawDescriptionHelpFormatter):
    """Help that shows each option's default where its text does not already say it, as
    argparse's ArgumentDefaultsHelpFormatter does, and for options without a text too (a
    flag that is off, or has no default, shows none)."""

    @staticmethod
    def _shows(action: argparse.Action) -> bool:
        """Not for a flag (store_true, store_false: its dest's default would read as the
        flag's), nor for a default of nothing (an empty list or tuple included)."""
        default = action.default
        nothing = default is None or default is False or default == argparse.SUPPRESS \
            or (isinstance(default, (str, list, tuple)) and not default)
        return action.nargs != 0 and not nothing \
            and "default" not in (action.help or "").lower()

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and self._shows(action):
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and self._shows(action):
            return f"{action.help} (default: %(default)s)"
        return action.help


def _integer(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
    return value


def positive_int(text: str) -> int:
    """A count that must be at least 1: zero epochs, steps, workers or images would start a
    job that trains nothing (``--max-steps 0`` would walk every epoch idle)."""
    return _integer(text, 1)


def available_memory() -> int | None:
    """Bytes the kernel says a new process can take (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def memory_refusal(need: int, what: str, free: int | None = None) -> str | None:
    """Why ``need`` bytes (an estimate) for ``what`` do not fit ``free`` bytes (by default the
    memory available): a command that asked for more ran the machine out of memory, and the
    kernel killed whatever it chose, or failed deep inside numpy or torch with a traceback.
    None where they fit, or memory is unknown."""
    free = available_memory() if free is None else free
    if free is None or need <= free:
        return None
    gb = need / 1e9
    return f"{what} takes about {f'{gb:.1f}' if gb < 1e6 else f'{gb:.2g}'} GB (an estimate), " \
           f"more than the {free / 1e9:.1f} GB available"


def non_negative_int(text: str) -> int:
    """A count or index that may be 0 (a rank) and not below."""
    return _integer(text, 0)


def defaulted_from(parse, env: str):
    """``parse`` for a flag whose default is the environment variable ``env``'s text: its
    error says where a bad value came from (RANK=abc, not a flag the user typed)."""
    def parse_named(text: str):
        try:
            return parse(text)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (the default comes from {env})") from None
    return parse_named


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def positive_float(text: str) -> float:
    """A rate or size that must be above 0 (a link of -5 Mbit/s is no link)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def seconds(text: str) -> float:
    """A timeout, deadline or duration: above 0 and at most ``threading.TIMEOUT_MAX`` (about
    292 years), the longest wait Python and gRPC can make; a longer one overflows the clock
    where it is waited on, far from its flag."""
    value = positive_float(text)
    if value > threading.TIMEOUT_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {threading.TIMEOUT_MAX:.0f} s (the "
                                         f"longest wait a process can make), not {text}")
    return value


def slowdown(text: str) -> float:
    """A factor that stretches a time, 1 or more (a compute overlap of 0.01 would make it
    100 times faster than measured)."""
    value = _number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more (a slowdown), not {text}")
    return value


def whole_count(text: str) -> float:
    """A count that may be written as a float (25e6) but must be whole and above 0."""
    value = positive_float(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text}")
    return value


def non_negative_float(text: str) -> float:
    """A delay or length that may be 0 and not below."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def fraction(text: str) -> float:
    """A share of something that cannot exceed the whole: above 0, at most 1 (a link that
    delivers 1.5 times its nominal rate is a mistyped figure)."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a fraction lies in (0, 1], not {text}")
    return value


def loss_percent(text: str) -> float:
    """A link's loss, percent: 0 up to, not including, 100 (a link that loses every packet
    carries no job; the round would end only at its deadline)."""
    value = _number(text)
    if not 0 <= value < 100:
        raise argparse.ArgumentTypeError(f"a loss lies in [0, 100) percent, not {text}")
    return value


def positive_floats(text: str) -> list[float]:
    """A comma-separated list of positive numbers (bandwidths)."""
    values = [positive_float(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"no number in {text!r}")
    return values


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of counts, each at least 1 (bucket sizes, worker counts): an
    empty list would run nothing and exit 0."""
    values = [positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"no integer in {text!r}")
    return values


def torch_device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, the devices a benchmark runs on: torch read a typo,
    or a GPU past the machine's last, only once the run began, as a traceback."""
    kind, colon, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (colon and not index.isdigit()):
        raise argparse.ArgumentTypeError(f"cpu, cuda or cuda:N, not {text!r}")
    if kind == "cuda" and colon:
        import torch
        count = torch.cuda.device_count()
        if int(index) >= count:
            raise argparse.ArgumentTypeError(
                f"{text}: torch sees {count} CUDA device{'' if count == 1 else 's'} here")
    return text


def writable_path(text: str) -> str:
    """A file a command writes once its work is done (``-``: stdout), checked now, so that a
    path that cannot be written fails before the work, not after it: its folder written to,
    or, where the folder is still to be made (by the writer), a folder made and removed in
    the nearest one that exists (a run refused later leaves no empty folders behind)."""
    if text == "-":
        return text
    try:
        target = Path(text).resolve()   # through links: where the write lands
    except RuntimeError:   # a loop of links
        raise argparse.ArgumentTypeError(f"cannot write {text}: a loop of links") from None
    try:
        if target.is_dir():
            raise argparse.ArgumentTypeError(f"cannot write {text}: it is a folder")
        folder = target.parent
        if Path(text).is_symlink() and not folder.is_dir():   # writers make the link's folder
            raise FileNotFoundError(f"its link leads into {folder}, which is no folder")
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a folder")
        if existing == folder:
            tempfile.TemporaryFile(dir=folder).close()
        else:
            os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {e.strerror or e}") from None
    return text


FIGURE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff")
"""What matplotlib draws by the file's name (without a suffix it writes a .png beside it)."""


def figure_path(text: str) -> str:
    """A :func:`writable_path` for a figure: its suffix says the format matplotlib writes."""
    if Path(text).suffix.lower() not in FIGURE_SUFFIXES:
        raise argparse.ArgumentTypeError(f"cannot draw {text}: a figure's file name ends in "
                                         f"{', '.join(FIGURE_SUFFIXES)}")
    return writable_path(text)


def refusal(message: str) -> SystemExit:
    """``message`` said on stderr, and the SystemExit to raise: status 2, as argparse exits
    for a refused argument (``SystemExit(message)`` would exit 1, as for a failure)."""
    print(message, file=sys.stderr)
    return SystemExit(2)


DAMAGED = (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError,
           OverflowError)
"""What a report :func:`read_json` took raises where a command takes it apart and finds it
damaged (a field missing, of another type, a zero or infinity where a rate goes): the
command refuses the report by name instead of a traceback."""


def read_json(path, what: str, keys: tuple[str, ...] = (), prog: str = "thc") -> dict:
    """The JSON object in ``path`` (a report a command reads back), or a line naming the
    file and what it lacks and SystemExit(2), as for any refused argument: a missing file or
    a report of another command is the user's mistake, not a traceback."""
    def refuse(why: str) -> SystemExit:
        return refusal(f"{prog}: {why}")
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise refuse(f"cannot read {what} {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise refuse(f"{path} is not JSON ({e}): give {what}") from None
    except RecursionError:
        raise refuse(f"{path} is nested too deeply to be {what}") from None
    if not isinstance(data, dict):
        raise refuse(f"{path} is not {what}: it holds a JSON {type(data).__name__}, not an "
                     f"object")
    lacking = [k for k in keys if k not in data]
    if lacking:
        raise refuse(f"{path} is not {what}: it has no {', '.join(map(repr, lacking))}")
    return data
