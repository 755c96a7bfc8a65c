"""Deadlines for rounds replayed from a CUDA graph and not waited for, watched by a thread.

Why: NCCL's watchdog does not watch a collective replayed from a graph, and a round whose
checks are deferred (``GraphedAllReduce(deferred_checks=True)``) returns before its replay
has run. Were a peer never to join, the stream would stay stuck, and the training loop's next
wait on it (``loss.item()``) would hang without a word. Past its deadline a round ends the
process with a message that names it, as NCCL's watchdog tears a process down after one of
its collectives times out (``TORCH_NCCL_ASYNC_ERROR_HANDLING``): whether or not the caller
saw a ``TimeoutError`` first, since the stream stays stuck either way.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

GRACE = 10.0
"""Seconds past a round's own deadline before the watchdog acts (the caller's wait raises
at the deadline itself)."""
EXIT_CODE = 70
"""The process's exit status when a watched round outlasts its deadline."""


def end_process(what: str) -> None:
    print(f"thc: {what}; ending the process", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


class Watchdog:
    """Watches events (anything with ``query()``, true once done) against deadlines
    (``time.monotonic()`` seconds); ``expire(what)`` runs for one that outlasts its own."""

    def __init__(self, expire: Callable[[str], None] = end_process, interval: float = 0.05):
        self.expire = expire
        self.interval = interval
        self._watched: list[tuple[object, float, str]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, event, deadline: float, what: str) -> None:
        with self._lock:
            self._watched.append((event, deadline, what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="thc-watchdog",
                                                daemon=True)
                self._thread.start()

    @property
    def watched(self) -> int:
        with self._lock:
            return len(self._watched)

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval)
            now, late = time.monotonic(), []
            with self._lock:
                keep = []
                for event, deadline, what in self._watched:
                    try:
                        if event.query():
                            continue
                    except Exception as e:  # noqa: BLE001 - a device error: stuck, or worse
                        late.append(f"{what} (and querying it raised {type(e).__name__}: {e})")
                        continue
                    if now > deadline:
                        late.append(what)
                    else:
                        keep.append((event, deadline, what))
                self._watched = keep
            for what in late:
                try:
                    self.expire(what)
                except Exception as e:  # noqa: BLE001 - the thread must outlive one failure
                    print(f"thc watchdog: {what}; acting on it raised {e!r}", file=sys.stderr)


SHARED = Watchdog()
"""The process's watchdog: one thread (started at the first watch) for every reducer."""
