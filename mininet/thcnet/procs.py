"""Processes started by a testbed: output to files, concurrent waits, clear failures, kill by id.

Output goes to files rather than pipes, so N workers that print a lot can never block on a
full pipe while the testbed waits for another one.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from thc.codec.settings import ENV
from thc.emu.cleanup import kill_process, start_time

TAIL_LINES = 15
FAIL_GRACE = 3.0
"""Seconds the others get to fail on their own once one worker failed."""
POLL_S = 0.02
"""How often the workers' exits are read."""


@dataclass
class WorkerResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class WorkerError(RuntimeError):
    """Some worker failed or timed out; ``results`` holds every worker's outcome,
    ``timed_out`` whether the wait ran out (the workers that were still running killed)."""

    def __init__(self, message: str, results: list[WorkerResult], timed_out: bool = False,
                 states: dict[int, str] | None = None):
        super().__init__(message)
        self.results = results
        self.timed_out = timed_out
        self.states = states or {}
        """At a timeout, each killed worker's state then (:func:`state`), by rank."""


_FRAME = re.compile(r"^(\[rank\d+\]:)?\s+\S+\(\d+\): \S+$")
"""A frame of the stack torch's C++ errors print after their message (``At:``)."""
_CAUSE = re.compile(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Timeout|Refused|Restarted|"
                    r"Exceeded|Failed|Interrupt|Terminated)\b.*:")


def tail(text: str, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` of ``text``, without the frames torch prints after an error's
    message, and with the last line that names an exception kept where it would fall off."""
    rows = [r for r in text.rstrip().splitlines() if not _FRAME.match(r)]
    if not rows:
        return "    (empty)"
    shown = rows[-lines:]
    cause = next((r for r in reversed(rows) if _CAUSE.match(r)), None)
    if cause is not None and cause not in shown:
        shown = [cause, "..."] + shown[2:]
    return "\n".join("    " + r for r in shown)


def state(pid: int) -> str:
    """A still-running process's state, as /proc says: "stopped (SIGSTOP?)" for T, else
    "running" or "sleeping" (waiting, as a worker blocked on a peer is)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"T": "stopped (SIGSTOP?)", "t": "stopped by a debugger", "R": "running",
            "D": "in uninterruptible sleep", "Z": "a zombie"}.get(code, "sleeping")


class Proc:
    """A started process whose stdout/stderr go to files in ``logdir``."""

    def __init__(self, name: str, popen: subprocess.Popen, out: Path, err: Path, group: bool):
        self.name = name
        self.popen = popen
        self.pid = popen.pid
        self.started = start_time(popen.pid)
        self.t0 = time.monotonic()
        self.out_path, self.err_path = out, err
        self.group = group
        self.seconds: float | None = None

    @classmethod
    def start(cls, name: str, argv: list[str], logdir: Path, launch, group: bool = True) -> "Proc":
        """``launch(argv, stdout=f, stderr=f)`` returns a Popen (subprocess or Mininet host)."""
        safe = name.replace("/", "_")
        out, err = logdir / f"{safe}.out", logdir / f"{safe}.err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            popen = launch(argv, stdout=fo, stderr=fe)
        return cls(name, popen, out, err, group)

    def poll(self) -> int | None:
        rc = self.popen.poll()
        if rc is not None and self.seconds is None:
            self.seconds = time.monotonic() - self.t0
        return rc

    def stdout(self) -> str:
        return _read(self.out_path)

    def stderr(self) -> str:
        return _read(self.err_path)

    def kill(self, grace: float = 1.0) -> None:
        if self.popen.poll() is None:
            kill_process(self.pid, self.started, group=self.group, grace=grace)
            if self.popen.poll() is None:
                # mnexec -d made it a session leader; if the group is already gone, the pid.
                kill_process(self.pid, self.started, group=False, grace=grace)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.poll()


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", "replace")
    except OSError:
        return ""


class _LineFollower:
    """Feeds each complete new stdout line of each process to ``on_line(index, line)``."""

    def __init__(self, procs: list[Proc], on_line):
        self.procs, self.on_line = procs, on_line
        self.offsets = [0] * len(procs)
        self.partial = [b""] * len(procs)

    def poll(self) -> None:
        for i, p in enumerate(self.procs):
            try:
                with open(p.out_path, "rb") as f:
                    f.seek(self.offsets[i])
                    data = f.read()
            except OSError:
                continue
            self.offsets[i] += len(data)
            *lines, self.partial[i] = (self.partial[i] + data).split(b"\n")
            for line in lines:
                self.on_line(i, line.decode("utf-8", "replace"))


EARLY_S = 1.0
"""How long before a peer's failure a worker must have exited 0 to be named beside it: one
that ended with the run (past its last barrier) as a peer failed on the way out is not."""


def wait_all(procs: list[Proc], timeout: float | None, what: str = "worker",
             on_line=None, watch: list[tuple[str, Proc]] = ()) -> list[WorkerResult]:
    """Wait for every process; on a failure kill the others and raise :class:`WorkerError`.

    A failing process ends the wait early: the others (often blocked on it in a collective)
    get FAIL_GRACE seconds to fail on their own and are then killed; so does any of
    ``watch`` (name, process: the aggregators the workers need) that exits. At the timeout
    the message gives each process still running its state (one stopped by SIGSTOP says
    so). ``on_line(index, line)`` sees stdout lines as they appear (progress bars).
    """
    end = None if timeout is None else time.monotonic() + timeout
    failed_at = None
    timed_out = False
    gone: list[str] = []
    follower = _LineFollower(procs, on_line) if on_line else None
    while True:
        if follower:
            follower.poll()
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if not gone:
            gone = [f"--- {name} exited with code {p.popen.returncode} while the {what}s "
                    f"ran; stderr tail:\n{tail(p.stderr())}"
                    for name, p in watch if p.poll() is not None]
        if failed_at is None and (gone or any(c not in (None, 0) for c in codes)):
            failed_at = now
        if failed_at is not None and now - failed_at > FAIL_GRACE:
            break
        if end is not None and now > end:
            timed_out = True
            break
        time.sleep(POLL_S)
    # every state first, then the kills: a worker waiting on one just killed exits on its
    # own within a second, and would read as one that failed before the end
    states = {i: state(p.pid) for i, p in enumerate(procs) if p.poll() is None}
    for i in states:
        procs[i].kill()
    if follower:
        follower.poll()
    results = [WorkerResult(i, p.popen.returncode if p.popen.returncode is not None else -9,
                            p.stdout(), p.stderr(),
                            p.seconds if p.seconds is not None else time.monotonic() - p.t0)
               for i, p in enumerate(procs)]
    bad = [r for r in results if r.returncode != 0]
    if timed_out or bad or gone:
        own = [r for r in bad if r.rank not in states]   # the rest were killed here
        killed = (f", {len(bad) - len(own)} more killed {FAIL_GRACE:g} s later, not failing"
                  if len(own) < len(bad) else "")
        ends = {r.rank: p.t0 + r.seconds for r, p in zip(results, procs)}
        # a peer's failure fails the others (a connection closed): the first is the cause.
        # Exits are seen a poll apart at best: among those a few polls from the first, one
        # killed by a signal is taken (its peers fail on its closed connections)
        earliest = min((ends[r.rank] for r in own), default=0.0)
        near = sorted((r for r in own if ends[r.rank] - earliest <= 3 * POLL_S),
                      key=lambda r: (r.returncode >= 0, ends[r.rank]))
        first = near[0] if near else None
        cause = (f"; the first, {what} {first.rank}, {exit_said(first.returncode)} after "
                 f"{first.seconds:.1f} s" if len(own) > 1 else "")
        head = (f"{what}s timed out after {timeout:.0f} s" if timed_out
                else f"{len(own)} of {len(results)} {what}s failed{killed}{cause}" if own
                else f"a process the {what}s need exited" if gone
                else f"{len(bad)} of {len(results)} {what}s killed")
        parts = [head] + gone
        first_bad = min((ends[r.rank] for r in bad), default=None)
        for r, p in zip(results, procs):
            if r.returncode == 0 and not timed_out and first_bad is not None \
                    and ends[r.rank] < first_bad - EARLY_S:
                parts.append(f"--- {what} {r.rank} ({p.name}) exited 0 after {r.seconds:.1f} s, "
                             f"before the failure: its peers may have waited on it")
            if r.returncode != 0 or timed_out:
                when = ("at the timeout" if timed_out else
                        f"{FAIL_GRACE:g} s after a failure, not failing on its own")
                how = (f"still {states[r.rank]} {when}, killed" if r.rank in states
                       else exit_said(r.returncode))
                parts.append(f"--- {what} {r.rank} ({p.name}) {how} after {r.seconds:.1f} s; "
                             f"stderr tail:\n{tail(r.stderr)}{_last_line(r.stdout)}")
        raise WorkerError("\n".join(parts), results, timed_out, states)
    return results


def exit_said(code: int) -> str:
    """A process's exit status in words: a negative one is the signal that killed it."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _last_line(stdout: str) -> str:
    """A failed process's last line of stdout, where workers that report in JSON lines (the
    smoke worker: its error, missing workers, wrong sums) say why they failed."""
    rows = stdout.rstrip().splitlines()
    return f"\n    last stdout line: {rows[-1][:500]}" if rows else ""


def pythonize(argv: list[str], python: str) -> list[str]:
    """Commands may name ``python``/``python3``: run the testbed's interpreter instead."""
    argv = [str(a) for a in argv]
    if argv and argv[0] in ("python", "python3"):
        argv[0] = python
    return argv


def merged_env(base: dict | None, extra: dict) -> dict:
    """This process's environment, then ``extra``, then ``base``; a relative Fashion-MNIST
    folder made absolute here, as the workers start in the repository's root and the
    command checked it from the caller's folder."""
    env = dict(os.environ)
    env.update(extra)
    if base:
        env.update({k: str(v) for k, v in base.items()})
    if env.get(ENV["fashion_mnist"]):
        env[ENV["fashion_mnist"]] = os.path.abspath(env[ENV["fashion_mnist"]])
    return env
