"""A load generator for benchmarks: some of a job's workers played from the compiled
datapath's C code, each streaming DATA chunks with a window in flight."""
from __future__ import annotations

import socket

from thc.net.addresses import ipv4_int
from thc.net.cext import TYPE_CODES, UNAVAILABLE, _fastagg
from thc.wire.jobs import Job


def drive(socks: dict[int, socket.socket], aggregator: tuple[str, int], job: Job, run: int,
          chunks: int, window: int, payloads: dict[int, bytes], rto: float = 0.1,
          deadline: float = 120.0) -> dict:
    """Worker ``w`` streams ``chunks`` DATA chunks of ``payloads[w]`` from ``socks[w]`` with
    ``window`` in flight, resending its outstanding chunks after ``rto`` seconds without a
    result."""
    if UNAVAILABLE is not None:
        raise RuntimeError(UNAVAILABLE)
    ip = ipv4_int(aggregator[0])
    if ip is None:
        raise ValueError(f"the load generator takes an IPv4 aggregator, got {aggregator[0]!r}")
    seconds, results, sent, retransmitted, complete = _fastagg.drive(
        [(s.fileno(), w) for w, s in socks.items()], ip, aggregator[1], job.job_id,
        job.pool_size, job.lanes, run, job.config_tag, chunks, window, [payloads[w] for w in socks],
        TYPE_CODES, rto, deadline)
    return {"seconds": seconds, "results": results, "sent": sent,
            "retransmitted": retransmitted, "complete": complete}
