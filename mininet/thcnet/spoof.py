"""A forger of aggregator replies, for the fault matrix's "spoofed replies" row.

``python -m thc.emu.spoof --config cluster.json --bind IP:PORT --run-id R --epoch E --chunks C
--rounds K --stop FILE [--progress FILE] [--rate PPS]``

Not the aggregator (another port on its host, or another host), it sends every worker forged
``RESULT`` datagrams with plausible fields: the job, the worker, the slot and version of the
seq, the chunk's offset (seq mod C chunks per vector, times the lanes), count n and a full
bitmap, the run the workers were given and the epoch the aggregator answers with, and sums
no larger than n x granularity (but not the workers' sums); every 8th forgery is a
``REFUSED`` (stale_run) instead, which a client that took it would raise on. It aims at the
seqs in flight: ``--progress FILE`` holds the chunks completed so far and when the counters
said so (``DONE UNIX_TIME``; the driver writes it from the aggregator's counters), the forger
extrapolates at the rate the last two readings show and covers two pools of seqs from there.
It starts once that file exists (the workers stream), stops once ``--stop FILE`` exists and
prints one JSON line: what it sent.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import numpy as np

from thc.collective.worker import run_arg
from thc.net.addresses import parse_hostport
from thc.wire import protocol as P
from thc.wire.jobs import Cluster

REFUSED_EVERY = 8


class Progress:
    """Where the stream is now, from the driver's readings of the aggregator's counters."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.last: tuple[int, float] | None = None
        self.rate = 0.0

    def started(self) -> bool:
        return self.path is None or self.path.exists()

    def estimate(self) -> int:
        if self.path is None:
            return 0
        try:
            done, stamp = self.path.read_text().split()
            done, stamp = int(done), float(stamp)
        except (OSError, ValueError):
            return self.last[0] if self.last else 0
        if self.last is not None and stamp > self.last[1] and done >= self.last[0]:
            self.rate = (done - self.last[0]) / (stamp - self.last[1])
        if self.last is None or stamp != self.last[1]:
            self.last = (done, stamp)
        return int(done + self.rate * max(0.0, time.time() - stamp))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--bind", required=True, metavar="IP:PORT", help="the forger's address")
    ap.add_argument("--run-id", dest="run", type=run_arg, required=True)
    ap.add_argument("--epoch", type=lambda t: int(t, 0), default=0,
                    help="the aggregator's epoch (0: unknown, guessed at random)")
    ap.add_argument("--chunks", type=int, required=True, help="chunks per vector")
    ap.add_argument("--rounds", type=int, default=1, help="vectors the workers stream")
    ap.add_argument("--progress", default=None, metavar="FILE")
    ap.add_argument("--stop", required=True, metavar="FILE")
    ap.add_argument("--rate", type=float, default=5000.0, help="forged datagrams a second")
    ap.add_argument("--seed", type=int, default=99)
    args = ap.parse_args(argv)

    job = Cluster.load(args.config).jobs[0]
    n, pool, lanes = job.n_workers, job.pool_size, job.lanes
    rng = np.random.default_rng(args.seed)
    epoch = args.epoch or int(rng.integers(1, P.SEQ_MOD))
    dtype = P.sum_dtype(job.sum_bits)
    top = n * job.granularity
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(parse_hostport(args.bind))
    workers = sorted(job.workers, key=lambda w: w.id)
    total = args.chunks * args.rounds
    sent = {"result": 0, "refused": 0}
    print(f"forging as {args.bind}", flush=True)
    gap = 1.0 / args.rate
    t_next = time.monotonic()
    k = 0
    progress = Progress(args.progress)
    while not progress.started() and not Path(args.stop).exists():
        time.sleep(0.01)
    t_next = time.monotonic()
    while not Path(args.stop).exists():
        first = min(progress.estimate(), max(total - 1, 0))
        for seq in range(first, min(first + 2 * pool, total)):
            if Path(args.stop).exists():
                break
            slot, version = P.slot_of(seq, pool)
            offset = (seq % args.chunks) * lanes
            for w in workers:
                k += 1
                if k % REFUSED_EVERY == 0:
                    hdr = P.Header(int(P.PktType.REFUSED), w.id, job.job_id, slot, version,
                                   int(P.DropReason.stale_run), seq, offset,
                                   (args.run + 1) % P.SEQ_MOD, args.run, epoch)
                    data = hdr.pack()
                    sent["refused"] += 1
                else:
                    hdr = P.Header(int(P.PktType.RESULT), w.id, job.job_id, slot, version, n,
                                   seq, offset, job.full_bitmap, args.run, epoch)
                    sums = rng.integers(0, top + 1, lanes).astype(dtype)
                    data = hdr.pack() + sums.tobytes()
                    sent["result"] += 1
                try:
                    sock.sendto(data, (w.ip, w.port))
                except OSError:
                    pass
                t_next += gap
                delay = t_next - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                elif delay < -0.5:
                    t_next = time.monotonic()
        if first >= total - 1:
            time.sleep(0.05)
    print(json.dumps({"forged": sent["result"] + sent["refused"], **sent,
                      "epoch_known": bool(args.epoch)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
