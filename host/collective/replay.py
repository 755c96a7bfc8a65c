"""Waiting for a round replayed from a CUDA graph: with a deadline now, or later.

Why: no NCCL watchdog watches a collective replayed from a graph, so a peer that never joins
would hang a plain wait. :func:`await_done` waits no longer than a deadline; a round whose
checks are deferred leaves a :class:`Pending` (:func:`defer`), read by the reducer's next
call and watched meanwhile by :data:`thc.collective.watchdog.SHARED`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from thc.collective import watchdog


@dataclass
class Pending:
    """A round whose checks were deferred: what the next call raises, if anything."""
    round: int
    launched: float
    done: object = None
    """Its event (None where the report is on the host already)."""
    failure: Exception | None = None
    """This worker's own error before its MAX round, which it owed its peers: they refuse
    that round at their next call, and so does this worker."""


class OnDevice:
    """An event queried with its device current: the watchdog's thread would otherwise make
    a context on the first GPU."""

    def __init__(self, event: torch.cuda.Event, device: torch.device):
        self.event, self.device = event, device

    def query(self) -> bool:
        with torch.cuda.device(self.device):
            return self.event.query()


def late(rnd: int, timeout: float) -> str:
    return (f"round {rnd} replayed from a CUDA graph did not finish in {timeout:g} s: a peer "
            f"did not take part in its collectives")


def await_done(done, start: float, rnd: int, timeout: float) -> None:
    """Wait for a replay's event, raising TimeoutError ``timeout`` seconds after ``start``. A
    short spin first (a replay of a small bucket takes tens of microseconds), then sleeps
    that release the GIL to the threads running backward."""
    while not done.query():
        waited = time.monotonic() - start
        if waited > timeout:
            raise TimeoutError(late(rnd, timeout) + " (the device may now be stuck)")
        time.sleep(0 if waited < 200e-6 else 50e-6)


def await_stream(device: torch.device, rnd: int, timeout: float) -> None:
    """Wait, with the deadline, for what the current stream of ``device`` has queued. Past
    it the stream is watched as a deferred round is: a loop that catches the TimeoutError
    and goes on would otherwise wait on the stuck stream without a word."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    start = time.monotonic()
    try:
        await_done(done, start, rnd, timeout)
    except TimeoutError:
        watchdog.SHARED.watch(OnDevice(done, device), start + timeout + watchdog.GRACE,
                              late(rnd, timeout))
        raise


def defer(report: torch.Tensor, host: torch.Tensor, rnd: int, timeout: float) -> Pending:
    """Copy ``report`` into ``host`` behind the round (at once on the CPU): the
    :class:`Pending` the next call reads, watched until then on a GPU (later than that
    call's own deadline, which raises first)."""
    pending = Pending(rnd, time.monotonic())
    if not report.is_cuda:
        host.copy_(report)
        return pending
    host.copy_(report, non_blocking=True)
    pending.done = torch.cuda.Event()
    pending.done.record(torch.cuda.current_stream(report.device))
    watchdog.SHARED.watch(OnDevice(pending.done, report.device),
                          pending.launched + timeout + watchdog.GRACE, late(rnd, timeout))
    return pending
