"""A child process's lifetime tied to its starter's: the aggregators, workers and switches a
command starts must not outlive it, SIGKILL included."""
from __future__ import annotations

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
