"""Worker processes for the tests' process groups, forked from one server that imported torch
and the collectives once: a spawned process imports them again (torch, and DDP's
torch._dynamo, take seconds a process on a small machine). Each worker starts from the
environment of the test that started it, as a spawned one would, not the server's."""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import queue as queues
import time

PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "thc.collective.ddp", "thc.app.train"]
"""What the server imports before it forks: the heavy imports the workers share."""


def context():
    """The multiprocessing context whose processes fork from the preloaded server."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def fresh_server() -> None:
    """Stop the fork server if one runs, so the next process starts a new one from this
    process's state: a test that wants its workers apart from the ones earlier tests forked
    (multiprocessing has no public call for it; the server otherwise lives as long as this
    process)."""
    stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
    if stop is not None:
        stop()


def _with_env(env: dict, target, *args) -> None:
    from thc.codec import settings
    os.environ.clear()
    os.environ.update(env)
    settings.reset()
    target(*args)


def _until_read(read, target, *args) -> None:
    """``target(*args)``; then, where it returned, the process waits until ``read`` is set:
    a torch tensor put on a queue travels as a file descriptor its sender serves, and a
    sender gone before the read fails it (FileNotFoundError in the reader). One that raised
    exits at once, for :func:`gloo_pair` to name."""
    target(*args)
    read.wait(60)


def start(target, *args, daemon: bool = True):
    """A started process running ``target(*args)`` in this process's current environment."""
    p = context().Process(target=_with_env, args=(dict(os.environ), target, *args),
                          daemon=daemon)
    p.start()
    return p


def queue():
    return context().Queue()


def gloo_pair(target, world: int = 2, port: int | None = None) -> dict:
    """Run ``target(rank, port, q)`` in ``world`` processes; each puts (rank, result) on
    ``q``. Returns {rank: result}; a worker that exits without one (it raised) fails the test
    at once, naming it, rather than leave the others waiting."""
    from thc.testing.clusters import free_tcp_port
    q, read = queue(), context().Event()
    port = free_tcp_port() if port is None else port
    ps = [start(_until_read, read, target, r, port, q) for r in range(world)]
    try:
        res = _results(ps, q, world)
    finally:
        read.set()
    [p.join(30) for p in ps]
    return res


def _results(ps, q, world: int) -> dict:
    res, end = {}, time.monotonic() + 240
    while len(res) < len(ps):
        try:
            rank, out = q.get(timeout=1)
            res[rank] = out
            continue
        except queues.Empty:
            pass
        gone = [r for r, p in enumerate(ps) if r not in res and p.exitcode is not None]
        if gone and q.empty():
            raise AssertionError(f"worker {gone[0]} exited ({ps[gone[0]].exitcode}) without "
                                 f"a result: its traceback is in the captured stderr")
        if time.monotonic() > end:
            raise AssertionError(f"no result from workers {sorted(set(range(world)) - set(res))}"
                                 f" in 240 s")
    return res
