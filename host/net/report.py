"""Where `thc aggregator`'s counters go while it serves: the stats file and standard output.

Neither may hold up the serving or the stop. A file that cannot be written (its folder
removed, a full disk), a reader of the lines gone, or a reader that does not read (a
supervisor's pipe read only at the end, standard error in it too) is said once on standard
error, itself written apart from the serving, and serving goes on.
"""
from __future__ import annotations

import collections
import json
import os
import select
import sys
import threading
from pathlib import Path

NOTES_KEPT = 64
"""Notes on standard error that may wait for a reader; beyond them a new note takes the
place of the last one waiting."""


class LineWriter:
    """Lines to a stream, written by a thread of their own: a full pipe blocks that thread,
    never the caller. ``snapshots``: each line replaces one still waiting (counters lines)
    but a kept one; else lines queue, up to :data:`NOTES_KEPT`. A stream with a file
    descriptor is written with os.write, not through its buffer, whose lock a thread blocked
    in a write would hold at the interpreter's exit; one without (a test's capture) through
    its own write; none (a closed standard stream is None) takes nothing."""

    def __init__(self, stream, snapshots: bool):
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            fd = None
        self._write = (lambda data: _write_fd(fd, data)) if fd is not None \
            else (lambda data: _write_stream(stream, data))
        self._snapshots = snapshots
        self._cond = threading.Condition()
        self._waiting: collections.deque[tuple[bytes, bool]] = collections.deque()
        self._writing = False
        self.gone: str | None = None if stream is not None else "not open"
        """Why lines stop (the reader closed its end: EPIPE), None while they go."""
        self.replaced = 0
        """Lines replaced or dropped before they could be written."""
        if self.gone is None:
            threading.Thread(target=self._run, name="thc-report-lines", daemon=True).start()

    def put(self, line: str, keep: bool = False) -> bool:
        """Queue ``line``, which no later line replaces where ``keep``; True where it is the
        first to replace or drop a waiting one."""
        with self._cond:
            if self.gone is not None:
                return False
            dropped = bool(self._waiting) and not self._waiting[-1][1] and (
                self._snapshots or len(self._waiting) >= NOTES_KEPT)
            if dropped:
                self._waiting.pop()
                self.replaced += 1
            self._waiting.append(((line + "\n").encode(), keep))
            self._cond.notify_all()
            return dropped and self.replaced == 1

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the lines put to be written (or the reader to
        be gone); False where a line still waits."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.gone is not None or not (self._waiting or self._writing), timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._waiting))
                data = self._waiting.popleft()[0]
                self._writing = True
            try:
                while data:
                    data = data[self._write(data):]
            except Exception as e:  # noqa: BLE001 - EPIPE, EBADF, a stream that fails: lines stop
                with self._cond:
                    self.gone = getattr(e, "strerror", None) or type(e).__name__
                    self._writing = False
                    self._waiting.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._writing = False
                self._cond.notify_all()


def _write_fd(fd: int, data: bytes) -> int:
    """os.write, waiting where the descriptor is non-blocking and full (a parent may have set
    O_NONBLOCK on a pipe it shares) instead of taking EAGAIN for a reader gone."""
    while True:
        try:
            return os.write(fd, data)
        except BlockingIOError:
            select.select([], [fd], [])
        except InterruptedError:
            continue


def _write_stream(stream, data: bytes) -> int:
    stream.write(data.decode())
    stream.flush()
    return len(data)


class Report:
    """The counters as a file rewritten whole and as JSON lines on standard output; notes
    about either on standard error. Nothing here waits for a reader but :meth:`announce`
    and :meth:`final`, for at most :attr:`ANNOUNCE_WAIT` and :attr:`FINAL_WAIT` seconds."""

    FINAL_WAIT = 5.0
    """Seconds the final line may wait for a reader before the aggregator exits without it."""

    ANNOUNCE_WAIT = 1.0
    """Seconds the first line may wait for a reader before the notes follow it."""

    def __init__(self, stats_file: str | None):
        # written through a link, to the file it names: a link stays a link
        self.path = None if not stats_file else Path(stats_file).resolve()
        self.failed: str | None = None
        self._lines = LineWriter(sys.stdout, snapshots=True)
        self._notes = LineWriter(sys.stderr, snapshots=False)
        self._said_gone = False

    def announce(self, text: str) -> None:
        """The first line on standard output (where it listens): never replaced by a counters
        line, and written before any note where standard error shares its pipe, unless no
        one reads it for :attr:`ANNOUNCE_WAIT` seconds."""
        self._lines.put(text, keep=True)
        self._lines.drain(self.ANNOUNCE_WAIT)
        self._say_gone()

    def note(self, text: str) -> None:
        """``text`` on standard error, prefixed with the command's name."""
        self._notes.put(f"thc aggregator: {text}")

    def file(self, stats: dict) -> None:
        if self.path is None:
            return
        try:   # whole files only: readers poll it while it is rewritten
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(stats, indent=2) + "\n")
            os.replace(tmp, self.path)
            self.failed = None
        except OSError as e:
            if self.failed != str(e):
                self.failed = str(e)
                self.note(f"--stats-file: cannot write it ({e}); serving goes on")

    def line(self, stats: dict) -> None:
        if self._lines.put(json.dumps(stats)):
            self.note("standard output is not being read: each counters line waits for it, "
                      "a newer one replacing it; serving goes on")
        self._say_gone()

    def _say_gone(self) -> None:
        if self._lines.gone is not None and not self._said_gone:
            self._said_gone = True
            self.note(f"standard output closed ({self._lines.gone}): counters lines stop; "
                      "serving goes on")

    def final(self, stats: dict) -> None:
        """The last counters, to the file and as the last line, which waits for a reader at
        most :attr:`FINAL_WAIT` seconds; the notes have a second more."""
        self.file(stats)   # the file agrees with the last line
        self.line(stats)
        if not self._lines.drain(self.FINAL_WAIT):
            kept = f" ({self.path} has them)" if self.path is not None and not self.failed \
                else ""
            self.note(f"standard output was not read for {self.FINAL_WAIT:.0f} s: exiting "
                      f"without the final counters line{kept}")
        self._say_gone()
        self.end()

    def end(self) -> None:
        """Before the exit: the notes waiting get a second to be read."""
        self._notes.drain(1.0)
