"""Random interleavings and directed sequences that drive thc_tna.p4's pass 0
(tests/tna/pass0.py) and the reference model side by side, packet for packet.

tests/tna/pass0.py executes the Tofino program's text (its pass 0, and pass 1's slot-state
tables); here seeded random interleavings drive it and host/wire/model.py side by side:
1-5 workers, pools of 1, 2, 4 and 8 to 256 (every tenth interleaving wide: 17-31 workers,
or a pool of all 512 slots), honest workers with a window of the pool (one of them
often a straggler, results lost at random), FLUSHes that close chunks short (so that new
uses are held), duplicates, wrong offsets and ops, seqs far ahead and stale, restarted
workers under the same run, run changes within the jump bound, stale and far runs, idle
jumps, re-installs and malformed packets, random lanes. Each packet's drop reason and
replies (type, header fields, payload, destination) must agree, and so must the counters:
a packet's adding passes run in tests/tna/passes.py, the words' registers with them.
``THC_TNA_SEED`` picks another seed.

Known differences between thc_tna.p4 and the model (docs/switch.md, "Tofino"), excluded:
 1. a REFUSED stale_run's bitmap (detail, the job's run) is 0 on the TNA: zeroed on both
    sides before comparing (the REFUSEDs pass 1 sends name what the model names, read by
    their pass 1, which runs here right after pass 0: on a switch one recirculation later,
    when a packet between may have changed the register they read);
 2. the TNA's idle clock counts 65.5 us ticks: gaps within 0.5 s of run_idle_s are stepped
    over (every packet that passes the run check refreshes it, as in the model: the clocks
    are otherwise compared, through the packets that find the job idle or not);
 3. acknowledgements of a use of an older run: an idle job is never given back a run id
    that held it since the install (a packet of such a run gets a fresh id instead);
 4. a packet refused as reused_run acknowledges on the TNA (thc_ack<V>_op runs beside the
    incarnation's check): its changes to thc_acked0/1 are undone after it;
 5. a use exactly 2^31 - pool seqs ahead of a packet in the other version is acknowledged by
    the model (RFC 1982 reads it as behind), not by the TNA ("older than seq"): no packet is
    sent that far from the window;
 6. a worker's record of an earlier install matching a new run through run xor epoch (a
    chance of 2^-16 an install and run): the TNA refuses the run as reused_run, the model
    starts each install with no records. A case's run ids have bits 12..15 clear, and each
    install's nonce differs from the case's earlier ones in one of those bits
    (:data:`RUN_BITS`; so a case installs 16 times at most), so no two of its runs xor as
    two of its epochs;
 7. a packet that would take an idle job within THC_TNA_EDGE ticks (17 ms) of a packet that
    read it live is dropped unanswered on the TNA (stale_run; its resend takes the job), so
    that the live packet's passes refresh the job first; the model takes it at once. Like
    difference 2, the gaps at the idle threshold that would reach it are stepped over
    (tests/test_tna_window.py drives the edge).
A packet's adding passes run right after its pass 0, so the one-recirculation windows
docs/switch.md describes are not exercised by the comparison; with ``--delay`` they run
later, an oracle checks the sums alone (tests/tna/oracle.py), and no use may open a second
time while the pass of the packet that opened it goes round.
Also not generated: offsets of 2^31 or more (the TNA takes 31-bit offsets, bit 31 tells a
MAX use, and refuses larger ones as malformed), shards, truncated headers, vote jobs (their
payload sizes: :func:`payload_scenarios`; their lanes: tests/test_tna_vote.py).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
from collections import Counter

from tests.tna.interp import Program
from tests.tna.oracle import wrong_sum
from tests.tna.p4text import preprocess
from tests.tna.pass0 import TnaEngine
from thc.wire import protocol as P
from thc.wire.jobs import Job
from thc.wire.model import Model

SEED = int(os.environ.get("THC_TNA_SEED", "1729"))
CASES, STEPS = 20, 300
ACKED = ("thc_acked0", "thc_acked1")
"""The acknowledgement registers (known difference 4)."""
JOB_ID, FIRST_RUN, M = 9, 1000, P.SEQ_MOD
RUN_BITS = 12
"""A case's run ids have bits RUN_BITS..15 clear (difference 6): they start at FIRST_RUN and
grow by a few, or jump by RUN_JUMP (2^24)."""
T = {t.name: int(t) for t in P.PktType}
TABLE = (0, 1, 2, 4, 6, 8, 11, 14, 16, 19, 22, 24, 26, 28, 29, 30)
STRANGER = ("10.0.0.200", 42999)


class Difference(AssertionError):
    pass


def addr(w: int) -> tuple[str, int]:
    return (f"10.0.0.{w + 1}", 42000 + w)


def make_job(n: int, pool: int, pool_base: int = 0, sum_bits: int = 0) -> Job:
    return Job.from_dict({
        "job_id": JOB_ID, "pool_size": pool, "pool_base": pool_base, "lanes": P.LANES,
        "table": TABLE, "granularity": 30, "sum_bits": sum_bits,
        "workers": [{"id": w, "ip": addr(w)[0], "port": addr(w)[1], "switch_port": 260 + w}
                    for w in range(n)]})


def lanes_of(kind: str, w: int, run: int, seq: int) -> bytes:
    """A packet's lanes: random, the same in every retransmission of it."""
    n = P.payload_bytes(T[kind]) if kind in ("DATA", "MAX") else 0
    return random.Random(f"{kind} {w} {run} {seq}").randbytes(n)


def kind_of(run: int, seq: int) -> str:
    """Every worker agrees which chunks are MAX rounds."""
    return "MAX" if (seq * 2654435761 + run) % 7 == 0 else "DATA"


def offset_of(seq: int) -> int:
    return seq * P.LANES % (1 << 31)


def nonce_of(w: int, run: int, restarts: int = 0) -> int:
    return ((run * 131 + w) * 2654435761 + restarts * 40503) % M or 1


def describe(d: bytes, src) -> str:
    h = P.Header.unpack(d)
    return (f"{P.PktType(h.pkt_type).name if h.pkt_type in T.values() else h.pkt_type} "
            f"w{h.worker_id} job {h.job_id} run {h.run} seq {h.seq} slot {h.slot}/{h.version} "
            f"offset {h.offset} nonce {h.epoch} +{len(d) - P.HEADER_BYTES}B from {src}")


def normalize(outcome) -> tuple:
    """(reason, [(header fields, (length, the payload's digest), destination)]); a REFUSED's
    detail zeroed (difference 1: stale_run's)."""
    replies, reason = outcome
    out = []
    for reply, dst in replies:
        h = P.Header.unpack(reply[:P.HEADER_BYTES])
        fields = (P.PktType(h.pkt_type).name, h.worker_id, h.job_id, h.slot, h.version,
                  h.count, h.seq, h.offset, 0 if (h.pkt_type == T["REFUSED"] and
                                                  h.count == P.DropReason.stale_run) else h.bitmap,
                  h.run, h.epoch)
        body = hashlib.sha256(reply[P.HEADER_BYTES:]).hexdigest()[:12]
        out.append((fields, (len(reply), body), tuple(dst)))
    return reason, out


class Interleaving:
    """One random job and packet sequence on a fresh model and a fresh TNA engine."""

    def __init__(self, prog: Program, rng: random.Random, stats: Counter, delay: int = 0,
                 wide: str | None = None, lose: float = 0.0):
        self.rng, self.stats, self.delay = rng, stats, delay
        self.answered: set[tuple[int, int]] = set()
        """(run, seq) of the chunks a RESULT answered (late passes)."""
        self.n, self.pool = rng.randint(1, 5), rng.choice((1, 2, 4, 1 << rng.randint(3, 8)))
        if wide == "workers":   # worker ids past 4 bits in the per-worker registers' index
            self.n = rng.randint(17, P.MAX_WORKERS - 1)
        self.base, self.loss = rng.choice((0, M - 3)), rng.choice((0.0, 0.2, 0.5))
        self.weights = [1.0] * self.n
        if self.n > 1 and rng.random() < 0.7:
            self.weights[rng.randrange(self.n)] = 0.15   # a straggler
        pool_base = rng.choice((0, 8, 64))
        if wide == "slots":     # slot indices past 8 bits, two of them 256 apart
            self.pool, pool_base = P.SWITCH_SLOTS, 0
        sum_bits = rng.choice((0, 16))             # 0: the narrowest, 8 bits here
        self.config = (f"{self.n} workers, pool {self.pool} at {pool_base}, base {self.base}, "
                       f"loss {self.loss}, weights {self.weights}, sum_bits {sum_bits}")
        self.job_index = rng.randrange(P.MAX_JOBS)   # registers and lookups per job index
        self.config += f", job index {self.job_index}"
        self.job = make_job(self.n, self.pool, pool_base, sum_bits)
        self.model = Model()
        self.tna = TnaEngine(prog, delay, lose, seed=rng.randrange(1 << 30))
        self.now, self.top, self.history, self.nonces = 1000.0, FIRST_RUN - 1, [], []
        self.install()

    def install(self) -> None:
        while True:   # difference 6
            nonce = self.rng.randrange(1, P.NONCE_MASK + 1)
            if all((nonce ^ old) >> RUN_BITS for old in self.nonces):
                break
        self.nonces.append(nonce)
        epoch = self.job.new_epoch(nonce=nonce)
        self.model.install(self.job, epoch)
        self.tna.install(self.job, epoch, self.job_index, now=self.now)
        self.seen, self.owned = float("-inf"), set()
        self.new_run(self.top + 1)

    def new_run(self, run: int) -> None:
        assert not run >> RUN_BITS & 0xF, "a run id with bits 12..15 set (difference 6)"
        self.run, self.top = run, max(self.top, run)
        self.front = [self.base] * self.n
        self.done = [set() for _ in range(self.n)]
        self.restarts = [0] * self.n

    def step(self) -> None:
        rng, n, pool = self.rng, self.n, self.pool
        w = rng.choices(range(n), self.weights)[0]
        seq = (self.front[w] + rng.randrange(pool)) % M
        kind = kind_of(self.run, seq)
        r = rng.random()
        if r < 0.55:
            self.send(kind, w, seq)
        elif r < 0.66:
            head = self.front[w]   # the window's head times out: closed short
            self.send("FLUSH" if kind_of(self.run, head) == "DATA" else "MAX", w, head)
        elif r < 0.82:
            self.perturbed(w, seq, kind)
        elif r < 0.87:
            self.junk(w, seq)
        elif r < 0.945:
            self.now += rng.choice((0.001, 0.05, 0.5, 3.0))
        elif r < 0.955:
            self.now += rng.uniform(20.0, 59.0)   # whether the packets between refreshed
        elif r < 0.97:
            self.now += rng.uniform(61.0, 200.0)
        elif r < 0.99:
            self.new_run(self.top + rng.randint(1, 2))
        else:
            if not self.delay:
                self.check_counters()
            if len(self.nonces) < 16:   # difference 6: one install a value of bits 12..15
                self.install()

    def perturbed(self, w: int, seq: int, kind: str) -> None:
        rng, pool, run = self.rng, self.pool, self.run
        what = rng.randrange(12)
        if what == 0:
            wrong = P.LANES if seq % 2 else 1 << 24   # the next chunk's, or past 24 bits
            self.send(kind, w, seq, offset=(offset_of(seq) + wrong) % (1 << 31))
        elif what == 1:
            self.send(rng.choice(["FLUSH", "MAX"] if kind == "DATA" else ["DATA", "FLUSH"]), w, seq)
        elif what == 2:
            ahead = rng.choice((2 * pool, 3 * pool, 1000, 1 << 30))   # not 2^31 - pool (6.)
            self.send(kind, w, (seq + ahead) % M)
        elif what == 3:
            self.send(kind, w, (self.front[w] - rng.randint(1, 4 * pool)) % M)
        elif what == 4:
            s, v = P.slot_of(seq, pool)
            self.send(kind, w, seq, **({"slot": (s + 1) % pool} if pool > 1 and rng.random() < 0.5
                                       else {"version": 1 - v}))
        elif what == 5 and rng.random() < 0.2:
            self.restarts[w] += 1   # restarted under the same run: reused_run from now on
            self.send(kind, w, seq)
        elif what in (5, 6):
            self.send(kind, w, seq, nonce=nonce_of(w, run, self.restarts[w] + 1))
        elif what == 7:
            self.send(kind, w, seq, run=max(1, run - rng.randint(1, 3)))
        elif what == 8:
            self.send(kind, w, seq, run=run + P.RUN_JUMP + rng.randint(0, 2))
        elif what == 9:
            self.send(kind, w, seq, src=STRANGER if rng.random() < 0.5 else addr((w + 1) % self.n))
        elif what == 10:   # a worker configured otherwise (wrong_config); high bits unread
            tag = self.job.config_tag
            self.send(kind, w, seq, tag=tag ^ 1 << rng.randrange(16) if rng.random() < 0.7
                      else tag | rng.randrange(1, 1 << 16) << 16)
        else:
            self.send(kind, w, seq, run=run + rng.randint(1, 2))

    def junk(self, w: int, seq: int) -> None:
        """Packets that the checks before the slot state drop."""
        what = self.rng.randrange(10)
        kinds = [("DATA", {"version": 2}), ("DATA", {"run": 0}), ("RESULT", {}),
                 ("RESULT", {"run": 0}),
                 ("PENDING", {}), ("RESET", {}), ("DATA", {"body": b""}),
                 ("DATA", {"body": bytes(32)}), ("FLUSH", {"body": bytes(128)}),
                 ("DATA", {"job_id": JOB_ID + 1})]
        kind, kw = kinds[what]
        if self.rng.random() < 0.3:
            kw = {"w_id": self.n} if self.rng.random() < 0.5 else {"slot": self.pool}
            kind = "DATA"
        self.send(kind, w, seq, **kw)

    def send(self, kind: str, w: int, seq: int, run: int | None = None, src=None, slot=None,
             version=None, offset=None, nonce=None, body=None, job_id=JOB_ID, w_id=None,
             tag=None) -> None:
        if abs(self.now - self.seen - P.RUN_IDLE_S) < 0.5:
            self.now += 1.0   # no gap at the idle threshold (difference 2)
        st = self.model.jobs[JOB_ID]
        run = self.run if run is None else run
        idle = st.thc_job_run == 0 or self.now - self.seen >= P.RUN_IDLE_S
        if idle and run != st.thc_job_run and run in self.owned:
            run = self.top + 1   # an idle job never goes back to a run it had (difference 3)
        self.top = max(self.top, run)
        s, v = P.slot_of(seq, self.pool)
        if body is None:
            body = lanes_of(kind, w, run, seq)
        d = P.Header(T[kind], w if w_id is None else w_id, job_id, s if slot is None else slot,
                     v if version is None else version, 0, seq,
                     offset_of(seq) if offset is None else offset,
                     self.job.config_tag if tag is None else tag, run,
                     nonce_of(w, run, self.restarts[w]) if nonce is None else nonce).pack() + body
        self.compare(d, src or addr(w))

    def compare(self, d: bytes, src) -> None:
        st = self.model.jobs[JOB_ID]
        idle, before = self.now - self.seen >= P.RUN_IDLE_S, st.thc_job_run
        want = self.model.handle(d, src, self.now)
        acked = {r: dict(self.tna.regs.get(r, {})) for r in ACKED}
        try:
            got = self.tna.handle(d, src, self.now)
        except AssertionError as e:   # the TNA's own reply contradicts itself
            raise Difference(f"packet {len(self.history) + 1}: {describe(d, src)} at "
                             f"{self.now:.3f}\n  TNA: {e}") from None
        if got[1] == "reused_run":
            self.tna.regs.update(acked)   # difference 4: its acknowledgements undone
        if st.run_seen == self.now:
            self.seen = self.now
        w, g = normalize(want), normalize(got)
        label = self.label(w)
        if (d[0] == T["FLUSH"] and len(w[1]) == 1 and w[1][0][0][0] == "RESULT"
                and w[1][0][0][5] == self.n):
            label = "FLUSH at a complete use"
        self.history.append(f"{describe(d, src)} at {self.now:.3f}: {label}")
        if self.delay:   # the TNA's replies may differ from the model's; its sums must be right
            for reply, _ in got[0]:
                if reply[0] in (T["RESULT"], T["MAX_RESULT"]):
                    self.stats[f"late passes: {P.PktType(reply[0]).name} sums checked"] += 1
                    hdr = P.Header.unpack(reply)
                    self.stats["late passes: chunks with a result"] += (
                        (hdr.run, hdr.seq) not in self.answered)
                    self.answered.add((hdr.run, hdr.seq))
            wrong = wrong_sum(self.job, got[0], lanes_of)
            if self.tna.reopened:   # its late passes would count in the second opening
                wrong = (f"use (run, seq) {sorted(self.tna.reopened)[0]} opened a second time "
                         f"while its opener's pass went round")
            if wrong:
                last = "\n    ".join(self.history[-12:])
                raise Difference(f"packet {len(self.history)}: {wrong}\n  last packets:\n"
                                 f"    {last}")
        else:
            if w != g:
                last = "\n    ".join(self.history[-12:])
                raise Difference(f"packet {len(self.history)}: {describe(d, src)} at "
                                 f"{self.now:.3f}\n  model: {w}\n  TNA:   {g}\n  last "
                                 f"packets:\n    {last}")
            self.stats[label] += 1
            if before and st.thc_job_run != before:
                self.stats["run taken: " + ("idle job" if idle else "newer, in the jump")] += 1
        # the workers follow the model: a run that took the job, their windows (with late
        # passes, the results the TNA sent: a worker moves on only with a result in hand)
        if st.thc_job_run:
            self.owned.add(st.thc_job_run)
            if st.thc_job_run != self.run:
                self.new_run(st.thc_job_run)   # a run took the job: its workers go on
        for (fields, _size, _dst) in (g if self.delay else w)[1]:
            if fields[0] in ("RESULT", "MAX_RESULT") and fields[9] == self.run \
                    and self.rng.random() >= self.loss:
                v = fields[1]
                self.done[v].add(fields[6])
                while self.front[v] in self.done[v]:
                    self.front[v] = (self.front[v] + 1) % M

    def label(self, outcome) -> str:
        reason, replies = outcome
        if not replies:
            return f"dropped: {reason}" if reason else "consumed"
        fields = replies[0][0]
        if fields[0] == "REFUSED":
            return f"REFUSED {reason}"
        if fields[0] == "PENDING":
            return "PENDING held (count 0)" if fields[5] == 0 else "PENDING"
        to = "to every worker" if len(replies) == self.n else "to the sender"
        short = " closed short" if fields[5] < self.n else ""
        return f"{fields[0]}{short} {to}"

    def check_counters(self) -> None:
        want = {k: v for k, v in self.model.drops.items() if v}
        if want != dict(self.tna.drops()):
            raise Difference(f"drop counters: model {want}, TNA {dict(self.tna.drops())}")
        jobs = dict(self.model.jobs[JOB_ID].counters)
        tna = self.tna.job_counters(self.job_index)
        got = {"packets": sum(tna.values()), "completions": tna["completions"],
               "retransmissions": tna["retransmissions"], "pending": tna["pending"],
               "held": tna["held"]}
        if jobs != got:
            raise Difference(f"job counters: model {jobs}, TNA {got} (cells {tna})")


def wide_case(case: int) -> str | None:
    """Every tenth interleaving is wide: 17 or more workers, or a pool of all 512 slots,
    in turn (the others' workers, pools and pool bases fit in 5, 256 and 64)."""
    if case % 10 != 9:
        return None
    return ("workers", "slots")[case // 10 % 2]


def fuzz(prog: Program, seed: int, cases: int = CASES, steps: int = STEPS, first: int = 0,
         stats: Counter | None = None, delay: int = 0, lose: float = 0.0):
    """(outcome counts, the first difference or None) over interleavings ``first`` to
    ``first + cases - 1`` of ``seed``. ``delay``: the TNA's passes after pass 0 run after
    that many later packets' pass 0, and only its sums are checked (oracle.py); ``lose``:
    the chance that one of a packet's passes after pass 0 is lost, the passes after it with
    it (with ``delay``)."""
    stats = Counter() if stats is None else stats
    for case in range(first, first + cases):
        il = Interleaving(prog, random.Random(seed * 1_000_003 + case), stats, delay,
                          wide_case(case), lose)
        try:
            for _ in range(steps):
                il.step()
            if not delay:
                il.check_counters()
        except Difference as e:
            return stats, f"seed {seed} case {case} ({il.config}): {e}"
        finally:
            tna = il.tna
            stats["late passes: passes lost"] += tna.lost
            lost = sum(n for use, n in tna.withheld_uses.items() if use in tna.lost_uses)
            stats["late passes: RESULT copies withheld, a pass of their use lost"] += lost
            stats["late passes: RESULT copies withheld, a late pass of a use moved on"] += (
                tna.withheld() - lost)
    return stats, None


FAR = FIRST_RUN + P.RUN_JUMP + 5
"""A run id beyond the jump bound: it takes the job only if the job is idle."""
IDLE = {
    # (seconds after the install, worker, type, seq, run, restarts); the last packet's reason
    "a stale_run refusal does not refresh the idle clock": (
        [(0, 0, "DATA", 0, FIRST_RUN, 0), (40, 0, "DATA", 0, FIRST_RUN - 1, 0),
         (70, 1, "DATA", 0, FAR, 0)], None),
    "a PENDING refreshes it": (
        [(0, 0, "DATA", 0, FIRST_RUN, 0), (40, 0, "DATA", 0, FIRST_RUN, 0),
         (70, 1, "DATA", 0, FAR, 0)], "stale_run"),
    "a held PENDING refreshes it": (
        [(0, 0, "DATA", 0, FIRST_RUN, 0), (0, 1, "DATA", 0, FIRST_RUN, 0),
         (0, 0, "DATA", 1, FIRST_RUN, 0), (40, 0, "DATA", 2, FIRST_RUN, 0),
         (70, 1, "DATA", 0, FAR, 0)], "stale_run"),
    "a wrong_use refusal refreshes it": (
        [(0, 0, "DATA", 0, FIRST_RUN, 0), (40, 0, "MAX", 0, FIRST_RUN, 0),
         (70, 1, "DATA", 0, FAR, 0)], "stale_run"),
    "a reused_run refusal refreshes it": (
        [(0, 0, "DATA", 0, FIRST_RUN, 0), (40, 0, "DATA", 0, FIRST_RUN, 1),
         (70, 1, "DATA", 0, FAR, 0)], "stale_run"),
    "a fresh job takes any run id, however far": (
        [(0, 0, "DATA", 0, FAR + P.RUN_JUMP, 0)], None),
    # a packet refused before the run check neither takes an idle or fresh job nor marks it
    # taken (thc_job_seen_op leaves it to thc_check's refusal)
    "a wrong_slot refusal does not take an idle job": (
        [(0, 0, "DATA", 0, FIRST_RUN, 0), (70, 0, "DATA", 0, FIRST_RUN, 0, {"version": 1}),
         (70, 1, "DATA", 0, FAR, 0)], None),
    "a slot outside the pool does not take an idle job": (
        [(0, 0, "DATA", 0, FIRST_RUN, 0), (70, 0, "DATA", 0, FIRST_RUN, 0, {"slot": 1}),
         (70, 1, "DATA", 0, FAR, 0)], None),
    "a wrong_config refusal does not take an idle job": (
        [(0, 0, "DATA", 0, FIRST_RUN, 0), (70, 0, "DATA", 0, FIRST_RUN, 0, {"tag_xor": 0x8000}),
         (70, 1, "DATA", 0, FAR, 0)], None),
    "a DATA without lanes does not take an idle job": (
        [(0, 0, "DATA", 0, FIRST_RUN, 0), (70, 0, "DATA", 0, FIRST_RUN, 0, {"body": b""}),
         (70, 1, "DATA", 0, FAR, 0)], None),
    "a wrong_slot refusal does not take a fresh job": (
        [(0, 0, "DATA", 0, FIRST_RUN, 0, {"version": 1}), (0, 1, "DATA", 0, FAR, 0)], None),
}
"""The idle clock's rules, packet by packet: whether a packet 40 s after the job's first
one refreshed its clock decides whether a far run id 30 s later takes the job. A step is
(seconds after the install, worker, type, seq, run, restarts[, header fields or body that
differ])."""


def idle_scenarios(prog: Program) -> str | None:
    """The first packet of IDLE that the program answers unlike the model, or None."""
    # also 1 s after the switch's clock started, when idle_since is before the clock's start
    for start in (1000.0, 1.0):
        for name, (steps, last) in IDLE.items():
            job, model, tna = make_job(2, 1), Model(), TnaEngine(prog)
            model.install(job, job.new_epoch(nonce=77))
            tna.install(job, job.new_epoch(nonce=77), now=start)
            for t, w, kind, seq, run, restarts, *odd in steps:
                odd = odd[0] if odd else {}
                body = odd.get("body", bytes(P.payload_bytes(T[kind])) if kind in ("DATA", "MAX")
                               else b"")
                d = P.Header(T[kind], w, JOB_ID, odd.get("slot", 0), odd.get("version", seq & 1),
                             0, seq, offset_of(seq), job.config_tag ^ odd.get("tag_xor", 0), run,
                             nonce_of(w, run, restarts)).pack() + body
                at = f"{name} (clock from {start:g} s): {describe(d, addr(w))} at +{t} s"
                want = normalize(model.handle(d, addr(w), start + t))
                try:
                    got = normalize(tna.handle(d, addr(w), start + t))
                except AssertionError as e:   # the TNA's own reply contradicts itself
                    return f"{at}\n  TNA: {e}"
                if want != got:
                    return f"{at}\n  model: {want}\n  TNA: {got}"
            assert want[0] == last, f"{name}: the model's last answer is {want[0]}, not {last}"
    return None


def payload_scenarios(prog: Program) -> str | None:
    """The first packet that the program answers unlike the model, or None, of DATA, MAX and
    FLUSH packets carrying every payload size a packet type has (none, a vote job's signs,
    a THC job's indices, MAX lanes; random bytes, so that a vote job's spread of a MAX's or
    a FLUSH's body would show) to a THC job of 8- and of 16-bit sums and to a vote
    job, of one worker and of two: the interleavings send a vote job's payload only to THC
    jobs."""
    sizes = sorted({0, P.payload_bytes(T["MAX"])} | {
        P.payload_bytes(T["DATA"], aggregation=a) for a in P.AGGREGATIONS})
    jobs = [(make_job(n, 4), make_job(n, 4, sum_bits=16),
             Job.vote(JOB_ID, make_job(n, 4).workers, pool_size=4).validate()) for n in (1, 2)]
    for job in (job for three in jobs for job in three):   # one worker: its sums come back
        model, tna, seq = Model(), TnaEngine(prog), 0
        model.install(job, job.new_epoch(nonce=5))
        tna.install(job, job.new_epoch(nonce=5), now=1000.0)
        for kind in ("DATA", "MAX", "FLUSH"):
            for size in sizes:
                s, v = P.slot_of(seq, job.pool_size)
                d = P.Header(T[kind], 0, JOB_ID, s, v, 0, seq, offset_of(seq), job.config_tag,
                             FIRST_RUN, nonce_of(0, FIRST_RUN)).pack() + random.Random(
                                 seq).randbytes(size)
                at = f"{job.aggregation} job of {job.sum_bits}-bit sums: {describe(d, addr(0))}"
                want = normalize(model.handle(d, addr(0), 1000.0))
                try:
                    got = normalize(tna.handle(d, addr(0), 1000.0))
                except AssertionError as e:   # the TNA's own reply contradicts itself
                    return f"{at}\n  TNA: {e}"
                if want != got:
                    return f"{at}\n  model: {want}\n  TNA: {got}"
                seq += 1
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.tna.interleave`` (``make fuzz``): a long run, its outcome counts and
    the first difference."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--cases", type=int, default=CASES)
    ap.add_argument("--steps", type=int, default=STEPS, help="packets of each interleaving")
    ap.add_argument("--delay", type=int, default=0,
                    help="run a packet's passes after pass 0 this many packets later, and "
                         "check only the sums")
    ap.add_argument("--lose", type=float, default=0.0,
                    help="with --delay: the chance that one of a packet's passes after pass 0 "
                         "is lost on the recirculation port")
    args = ap.parse_args(argv)
    if args.lose and not args.delay:
        ap.error("--lose needs --delay: the model loses no pass, so only the sums are checked")
    prog, stats = Program(preprocess()), Counter()
    difference = None if args.delay else idle_scenarios(prog) or payload_scenarios(prog)
    for first in range(0, args.cases, 100):
        if difference:
            break
        _, difference = fuzz(prog, args.seed, min(100, args.cases - first), args.steps, first,
                             stats, args.delay, args.lose)
        print(f"seed {args.seed}: {min(first + 100, args.cases)} of {args.cases} interleavings",
              flush=True)
    for label, n in sorted(stats.items()):
        print(f"{n:9d}  {label}")
    print(f"seed {args.seed}, {args.steps} packets an interleaving: "
          + (f"first difference:\n{difference}" if difference else "no difference"))
    return 1 if difference else 0


if __name__ == "__main__":
    sys.exit(main())
