"""A deadline for Mininet's own calls, which run commands through the nodes' shells and read
their output with no deadline: a shell killed (`mn -c` on this machine) or stopped (SIGSTOP)
under them, or one that does not answer, would leave the caller waiting for good.

The watch kills every shell and interrupts the main thread's read: SIGUSR2, whose handler
raises :class:`~thc.emu.errors.TestbedError` naming the cause. Off the main thread no handler
can be set, and the call runs unwatched."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

from thc.emu.errors import TestbedError
from thc.emu.procs import state

POLL_S = 0.5


def shell_exited(node) -> bool:
    """Whether a Mininet node's shell has exited (or never started)."""
    shell = getattr(node, "shell", None)
    return shell is None or shell.poll() is not None


def shell_stopped(node) -> str | None:
    """How a node's running shell is stopped ("stopped (SIGSTOP?)"), None where it is not."""
    shell = getattr(node, "shell", None)
    st = state(shell.pid) if shell is not None else ""
    return st if st.startswith("stopped") else None


def shell_trouble(nodes) -> list[str]:
    """What is wrong with the shells of ``nodes``: exited or stopped, by node."""
    out = []
    for n in nodes:
        if shell_exited(n):
            out.append(f"the shell of Mininet node {n.name} exited (killed, or `mn -c` run "
                       f"on this machine)")
        elif st := shell_stopped(n):
            out.append(f"the shell of Mininet node {n.name} is {st}")
    return out


@contextlib.contextmanager
def watched(nodes: Callable[[], list], what: str, seconds: float,
            shells_matter: bool = True) -> Iterator[None]:
    """Run the body with a deadline of ``seconds``; where ``shells_matter``, a shell of
    ``nodes()`` that exits or stops ends it at once (within :data:`POLL_S`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    why: list[str] = []
    done = threading.Event()
    lock = threading.Lock()
    closed, fired = [False], [False]
    main = threading.main_thread().ident

    def stuck(_signum, _frame):
        raise TestbedError(f"{what}: {why[0] if why else 'interrupted'}: its shells killed")

    def watch() -> None:
        end = time.monotonic() + seconds
        while not done.wait(POLL_S):
            try:
                now = list(nodes())
            except Exception:  # noqa: BLE001 - the node table changing under the read
                continue
            trouble = shell_trouble(now) if shells_matter else []
            if not trouble and time.monotonic() < end:
                continue
            why.append(trouble[0] if trouble else
                       f"took over {seconds:g} s (a node's shell does not answer)")
            for n in now:
                with contextlib.suppress(OSError, AttributeError):
                    n.shell.kill()
            for n in now:   # gone before the caller's teardown asks which shells are lost
                with contextlib.suppress(OSError, AttributeError, subprocess.TimeoutExpired):
                    n.shell.wait(timeout=5)
            with lock:   # never once the body is over: its caller may be unwinding already
                if not closed[0]:
                    fired[0] = True
                    signal.pthread_kill(main, signal.SIGUSR2)
            return
    old = signal.signal(signal.SIGUSR2, stuck)
    watcher = threading.Thread(target=watch, name="thc-shell-watch", daemon=True)
    try:
        watcher.start()
        yield
    finally:
        with lock:
            closed[0] = True
        done.set()
        # a signal sent may still be pending here (a Ctrl-C unwinding the body, or the body
        # ended as it came): ignoring SIGUSR2 discards it, where the default would kill
        signal.signal(signal.SIGUSR2, signal.SIG_IGN if fired[0] else old)
