"""How a command and its children end: the signals that end a command unwound as Ctrl-C is
(its cleanup run, one line, the signal's status), and the aggregators, workers and switches
it starts tied to its life, SIGKILL included."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading

PR_SET_PDEATHSIG = 1


def with_parent():
    """A ``preexec_fn`` that has the child sent SIGKILL when this process ends, SIGKILL
    included (Linux's parent-death signal), which no handler here can pass on: a testbed
    killed so would leave its aggregators serving for good. SIGKILL, not SIGTERM: a stopped
    child (SIGSTOP) acts on no other signal and would stay for good. None off the main
    thread: the signal follows the thread that started the child, and another thread may
    end first."""
    if threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl   # looked up here: no dlopen in the child

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:   # ended before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)
    return arm


class Terminated(SystemExit):
    """Raised in the main thread when SIGTERM/SIGHUP arrives under :func:`signals_raise`."""


def stopped_by(e: KeyboardInterrupt | Terminated) -> tuple[str, int]:
    """How a run was stopped, in words ("interrupted", "terminated (SIGTERM)"), and the exit
    status that says so (130 for Ctrl-C, else 128 + the signal's number)."""
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", 130
    try:
        name = signal.Signals(e.code - 128).name
    except ValueError:
        name = f"status {e.code}"
    return f"terminated ({name})", e.code


@contextlib.contextmanager
def _handling(signals, handler):
    """``handler`` for each of ``signals`` not ignored (a signal the process was started to
    ignore stays ignored), the old handlers back after."""
    old = {}
    for sig in signals:
        if signal.getsignal(sig) is signal.SIG_IGN:
            continue
        with contextlib.suppress(ValueError, OSError):
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, h)


@contextlib.contextmanager
def signals_raise():
    """Turn SIGTERM and SIGHUP into an exception so ``with`` blocks unwind and clean up.

    SIGINT already raises KeyboardInterrupt. A signal ignored stays ignored (``nohup``: the
    terminal's hangup must not end the command). Only the main thread can install handlers;
    elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise Terminated(128 + signum)

    with _handling((signal.SIGTERM, signal.SIGHUP), handler):
        yield


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT/SIGTERM/SIGHUP during teardown so a second Ctrl-C cannot interrupt it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    try:
        with _handling((signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
                       lambda s, f: got.append(s)):
            yield
    finally:
        if got:
            if got[0] == signal.SIGINT:
                raise KeyboardInterrupt
            raise Terminated(128 + got[0])
