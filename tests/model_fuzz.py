"""Model-based fuzzing of the aggregators: random interleavings of every packet a worker,
a buggy or hostile peer (malformed ones too), a re-install or the clock can produce, each
engine's replies and counters compared with the reference model's packet for packet, and
every result checked against an oracle that knows nothing of the model.

The oracle: a worker's payload for chunk ``seq`` of run ``r`` is a fixed function of
(worker, run, seq, kind), so the exact sum of a RESULT follows from its bitmap alone, and a
MAX_RESULT's lanes are the max over its bitmap. Whatever order packets arrive in, whoever
lies about slots, runs or offsets, a result that differs from that is a wrong sum. Across
results (:class:`Uses`): every result of one use (epoch, run, seq) is the same (a closed use
is frozen: every worker decodes one chunk), and a sum short of some worker comes only from
a use a FLUSH the model took closed. A job idle for RUN_IDLE_S may be taken again by any
run, its own included, which then uses its seqs afresh: the first results start over there
(a closed use stays closed).

Every fourth case of the long run takes the next of :data:`SHAPES` (a vote job, 16-bit sums,
one worker, 32 workers). ``python -m tests.model_fuzz --steps 1000000`` (``make fuzz``) runs
it and prints steps, seeds and the first counterexample; tests/test_model_fuzz.py runs a
short one.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import random
import sys
import time
from dataclasses import dataclass

import numpy as np

from thc.codec.packing import pack_bits
from thc.net.aggregator import Aggregator
from thc.wire import protocol as P
from thc.wire.jobs import Job

N_WORKERS, POOL, LANES, JOB_ID = 3, 2, 16, 9
BASE_PORT = 42000
TABLE = (0, 1, 2, 4, 6, 8, 11, 14, 16, 19, 22, 24, 26, 28, 29, 30)
GRANULARITY = 30
AGGREGATION = "thc"
SHAPES = {
    "thc": {},
    "vote": {"AGGREGATION": "vote"},
    "wide": {"TABLE": tuple(round(200 * k / 15) for k in range(16)), "GRANULARITY": 200},
    "alone": {"N_WORKERS": 1, "POOL": 1},
    "many": {"N_WORKERS": 32, "POOL": 4, "LANES": 24},
}
"""Job shapes beside the default (3 workers, pool 2, 16 lanes, 8-bit sums): a sign-vote job,
16-bit sums, one worker with a pool of one, and 32 workers (a full 32-bit bitmap)."""
FIRST_RUN = 1000
"""The interleaving's first run; later ones are newer by a step or two, and RUN_FAR is far
beyond the jump a live run allows."""
RUN_FAR = (FIRST_RUN + (1 << 31) - 1) % P.SEQ_MOD
SPAN_POOLS = 4
"""Sequence numbers drawn from [base, base + SPAN_POOLS x POOL): each slot version is used
and reused."""


@contextlib.contextmanager
def shaped(name: str):
    """The module's job shape set to ``SHAPES[name]`` for the block."""
    saved = {k: globals()[k] for k in SHAPES[name]}
    globals().update(SHAPES[name])
    try:
        yield
    finally:
        globals().update(saved)


SHARD = 1
"""The index the engines serve in a sharded job's map of three shards."""


def make_job(sharded: bool = False) -> Job:
    shards = [{"ip": "127.0.0.1", "port": BASE_PORT + 50 + k} for k in range(3)]
    kind = {"aggregation": "vote"} if AGGREGATION == "vote" else \
        {"table": TABLE, "granularity": GRANULARITY}
    return Job.from_dict({"job_id": JOB_ID, "pool_size": POOL, "lanes": LANES, **kind,
                          "workers": [{"id": i, "ip": "127.0.0.1", "port": BASE_PORT + i}
                                      for i in range(N_WORKERS)],
                          **({"shards": shards} if sharded else {})})


@functools.lru_cache(maxsize=None)
def _tag_of(shape: tuple) -> int:
    """make_job()'s tag, cached by the shape globals it reads (``shape``)."""
    return make_job().config_tag


def config_tag() -> int:
    """The job's configuration tag, which every worker's packet carries in ``bitmap``."""
    return _tag_of((AGGREGATION, N_WORKERS, POOL, LANES, TABLE, GRANULARITY))


def addr(w: int) -> tuple[str, int]:
    return ("127.0.0.1", BASE_PORT + w)


STRANGER = ("127.0.0.1", BASE_PORT + 99)


def _drawn(w: int, run: int, seq: int) -> np.ndarray:
    """Worker ``w``'s lanes for chunk ``seq`` of ``run``: table indices, or sign bits."""
    rng = np.random.default_rng((w, run, seq))
    return rng.integers(0, 2 if AGGREGATION == "vote" else 16, LANES).astype(np.uint8)


def payload_of(w: int, run: int, seq: int) -> bytes:
    """What worker ``w`` sends for chunk ``seq`` of ``run``: 4-bit indices, or a vote job's
    bits, first lane first."""
    lanes = _drawn(w, run, seq)
    if AGGREGATION == "vote":
        return np.packbits(lanes).tobytes()
    return pack_bits(lanes, P.INDEX_BITS).tobytes()


def values_of(w: int, run: int, seq: int) -> np.ndarray:
    """What the oracle adds for that chunk, from the draw, not from a payload or a Job."""
    lanes = _drawn(w, run, seq).astype(np.int64)
    return lanes if AGGREGATION == "vote" else np.asarray(TABLE, np.int64)[lanes]


def norms_of(w: int, run: int, seq: int) -> np.ndarray:
    rng = np.random.default_rng((w, run, seq, 7))
    return rng.integers(0, 1 << 31, P.MAX_LANES).astype(np.uint32)


def packet(kind: str, w: int, run: int, seq: int, slot=None, version=None,
           offset=None, nonce: int = 0, tag: int | None = None) -> bytes:
    s, v = P.slot_of(seq, POOL)
    lanes = P.MAX_LANES if kind == "MAX" else LANES
    hdr = P.Header(int(P.PktType[kind]), w, JOB_ID, s if slot is None else slot,
                   v if version is None else version, 0, seq,
                   (seq * lanes) % P.SEQ_MOD if offset is None else offset,
                   config_tag() if tag is None else tag, run, nonce)
    if kind == "DATA":
        body = payload_of(w, run, seq)
    elif kind == "MAX":
        body = norms_of(w, run, seq).astype(">u4").tobytes()
    else:
        body = b""
    return hdr.pack() + body


@dataclass
class Step:
    """One action of the interleaving, decoded from five small integers."""

    op: int
    a: int
    b: int
    c: int
    d: int


class Context:
    """What the interleaving has reached: the current run and the front of the chunks."""

    def __init__(self, base: int, nonce: int):
        self.base, self.run, self.front, self.nonces = base, FIRST_RUN, 0, [nonce]


def decode(step: Step, ctx: Context):
    """(datagram, source) to send, or ("time", seconds), or ("install", nonce): an install
    whose epoch is the job's tag and that nonce; in a job of more than one worker, also
    ("burst", [(datagram, source), ...]): every worker's DATA or MAX for one seq, which
    random single packets would seldom bring together."""
    op = step.op % 13
    w = step.a % N_WORKERS
    kind = ("DATA", "DATA", "DATA", "MAX", "MAX", "FLUSH")[step.b % 6]
    seq = (ctx.base + ctx.front + step.c % (SPAN_POOLS * POOL)) % P.SEQ_MOD
    run = ctx.run if step.d % 5 else ctx.run - 1 - step.d % 2
    if op == 0 and N_WORKERS > 1:
        kind = "MAX" if kind == "MAX" else "DATA"
        # the case's run: an older one's burst is only refused, a packet each
        return ("burst", [(packet(kind, v, ctx.run, seq), addr(v)) for v in range(N_WORKERS)])
    if op <= 6:
        return packet(kind, w, run, seq), addr(w)
    if op == 7:
        bad = step.d % 5
        if bad == 4:  # a worker configured otherwise: another tag; high bits are not read
            tag = (config_tag() ^ (1 << step.c % 16), config_tag() | 1 << 16 + step.c % 16)
            return packet(kind, w, run, seq, tag=tag[step.c // 16 % 2]), addr(w)
        if bad == 3:  # a second incarnation of the worker under the same run
            return packet(kind, w, run, seq, nonce=1 + step.c % 2), addr(w)
        if bad == 0:
            return packet(kind, w, run, seq, slot=(seq + 1) % POOL), addr(w)
        if bad == 1:
            return packet(kind, w, run, seq, version=1 - P.slot_of(seq, POOL)[1]), addr(w)
        return packet(kind, w, run, seq, offset=step.c), addr(w)
    if op == 8:   # past, at, and just short of the idle time
        idle = (P.RUN_IDLE_S + 1, P.RUN_IDLE_S, P.RUN_IDLE_S - 0.001)[step.c % 3]
        return ("time", 0.001 if step.d % 2 else idle)
    if op == 9:
        if step.d % 3 == 0:
            ctx.nonces.append(0x1000 + len(ctx.nonces))
            return ("install", ctx.nonces[-1])
        if step.d % 3 == 1:
            ctx.run += 1 + step.c % 2
        else:
            ctx.front = (ctx.front + POOL) % P.SEQ_MOD
        return ("time", 0.0)
    if op == 10:   # far beyond, at, and one past the jump a live run allows
        far = (RUN_FAR, ctx.run + P.RUN_JUMP, ctx.run + P.RUN_JUMP + 1)[step.c % 3]
        return packet(kind, w, far % P.SEQ_MOD if step.d % 4 == 0 else run, seq), addr(w)
    if op == 11:
        return malformed(packet(kind, w, run, seq), step), addr(w)
    src = STRANGER if step.d % 2 else addr((w + 1) % N_WORKERS)
    return packet(kind, w, run, seq), src


OTHER_JOB = 65000
"""A job id no engine serves."""


def malformed(datagram: bytes, step: Step) -> bytes:
    """A worker's packet made one a buggy peer sends: a header cut short, a payload a byte
    short or long or longer, another aggregation's or another type's payload length, a
    worker id outside the job, or another job's id."""
    head, body = datagram[:P.HEADER_BYTES], datagram[P.HEADER_BYTES:]
    bad = step.d % 7
    if bad == 0:
        return datagram[:step.c % P.HEADER_BYTES]
    if bad == 1:
        return datagram[:-1] if body else datagram + b"\0"
    if bad == 2:
        return datagram + bytes((1, 4, 32, 96)[step.c % 4])
    if bad == 3:   # a vote job's DATA length to a THC job, a THC job's to a vote job
        return head + bytes(LANES // 8 if AGGREGATION == "thc" else LANES // 2)
    if bad == 4:
        return head + bytes(P.MAX_LANES * 4 if head[0] == P.PktType.DATA else LANES // 2)
    fields = list(P.HEADER_STRUCT.unpack(head))
    if bad == 5:
        fields[1] = N_WORKERS + step.c % 3
    else:
        fields[2] = OTHER_JOB
    return P.HEADER_STRUCT.pack(*fields) + body


class Violation(AssertionError):
    pass


def check_reply(reply: bytes, dst, epoch: int, job: Job) -> None:
    """The oracle: a result's sums follow from its bitmap; its fields are possible."""
    hdr, payload = P.decode(reply)
    if dst != addr(hdr.worker_id):
        raise Violation(f"reply for worker {hdr.worker_id} sent to {dst}")
    if hdr.epoch != epoch:
        raise Violation(f"reply carries epoch {hdr.epoch:#x}, the install's is {epoch:#x}")
    if hdr.pkt_type not in (P.PktType.RESULT, P.PktType.MAX_RESULT):
        return
    members = [w for w in range(N_WORKERS) if hdr.bitmap >> w & 1]
    if hdr.bitmap >> N_WORKERS or len(members) != hdr.count:
        raise Violation(f"count {hdr.count} and bitmap {hdr.bitmap:#b} disagree")
    if (hdr.slot, hdr.version) != P.slot_of(hdr.seq, POOL):
        raise Violation(f"result of seq {hdr.seq} names slot {hdr.slot} version {hdr.version}")
    if hdr.pkt_type == P.PktType.RESULT:
        want = np.zeros(LANES, np.int64)
        for w in members:
            want += values_of(w, hdr.run, hdr.seq)
        got = np.frombuffer(payload, P.sum_dtype(job.sum_bits)).astype(np.int64)
    else:
        if hdr.count != N_WORKERS:
            raise Violation(f"MAX_RESULT of seq {hdr.seq} closed short (count {hdr.count})")
        want = np.maximum.reduce([norms_of(w, hdr.run, hdr.seq) for w in members])
        got = np.frombuffer(payload, ">u4").astype(np.int64)
    if not np.array_equal(got, want):
        raise Violation(f"wrong {P.PktType(hdr.pkt_type).name} for run {hdr.run} seq "
                        f"{hdr.seq} bitmap {hdr.bitmap:#b}: {got[:6]}... != {want[:6]}...")


class Uses:
    """What the oracle keeps across replies, per install: each use's first result, and the
    uses a FLUSH closed."""

    def __init__(self):
        self.first: dict[tuple, tuple] = {}
        self.flushed: set[tuple] = set()
        self.quiet = 0.0

    def elapse(self, seconds: float) -> None:
        """Time passes. Once RUN_IDLE_S went by since the record started over, the job may
        have gone idle (gaps add up; a packet between may have kept it busy, which only
        makes this start over early)."""
        self.quiet += seconds
        if self.quiet >= P.RUN_IDLE_S - 1e-6:
            self.first.clear()
            self.quiet = 0.0

    def flush(self, datagram: bytes, epoch: int) -> None:
        hdr = P.Header.unpack(datagram)
        self.flushed.add((epoch, hdr.run, hdr.seq))

    def check(self, reply: bytes, epoch: int) -> None:
        hdr, payload = P.decode(reply)
        if hdr.pkt_type not in (P.PktType.RESULT, P.PktType.MAX_RESULT):
            return
        use = (epoch, hdr.run, hdr.seq)
        if hdr.count < N_WORKERS and use not in self.flushed:
            raise Violation(f"a sum of {hdr.count} of {N_WORKERS} workers for run {hdr.run} "
                            f"seq {hdr.seq}, which no FLUSH closed")
        seen = (hdr.pkt_type, hdr.bitmap, hdr.count, bytes(payload))
        first = self.first.setdefault(use, seen)
        if first != seen:
            raise Violation(f"two results of run {hdr.run} seq {hdr.seq}: bitmaps "
                            f"{first[1]:#b} and {hdr.bitmap:#b} (a closed use must be frozen)")


class Engines:
    """The reference model (through the Python aggregator) and the engines under test."""

    def __init__(self, compiled: bool = True, sharded: bool = False):
        from thc.net import fastagg
        self.job = make_job(sharded)
        self.nonce = 0x1000
        shard = SHARD if sharded else None
        self.ref = Aggregator([self.job], nonce=self.nonce, shard=shard)
        self.others = []
        if compiled and fastagg.available():
            self.others.append(("compiled", fastagg.FastAggregator(
                [self.job], nonce=self.nonce, shard=shard)))
        self.now = 1000.0
        self.uses = Uses()

    def apply(self, action) -> None:
        if action[0] == "time":
            self.now += action[1]
            self.uses.elapse(action[1])
            return
        if action[0] == "burst":
            for one in action[1]:
                self.apply(one)
            return
        if action[0] == "install":
            self.nonce = action[1]
            self.ref.install(self.job, self.nonce)
            for _, eng in self.others:
                eng.install(self.job, self.nonce)
            return
        datagram, src = action
        drops = sum(self.ref.model.drops.values())
        want, _ = self.ref.model.handle(datagram, src, self.now)
        epoch = self.job.new_epoch(nonce=self.nonce)
        if datagram[:1] == bytes([P.PktType.FLUSH]) and sum(self.ref.model.drops.values()) == drops:
            self.uses.flush(datagram, epoch)
        for reply, dst in want:
            check_reply(reply, dst, epoch, self.job)
            self.uses.check(reply, epoch)
        for name, eng in self.others:
            got = eng.handle(datagram, src, self.now)
            if got != want:
                raise Violation(f"{name} answered {got!r}, the model {want!r}")

    def compare_counters(self) -> None:
        want = self.ref.counters()
        for name, eng in self.others:
            got = eng.counters()
            for key in ("drops", "jobs", "epochs"):
                if got[key] != want[key]:
                    raise Violation(f"{name} {key} {got[key]} != the model's {want[key]}")


def run_steps(steps: list[Step], base: int, compiled: bool = True,
              sharded: bool = False) -> Engines:
    """One interleaving from ``base``, on a central job or one shard of a sharded job."""
    engines = Engines(compiled, sharded)
    ctx = Context(base, engines.nonce)
    for k, step in enumerate(steps):
        action = decode(step, ctx)
        try:
            engines.apply(action)
        except Violation as e:
            raise Violation(f"step {k} {step} -> {describe(action)}: {e}") from None
    engines.compare_counters()
    return engines


def describe(action) -> str:
    if action[0] == "burst":
        return f"burst of {len(action[1])}: " + describe(action[1][0])
    if action[0] in ("time", "install"):
        return f"{action[0]} {action[1]}"
    if len(action[0]) < P.HEADER_BYTES:
        return f"{len(action[0])} bytes from {action[1]}"
    hdr = P.Header.unpack(action[0])
    return (f"{P.PktType(hdr.pkt_type).name} w{hdr.worker_id} run {hdr.run} seq {hdr.seq} "
            f"slot {hdr.slot}/{hdr.version} offset {hdr.offset} from {action[1]}")


BASES = (0, P.SEQ_MOD - 3)
"""Sequence numbers start at 0 or just before the 2^32 wrap."""


def random_steps(rng: random.Random, length: int) -> list[Step]:
    return [Step(*(rng.randrange(64) for _ in range(5))) for _ in range(length)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--length", type=int, default=200, help="steps per interleaving")
    args = ap.parse_args(argv)
    done, case, t0 = 0, 0, time.monotonic()
    while done < args.steps:
        seed = args.seed * 1_000_003 + case
        rng = random.Random(seed)
        steps = random_steps(rng, args.length)
        base, sharded = BASES[case % len(BASES)], case % 4 >= 2
        shape = list(SHAPES)[case // 4 % len(SHAPES)]
        try:
            with shaped(shape):
                run_steps(steps, base, sharded=sharded)
        except Violation as e:
            print(f"counterexample: seed {seed}, base {base}, sharded {sharded}, shape "
                  f"{shape}: {e}", flush=True)
            return 1
        done += len(steps)
        case += 1
        if case % 500 == 0:
            print(f"{done} steps, {case} interleavings, {time.monotonic() - t0:.0f} s, "
                  f"no disagreement", flush=True)
    print(f"{done} steps in {case} interleavings (seeds {args.seed * 1_000_003}.."
          f"{args.seed * 1_000_003 + case - 1}), {time.monotonic() - t0:.0f} s: zero "
          f"disagreements, zero wrong results", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
