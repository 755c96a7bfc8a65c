"""Local clusters for tests, benchmarks and single-machine runs: jobs on loopback ports."""
from __future__ import annotations

import collections
import os
import random
import socket

from thc.wire import protocol as P
from thc.wire.jobs import Job


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (P4Runtime and Thrift servers of local switches, rendezvous
    of process groups): a block of one (:func:`free_port_block`), so never one this process
    handed out lately, nor one another pytest-xdist process may hand out, where the kernel's
    choice for a bind to port 0 may repeat in either."""
    return free_port_block(1, host, tcp=True)


def _below_ephemeral() -> int:
    """The first port the kernel hands out to a bind to port 0 (32768 where unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _block_range(n: int) -> tuple[int, int]:
    """Where a block of ``n`` ports may start: below the ephemeral range, and within this
    process's share of it when pytest-xdist runs several (``gwK`` of N): a block found free
    is closed again before its workers bind it, and another process's block must not take
    its ports in between."""
    lo, hi = 10000, _below_ephemeral()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if count > 1 and worker.startswith("gw") and worker[2:].isdigit():
        width = (hi - lo) // count
        lo += int(worker[2:]) % count * width
        hi = lo + width
    return lo, hi - n


_GIVEN: collections.deque = collections.deque(maxlen=64)
"""The blocks this process handed out last, (base, end): free again until their workers
bind them, and not to be handed out twice (a job's block, then its aggregator's port)."""


def free_port_block(n: int, host: str = "127.0.0.1", tcp: bool = False) -> int:
    """A base port with ``n`` free consecutive UDP ports (workers of a local job); with ``tcp``,
    free for TCP too (a rendezvous port among them). Below the ephemeral range: a socket
    bound to port 0 later (a test's aggregator) cannot be handed one of them; and none of
    the blocks this process handed out lately."""
    low, top = _block_range(n)
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, top) if top > low else None
        if base is not None and any(base < end and b < base + n for b, end in _GIVEN):
            continue
        if base is None:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind((host, 0))
                base = s.getsockname()[1]
            if base + n >= 65535:
                continue
        socks = []
        try:
            for i in range(n):
                for kind in (socket.SOCK_DGRAM,) + ((socket.SOCK_STREAM,) if tcp else ()):
                    socks.append(socket.socket(socket.AF_INET, kind))
                    socks[-1].bind((host, base + i))
            _GIVEN.append((base, base + n))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"no block of {n} free UDP ports on {host}")


def local_job(job_id: int, n_workers: int, base_port: int, granularity: int = 30,
              p: float = 1 / 32, pool_size: int = 64, lanes: int = P.LANES,
              ip: str = "127.0.0.1", table=None) -> Job:
    """A job whose workers listen on consecutive loopback ports (tests, local runs)."""
    workers = [{"id": i, "ip": ip, "port": base_port + i} for i in range(n_workers)]
    d = {"job_id": job_id, "workers": workers, "granularity": granularity,
         "pool_size": pool_size, "lanes": lanes}
    if table is None:
        d["p"] = p
    else:
        d["table"] = list(table)
    return Job.from_dict(d)
