"""Where `thc aggregator`'s counters go while it serves: the stats file and standard output.

Neither may hold up the serving or the stop. A file that cannot be written (its folder
removed, a full disk), a reader of the lines gone, or a reader that does not read (a
supervisor's pipe read only at the end) is said once on standard error, and serving goes on.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path


class LineWriter:
    """Lines to a file descriptor, written by a thread of their own: a full pipe blocks that
    thread, never the caller. Counters lines are snapshots, so a line still waiting when the
    next comes is replaced by it. A stream with a file descriptor is written with os.write,
    not through its buffer, whose lock a thread blocked in a write would hold at the
    interpreter's exit; one without (a test's capture) through its own write."""

    def __init__(self, stream):
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            fd = None
        self._write = (lambda data: os.write(fd, data)) if fd is not None \
            else (lambda data: _write_stream(stream, data))
        self._cond = threading.Condition()
        self._waiting: bytes | None = None
        self._writing = False
        self.gone = False
        """The reader closed its end (EPIPE): lines stop."""
        self.replaced = 0
        """Lines replaced by a newer one before they could be written."""
        self._thread = threading.Thread(target=self._run, name="thc-counters-lines",
                                        daemon=True)
        self._thread.start()

    def put(self, line: str) -> None:
        with self._cond:
            if self.gone:
                return
            if self._waiting is not None:
                self.replaced += 1
            first = self.replaced == 1 and self._waiting is not None
            self._waiting = (line + "\n").encode()
            self._cond.notify_all()
        if first:
            print("thc aggregator: standard output is not being read: each counters line "
                  "waits for it, a newer one replacing it; serving goes on", file=sys.stderr,
                  flush=True)

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the lines put to be written (or the reader to
        be gone); False where a line still waits."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.gone or (self._waiting is None and not self._writing), timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting is not None)
                data, self._waiting, self._writing = self._waiting, None, True
            try:
                while data:
                    data = data[self._write(data):]
            except OSError as e:   # EPIPE: the reader went away; EBADF: the stream closed
                with self._cond:
                    self.gone, self._writing = True, False
                    self._cond.notify_all()
                print(f"thc aggregator: standard output closed ({e.strerror}): counters lines "
                      "stop; serving goes on", file=sys.stderr, flush=True)
                return
            with self._cond:
                self._writing = False
                self._cond.notify_all()


def _write_stream(stream, data: bytes) -> int:
    stream.write(data.decode())
    stream.flush()
    return len(data)


class Report:
    """The counters as a file rewritten whole and as JSON lines on standard output."""

    FINAL_WAIT = 5.0
    """Seconds the final line may wait for a reader before the aggregator exits without it."""

    def __init__(self, stats_file: str | None):
        # written through a link, to the file it names: a link stays a link
        self.path = None if not stats_file else Path(stats_file).resolve()
        self.failed: str | None = None
        self._lines = LineWriter(sys.stdout)

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
                print(f"thc aggregator: --stats-file: cannot write it ({e}); serving goes on",
                      file=sys.stderr, flush=True)

    def line(self, stats: dict) -> None:
        self._lines.put(json.dumps(stats))

    def final(self, stats: dict) -> None:
        """The last counters, to the file and as the last line, which waits for a reader at
        most :attr:`FINAL_WAIT` seconds."""
        self.file(stats)   # the file agrees with the last line
        self.line(stats)
        if not self._lines.drain(self.FINAL_WAIT):
            kept = f" ({self.path} has them)" if self.path is not None and not self.failed \
                else ""
            print(f"thc aggregator: standard output was not read for {self.FINAL_WAIT:.0f} s: "
                  f"exiting without the final counters line{kept}", file=sys.stderr,
                  flush=True)
