"""Reading `thc aggregator --stats-file` counters that are known to be current.

The aggregator rewrites its stats file on a timer, so a plain read may show counters taken
before the packets a caller just saw answered. :func:`fresh_stats` waits for the file to be
replaced twice after the call: the second replacement holds counters read after the first
one was written, hence after the call began, however slowly the aggregator is scheduled.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def _signature(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def fresh_stats(paths: Sequence[Path | str], timeout: float = 30.0,
                alive: Callable[[], bool] | None = None, poll: float = 0.02) -> list[dict]:
    """The counters of each stats file in ``paths``, each from a rewrite that began after
    this call. Raises TimeoutError after ``timeout`` seconds, or RuntimeError as soon as
    ``alive()`` says the writer is gone."""
    paths = [Path(p) for p in paths]
    seen = [_signature(p) for p in paths]
    changes = [0] * len(paths)
    end = time.monotonic() + timeout
    while min(changes) < 2:
        if alive is not None and not alive():
            raise RuntimeError(f"the aggregator writing {paths[0]} is not running")
        if time.monotonic() > end:
            raise TimeoutError(f"{[str(p) for p in paths]} not rewritten twice within "
                               f"{timeout:.0f}s")
        time.sleep(poll)
        for i, p in enumerate(paths):
            sig = _signature(p)
            if sig is not None and sig != seen[i]:
                seen[i] = sig
                changes[i] += 1
    return [json.loads(p.read_text()) for p in paths]
