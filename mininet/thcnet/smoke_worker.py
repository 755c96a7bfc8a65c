"""One worker of the smoke all-reduce: random 4-bit indices through the aggregator.

``python -m thc.emu.smoke_worker --rank R --config cluster.json --agg IP:PORT --numel N --seed S``

Worker r draws its indices from seed S + r, so anyone can recompute every worker's vector and
the exact integer sums (:func:`reference_sums`); round k rolls every worker's vector by
:func:`round_shift` (a result replayed from another round is then wrong), and its sums are
checked rolled alike. Prints one JSON line: rank, seed, seconds, the SHA-256 of the last sums (in
the reference's order), how many differ from the reference, rounds done, transport stats; a
failure (timeout, aggregator restarted, refused, any other) is a JSON line with its cause
(for a refusal its ``reason``), the mismatches found before it, and exit code 3, so a fault
experiment can tell a clear failure from a crash.

Fault experiments (docs/faults.md) also use: ``--loss-bound F`` (DLCP: chunks may be closed
short; each chunk is then checked against the workers its bitmap names, not all of them; the
line adds ``loss_bound``, ``short_last_round`` and ``bitmaps``, chunks per contributors'
bitmap), ``--start-delay S`` before round ``--late-round`` (a straggler) and
``--out-of-step P`` (this worker's process also sends MAX packets at the seqs of its DATA
chunks, through its own socket; the line adds ``out_of_step``, how many). Without them the
line is as above.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import socket
import sys
import time
from pathlib import Path

import numpy as np

from thc.codec.packing import pack_bits
from thc.collective import worker
from thc.net.client import AggregationRefused
from thc.net.impair import Impairment
from thc.wire import protocol as P
from thc.wire.jobs import Cluster


def indices(seed: int, rank: int, numel: int) -> np.ndarray:
    return np.random.default_rng(seed + rank).integers(0, 1 << P.INDEX_BITS, numel,
                                                       dtype=np.uint8)


def padded(numel: int, lanes: int) -> int:
    return -(-numel // lanes) * lanes


def reference_sums(table, n_workers: int, seed: int, numel: int) -> np.ndarray:
    lut = np.asarray(table, dtype=np.uint16)
    total = np.zeros(numel, dtype=np.uint16)
    for r in range(n_workers):
        total += lut[indices(seed, r, numel)]
    return total


def round_shift(rnd: int, numel: int) -> int:
    """How far every worker rolls its indices in round ``rnd``: each round sends another
    vector, so a result replayed from an earlier round differs from the round's reference
    (7919 is prime: two rounds share a shift only where their distance times it is a
    multiple of ``numel``)."""
    return rnd * 7919 % numel if numel else 0


def bitmap_reference(table, n_workers: int, seed: int, numel: int, lanes: int,
                     bitmaps: np.ndarray, shift: int = 0) -> np.ndarray:
    """The exact sums when chunk i holds only the workers in ``bitmaps[i]`` (a chunk closed
    short by a FLUSH): per chunk, the table values of those workers' indices (rolled by
    ``shift``, as the round sent them)."""
    lut = np.asarray(table, dtype=np.uint16)
    member = np.repeat(np.asarray(bitmaps, dtype=np.uint32), lanes)[:numel]
    total = np.zeros(numel, dtype=np.uint16)
    for r in range(n_workers):
        counted = (member >> r) & 1 == 1
        total += np.where(counted, lut[np.roll(indices(seed, r, numel), shift)],
                          0).astype(np.uint16)
    return total


def bitmap_mismatches(sums, ref, counts, bitmaps, lanes: int) -> int:
    """Lanes that differ from the bitmap reference, plus every lane of a chunk whose count is
    not the number of workers its bitmap names."""
    wrong = int(np.count_nonzero(sums != ref))
    bad = [i for i, (c, b) in enumerate(zip(counts, bitmaps)) if int(c) != bin(int(b)).count("1")]
    return wrong + len(bad) * lanes


class OutOfStepSocket(socket.socket):
    """A worker's UDP socket that, after a DATA chunk it sends, also sends with probability
    ``p`` a MAX at the same seq (slot, version, run and incarnation): a worker whose process
    runs a MAX round where the others sum. The MAX carries the offset a MAX round gives the
    chunk at that index (index x 32 lanes), so the aggregator's REFUSED for it matches no
    DATA chunk this worker waits for; chunk 0 of a vector, where both offsets are 0, gets
    none. Only the Python datapath sends through :meth:`sendto`."""

    def __init__(self, p: float, lanes: int, seed: int):
        super().__init__(socket.AF_INET, socket.SOCK_DGRAM)
        self.p, self.lanes, self.rng = p, lanes, random.Random(seed)
        self.injected = 0
        self._payload = P.floats_to_ordered_u32(
            np.full(P.MAX_LANES, 1.0, np.float32)).astype(">u4").tobytes()

    def sendto(self, data, *args):
        n = super().sendto(data, *args)
        hdr = P.Header.unpack(data)
        if hdr.pkt_type == P.PktType.DATA and self.rng.random() < self.p:
            offset = hdr.offset // self.lanes * P.MAX_LANES
            if offset != hdr.offset:
                mx = P.Header(int(P.PktType.MAX), hdr.worker_id, hdr.job_id, hdr.slot,
                              hdr.version, 0, hdr.seq, offset, hdr.bitmap, hdr.run,
                              hdr.epoch)
                super().sendto(mx.pack() + self._payload, *args)
                self.injected += 1
        return n


def digest(sums: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(sums, dtype=np.uint16).tobytes()).hexdigest()


def _stop_round(until: str) -> float:
    """The round count after which every worker stops (DIR/stop), or infinity."""
    try:
        return int(Path(until, "stop").read_text())
    except (OSError, ValueError):
        return float("inf")


def _halt(until: str, rank: int, rounds: int, wait: float) -> float:
    """Once the driver asks for a halt (DIR/halt): report the rounds done (DIR/done-RANK) and
    wait for the round count to stop at (DIR/stop, at most ``wait`` seconds: else this count).

    Every worker halts at the same count c: halting at c means not sending round c + 1, so no
    worker can finish it, and a worker that sent it before the halt waits in it. The driver
    names c + 1, which those finish and the halted ones run, so all stop together. (A count
    chosen from progress read while the workers run may be passed before it is written.)"""
    tmp = Path(until, f"tmp-{rank}")
    tmp.write_text(str(rounds))
    tmp.rename(Path(until, f"done-{rank}"))   # renamed into place: never read empty
    end = time.monotonic() + wait
    while (stop := _stop_round(until)) == float("inf") and time.monotonic() < end:
        time.sleep(0.01)
    return rounds if stop == float("inf") else stop


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    worker.add_arguments(ap, process_group=False)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--rounds", type=int, default=1,
                    help="aggregate the vector this many times (each checked)")
    Impairment.add_arguments(ap, "chunks")
    ap.add_argument("--until", metavar="DIR", default=None,
                    help="streams of a set duration: once DIR/halt exists, write "
                         "DIR/done-RANK (rounds finished), wait for DIR/stop and stop at the "
                         "round count it holds (--rounds stays the upper bound)")
    ap.add_argument("--start-delay", type=float, default=0.0, metavar="SECONDS",
                    help="wait this long before round --late-round's first chunk: a "
                         "straggler (testing)")
    ap.add_argument("--late-round", type=int, default=0, metavar="N",
                    help="the round (from 0) that --start-delay comes before (default 0; a "
                         "loss bound closes chunks short only from round 1 on)")
    ap.add_argument("--out-of-step", type=float, default=0.0, metavar="P",
                    help="after each DATA chunk sent, also send a MAX at its seq with this "
                         "probability, through this worker's socket: an out-of-step worker "
                         "(testing; runs the Python datapath); reported as out_of_step")
    args = ap.parse_args(argv)
    if not 0.0 <= args.out_of_step <= 1.0:
        ap.error("--out-of-step must lie in [0, 1]")
    if args.start_delay < 0:
        ap.error("--start-delay must not be negative")
    if args.late_round < 0:
        ap.error("--late-round must not be negative")
    return args


def _out_of_step_socket(args, job) -> tuple[OutOfStepSocket | None, dict]:
    """With --out-of-step, the worker's own socket that injects MAX packets, and the client
    options it needs (the Python datapath sends through it); else none."""
    if not args.out_of_step:
        return None, {}
    me = job.worker(args.rank)
    sock = OutOfStepSocket(args.out_of_step, job.lanes, args.seed + args.rank)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    sock.bind((me.ip, me.port))
    return sock, {"datapath": "python"}


def _mismatches(args, job, result, shift: int, ref: np.ndarray,
                bounded: bool) -> tuple[int, np.ndarray]:
    """A round's sums unlike the reference's (under a loss bound, the reference of the
    workers each chunk's bitmap names), and its sums in the reference's order."""
    got = result.sums[: args.numel]
    sums = np.roll(got, -shift)   # the reference's order: digests compare
    if not bounded:
        return int(np.count_nonzero(sums != ref)), sums
    want = bitmap_reference(job.table, job.n_workers, args.seed, args.numel, job.lanes,
                            result.bitmaps, shift)
    return bitmap_mismatches(got, want, result.counts, result.bitmaps, job.lanes), sums


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    cluster = Cluster.load(args.config)
    job = cluster.jobs[0]
    idx = np.zeros(padded(args.numel, job.lanes), dtype=np.uint8)
    mine = indices(args.seed, args.rank, args.numel)
    impair = Impairment.from_args(args, seed=args.rank)
    ref = reference_sums(job.table, job.n_workers, args.seed, args.numel)
    mismatches, rounds, sums = 0, 0, np.zeros(0, ref.dtype)   # no round: no reference digest
    sock, extra = _out_of_step_socket(args, job)
    with worker.client_from_args(args, cluster=cluster, impair=impair, sock=sock,
                                 **extra) as client:
        bounded = client.loss_bound > 0
        last = None
        t0 = time.perf_counter()
        try:
            stop = float("inf")
            for _ in range(args.rounds):
                if args.until and stop == float("inf") and Path(args.until, "halt").exists():
                    stop = _halt(args.until, args.rank, rounds, args.deadline * 2)
                if rounds >= stop:
                    break
                if rounds == args.late_round:
                    time.sleep(args.start_delay)
                shift = round_shift(rounds, args.numel)
                idx[: args.numel] = np.roll(mine, shift)
                last = client.reduce(pack_bits(idx, P.INDEX_BITS))
                wrong, sums = _mismatches(args, job, last, shift, ref, bounded)
                mismatches += wrong
                rounds += 1
        except Exception as e:  # noqa: BLE001 - any failure reports the mismatches found so far
            # (a worker that took a wrong sum and then failed otherwise printed no line, and
            # its row read "exact where returned")
            line = {"rank": args.rank, "seed": args.seed, "error": type(e).__name__,
                    "message": str(e),
                    "missing": getattr(e, "missing", None), "rounds": rounds,
                    "mismatches": mismatches, "seconds": time.perf_counter() - t0,
                    "stats": vars(client.stats)}
            if isinstance(e, AggregationRefused):
                line["reason"] = e.reason
            print(json.dumps({**line, **_extras(args, sock, client, last)}), flush=True)
            return 3
        seconds = time.perf_counter() - t0
        stats = vars(client.stats)
        extras = _extras(args, sock, client, last)
    print(json.dumps({"rank": args.rank, "seed": args.seed, "seconds": seconds,
                      "sha256": digest(sums),
                      "mismatches": mismatches, "numel": args.numel, "rounds": rounds,
                      "stats": stats, **extras}), flush=True)
    return 0 if mismatches == 0 else 1


def _extras(args, sock, client, last) -> dict:
    """What the fault options add to the JSON line (nothing without them)."""
    out = {}
    if args.out_of_step:
        out["out_of_step"] = sock.injected
    if client.loss_bound > 0:
        out["loss_bound"] = client.loss_bound
        counts = last.counts if last else np.zeros(0, np.uint8)
        bitmaps = last.bitmaps if last else np.zeros(0, np.uint32)
        out["short_last_round"] = int(np.count_nonzero(counts < client.job.n_workers))
        out["bitmaps"] = {hex(int(b)): int(k) for b, k in
                          zip(*np.unique(bitmaps, return_counts=True))}
    return out


if __name__ == "__main__":
    sys.exit(main())
