"""An executable reading of p4src/thc_tna.p4's pass 0: the slot state that decides what the
Tofino program does with a THC packet, run on the program's own text.

Nothing executes thc_tna.p4 here (no Tofino, no model), so this module reads it through cpp
(for its #includes and macros) and interprets what decides a packet's fate: constants and
field widths (arithmetic wraps at the declared width), the ingress parser's states, and
``control ThcIngress``'s RegisterActions, actions, tables and ``apply`` block, statement by
statement. In the adding passes it runs only the tables that touch the slot state (PASS1);
their lanes (parser states, egress doubling, lookups with the controller's entries, the
words' registers and thc_word_op's entries, deparse order) run in tests/tna/passes.py,
and the vote spread is a no-op here (SKIP). A construct this reading does not know raises
Unsupported, naming it, so that a change of the program fails loudly instead of being
read wrong. ``TnaEngine.handle(datagram, src, now)`` answers like
``thc.wire.model.Model.handle``: (replies, drop reason), a reply being the UDP payload of
the frame egress made (the egress parser, ``control ThcEgress`` and its deparser, run on the
bytes the ingress deparser emitted) and the destination its headers name.
"""
from __future__ import annotations

import ipaddress
import random
from collections import Counter, deque

import numpy as np

from tests.tna.interp import Machine, Program
from tests.tna.passes import passes
from tests.tna.words import Words
from tests.tna.p4text import mask, preprocess
from thc.controller import job_entries
from thc.controller import program as names
from thc.controller.frames import frame_faults, reset_frame, udp_frame
from thc.controller.targets.tofino import PIPE_SHIFT
from thc.wire import protocol as P

UDP_HEADER_BYTES = 8
IPV4_HEADER_BYTES = 20
FRAME_HEADERS = 14 + IPV4_HEADER_BYTES + UDP_HEADER_BYTES + P.HEADER_BYTES
"""Ethernet, IPv4, UDP and THC headers: where a frame's lanes start."""

AGG_MAC, AGG_IP = "02:00:00:00:00:fe", "10.0.0.254"


class _Recorder:
    """Stands in for controller/switch.py: returns the entries controller/jobs.py builds, and
    the program's key names where it asks for them."""

    def __init__(self, program: Program):
        self.p = program

    def key_names(self, table: str) -> list[str]:
        return (self.p if table in self.p.tables else self.p.egress).tables[table]["key_names"]

    @staticmethod
    def table_entry(table, match, action, params):
        return table, match, action, params


def _key(value) -> int:
    """An entry's value: an IPv4 address, a MAC or a number."""
    if isinstance(value, str) and ":" in value:
        return int(value.replace(":", ""), 16)
    return int(ipaddress.IPv4Address(value)) if isinstance(value, str) else int(value)


class TnaEngine:
    """Pass 0 of thc_tna.p4 (and pass 1's slot-state tables, right after it) on datagrams:
    ``handle(datagram, src, now) -> (replies, drop reason)``, as the model answers."""

    STRANGER_PORT = 300
    """The ingress port of a datagram from no worker's address (in the CPU port's pipe)."""

    def __init__(self, program: Program | None = None, delay: int = 0, lose: float = 0.0,
                 seed: int = 0):
        self.p = program or Program(preprocess())
        self.delay = delay
        """Packets whose pass 0 runs before a packet's passes after pass 0 (0: at once)."""
        self.lose, self.loss_rng = lose, random.Random(seed)
        """The chance that one of a packet's passes after pass 0 is lost on the recirculation
        port (with ``delay``): the passes before it come round, the rest never do."""
        self.lost = 0
        """Passes lost (one a packet at most)."""
        self.lost_uses: set[tuple[int, int]] = set()
        """(run, seq) of the uses a packet of which lost a pass."""
        self.reopened: set[tuple[int, int]] = set()
        """(run, seq) of the uses opened again while the pass of the packet that opened them
        went round (an idle job taken by another run and back within one recirculation,
        where pass 1 alone marked an idle job taken: tests/test_tna_window.py)."""
        self.going_round: deque = deque()
        """((slot version, run, seq), the passes after pass 0) of each packet going round."""
        self.clock, self.pending = None, []
        self.withheld_uses: Counter = Counter()
        """RESULT copies egress withheld, by (run, seq)."""
        self.regs, self.counters, self.installed = {}, Counter(), {}
        self.macs: dict[tuple[str, int], int] = {}
        self.ports: dict[tuple[str, int], int] = {}
        self.mcast: dict[int, list[int]] = {}
        self.jobs: dict[int, object] = {}
        self.words = Words({k: v[0] for k, v in self.p.consts.items()}, self.p.raw)
        self.rng = np.random.default_rng(0)   # what a pass's containers held before

    def install(self, job, epoch: int, job_index: int = 0, now: float = 0.0) -> None:
        """controller/jobs.py's _write_job: the job's worker entries out, its multicast group,
        thc_job entry and thc_install entry (the install's ``epoch``) in, a RESET packet-out
        of that install per slot version from the CPU port (each counted in thc_resets, which
        reset_pool waits for), its counters cleared, then the worker entries."""
        rec, cpu_port = _Recorder(self.p), self.p.consts["THC_TNA_CPU_PORT"][0]
        self.pending += self.settle()   # milliseconds of writes: every pass is back
        self._delete_job_entries(names.WORKER_TABLE, job.job_id)
        self.mcast[job.mcast_grp] = [w.id + 1 for w in job.workers]
        self.jobs[job_index] = job
        self.macs.update({(w.ip, w.port): _key(w.mac) for w in job.workers})
        self.ports.update({(w.ip, w.port): w.switch_port for w in job.workers})
        self._write(job_entries.job_entry(rec, job, job_index, epoch))
        self._delete_job_entries(names.INSTALL_TABLE, job.job_id)
        self._write(job_entries.install_entry(rec, job.job_id, epoch))
        for slot in range(job.pool_size):
            for version in (0, 1):
                before = self.counters[names.RESETS, job_index]
                out = self._frame(reset_frame(job.job_id, slot, AGG_MAC, AGG_IP, version,
                                              epoch), cpu_port, now)
                if out != ([], None) or self.counters[names.RESETS, job_index] != before + 1:
                    raise AssertionError(f"RESET of slot {slot} version {version}: {out}")
        for k in range(len(P.JOB_COUNTERS)):
            self.counters.pop((names.JOB_COUNTERS, job_index * len(P.JOB_COUNTERS) + k), None)
        for entry in job_entries.worker_entries(rec, job) + job_entries.addr_entries(
                rec, job, job_entries.AggAddress(AGG_IP, AGG_MAC)):
            self._write(entry)

    def _delete_job_entries(self, table: str, job_id: int) -> None:
        key = self.p.tables[table]["key_names"].index("job_id")
        self.installed[table] = [e for e in self.installed.get(table, [])
                                 if e[0][key][0] != job_id]

    def _write(self, entry) -> None:
        table, match, action, params = entry
        prog = self.p if table in self.p.tables else self.p.egress
        cells = [(_key(match[k]), -1) for k in prog.tables[table]["key_names"]]
        args = [(_key(params[name]), None, False) for name, _ in prog.actions[action][0]]
        rows = [e for e in self.installed.get(table, []) if e[0] != cells]
        self.installed[table] = rows + [(cells, action, args)]

    def handle(self, datagram: bytes, src: tuple[str, int], now: float):
        return self.handle_frame(self.frame_of(datagram, src), src, now)

    @staticmethod
    def frame_of(datagram: bytes, src: tuple[str, int]) -> bytes:
        """The frame a worker at ``src`` sends the switch ``datagram`` in."""
        return udp_frame("02:00:00:00:00:01", AGG_MAC, src[0], AGG_IP, src[1], P.UDP_PORT,
                         datagram)

    def handle_frame(self, frame: bytes, src: tuple[str, int], now: float,
                     port: int | None = None):
        """As :meth:`handle`, for a whole frame on the port of ``src`` (or ``port``)."""
        port = self.ports.get(tuple(src), self.STRANGER_PORT) if port is None else port
        if not self.delay:
            return self._frame(frame, port, now)
        # a pass takes microseconds: when time moves on, every pass going round is back
        replies = self.settle() if now != self.clock else []
        replies, self.pending, self.clock = self.pending + replies, [], now
        sent, reason, later = self._pass0(frame, port, now)
        if later is not None:
            f = later.f
            use = (f.get("meta.reg_index", 0), f.get("hdr.thc.run", 0), f.get("hdr.thc.seq", 0))
            if f.get("meta.bridge.new_use", 0) and any(
                    k == use and g.f.get("meta.bridge.new_use", 0) for k, g in self.going_round):
                self.reopened.add(use[1:])
            self.going_round.append((use, later))
        replies += sent
        while len(self.going_round) > self.delay:
            replies += self.come_round()
        return replies, reason

    def settle(self) -> list:
        """Every pass going round comes round (or is lost): their replies."""
        replies = []
        while self.going_round:
            replies += self.come_round()
        return replies

    def come_round(self) -> list:
        """The pass going round longest comes round (or is lost): its replies."""
        use, later = self.going_round.popleft()
        lost = self.loss_rng.random() < self.lose
        if lost:
            self.lost_uses.add(use[1:])
        return later(lost)

    def _frame(self, frame: bytes, port: int, now: float):
        replies, reason, later = self._pass0(frame, port, now)
        return (replies if later is None else later()), reason

    def _pass0(self, frame: bytes, port: int, now: float):
        """(replies, drop reason, the passes after pass 0 or None): pass 0 at once; what
        it sends round runs when the returned function is called (its replies)."""
        tstamp = int(now * 1e9) & mask(48)
        f = self._pass(frame, port, tstamp)
        code = f.get("meta.drop_reason", 0)
        reason = P.DropReason(code).name if code else None
        if f.get("ig_dprsr_md.drop_ctl", 0) & 1:   # TNA drops on bit 0 alone
            return [], reason, None
        if "meta.bridge" not in f["valid"]:
            raise AssertionError("pass 0 left its bridge header invalid: egress and the next "
                                 "pass would read the packet's first bytes as it")
        if f.get("meta.bridge.recirc", 0):
            self._to_recirculation(f, port)
            if f.get("meta.bridge.hdr_only", 0):
                self._header_only(f)
            def later(lost: bool = False) -> list:
                return self._round(f, frame, tstamp, port, lost)
            later.f = f
            return [], reason, later
        if f.get("meta.bridge.is_reply", 0):
            if (f.get("ig_tm_md.ucast_egress_port", 0), f.get("ig_tm_md.mcast_grp_a", 0)) \
                    != (port, 0):
                raise AssertionError("pass 0 answers to another port than the sender's")
            return self._replies(f, [0], b""), reason, None
        raise AssertionError("pass 0 neither dropped the packet (drop_ctl's bit 0), answered "
                             "it nor sent it round")

    def _to_recirculation(self, f: dict, port: int) -> None:
        """A pass going round leaves by its pipe's recirculation port, in queue 0."""
        want = port & ~mask(PIPE_SHIFT) | self.p.consts["THC_TNA_RECIRC_PORT"][0]
        got = (f.get("ig_tm_md.ucast_egress_port", 0), f.get("ig_tm_md.qid", 0),
               f.get("ig_tm_md.mcast_grp_a", 0))
        if got != (want, 0, 0):
            raise AssertionError(f"a pass going round leaves by (port, queue, group) {got}, "
                                 f"not ({want}, 0, 0)")

    def _round(self, f: dict, frame: bytes, tstamp: int, port: int, lost: bool = False) -> list:
        """The passes after pass 0 (pass 1 parses what pass 0's deparser emitted: its bridge
        header, then its valid headers), then the last pass's replies. ``lost``: one of
        them, picked at random, is lost and the passes after it never run."""
        hdr_only = f.get("meta.bridge.hdr_only", 0)
        until = None
        if lost:
            total = 1 if hdr_only or f.get("meta.bridge.is_max", 0) else \
                4 if f.get("meta.bridge.wide", 0) else 2
            until = self.loss_rng.randrange(total)
            self.lost += 1
            if until == 0:
                return []
        self._egress_reads(f)
        f1 = self._pass(self._deparsed(f), f["ig_tm_md.ucast_egress_port"], tstamp)
        if "meta.bridge" not in f1["valid"]:
            raise AssertionError("pass 1 left its bridge header invalid")
        if f.get("meta.bridge.in_port", 0) != port:
            raise AssertionError(f"pass 0 bridged in_port {f.get('meta.bridge.in_port', 0)}, "
                                 f"the packet came in at {port}: a reply would go there")
        sent, passes = b"", 0
        if not hdr_only:
            walk = self._lanes(f, frame, until)
            if walk.last is None:
                return []
            sent, passes = walk.payload, self._last_pass(f, walk.last)
        if not f.get("meta.bridge.reply", 0):
            return []
        if hdr_only:   # pass 1 sends it, its header as it left
            f = dict(f, **{k: v for k, v in f1.items() if k.startswith("hdr.thc.")})
        grp = f.get("meta.bridge.mcast_grp", 0)
        # the last pass's bridge header: new (zeros), is_reply set and its use's last passes
        # (its branch is held to its text: tests/tna/words.py); its packet's headers are
        # those pass 0 emitted
        last = {k: v for k, v in f.items() if not k.startswith(("meta.bridge.", "meta.p1."))}
        last["meta.bridge.is_reply"], last["meta.bridge.passes"] = 1, passes
        last["valid"] = f["valid"] - {"meta.p1"} | {"meta.bridge"}
        return self._replies(last, self.mcast.get(grp, []) if grp else [0], sent)

    def _egress_reads(self, f: dict) -> None:
        """The egress parser of a pass going round (a 16-bit job's doubling reads its
        headers to reach the next block) reads the bridge header and headers pass 0's
        ingress deparser emitted, field for field."""
        m = Machine(self.p.egress, {}, self.counters, self.installed)
        m.packet, m.f = self._deparsed(f), {}
        m.parse()
        wrong = [k for k, v in m.f.items() if k.startswith("hdr.") and
                 v != f.get(k.replace("hdr.bridge.", "meta.bridge.", 1), 0)]
        if wrong:
            raise AssertionError(f"egress read {', '.join(wrong[:4])} of a pass going round "
                                 f"otherwise than pass 0 wrote them")

    def _replies(self, f: dict, rids: list[int], sent: bytes) -> list:
        """What egress makes of a reply the ingress deparser emitted with the fields ``f``
        (and the lanes ``sent``), once a replica: its parser, ThcEgress with the controller's
        thc_worker_addr entries (a replica's rid, 0 for a unicast), its deparser. Each frame
        goes where its IPv4 and UDP headers say, and must be one a worker's stack takes."""
        replies, packet = [], self._deparsed(f) + sent
        before = self.withheld()
        for rid in rids:
            m = Machine(self.p.egress, {}, self.counters, self.installed)
            m.packet, m.f = packet, {"eg_intr_md.egress_rid": rid}
            m.parse()
            m.run(self.p.egress.apply)
            if m.f.get("eg_dprsr_md.drop_ctl", 0) & 1:
                continue
            m.run(self.p.egress.deparse)
            replies.append(self._delivered(m.emitted() + packet[m.at // 8:]))
        use = (f.get("hdr.thc.run", 0), f.get("hdr.thc.seq", 0))
        self.withheld_uses[use] += self.withheld() - before
        return replies

    def _delivered(self, frame: bytes) -> tuple[bytes, tuple[str, int]]:
        """(UDP payload, destination) of a reply frame, after the checks a worker's NIC and
        kernel make: its MAC, IPv4, the THC port, and ``frame_faults``'s checksums and
        lengths."""
        ip, udp = frame[14:14 + IPV4_HEADER_BYTES], frame[14 + IPV4_HEADER_BYTES:]
        dest = (str(ipaddress.IPv4Address(ip[16:20])), int.from_bytes(udp[2:4], "big"))
        problems = [what for what, bad in (
            ("a frame shorter than its headers", len(frame) < FRAME_HEADERS),
            ("not to the worker's MAC", int.from_bytes(frame[:6], "big") != self.macs.get(dest)),
            ("not IPv4", frame[12:14] != b"\x08\x00" or ip[0] != 0x45 or ip[9] != 17),
            ("not from the THC port", int.from_bytes(udp[0:2], "big") != P.UDP_PORT)) if bad]
        problems += frame_faults(frame)   # checksums and lengths
        if problems:
            raise AssertionError(f"a reply to {dest} with {', '.join(problems)}: "
                                 f"{frame[:FRAME_HEADERS].hex()}")
        return udp[UDP_HEADER_BYTES:], dest

    def _lanes(self, f: dict, frame: bytes, until: int | None = None):
        """The adding passes of a packet pass 0 sent round (tests/tna/passes.py), from the
        bridge header it wrote, with the words' registers (``until``: the passes that come
        round before one is lost)."""
        p1 = {k[len("meta.bridge."):]: v for k, v in f.items() if k.startswith("meta.bridge.")}
        job = self.jobs[f["meta.job_index"]]
        if p1.get("lut_job", 0) != self.p.consts["THC_TNA_NO_LUT"][0]:
            assert p1["lut_job"] == f["meta.job_index"], "a lookup of another job's entries"
        return passes(job, p1, frame[FRAME_HEADERS:], self.rng, self.words, until=until)

    def _last_pass(self, f: dict, p1: dict) -> int:
        """The last pass's count of its use's last passes (thc_current_op through pass 1's
        address fields, thc_passes_op; on the bridge header it read and the headers pass 0
        emitted), which it bridges to egress."""
        m = Machine(self.p, self.regs, self.counters, self.installed)
        m.f = {k: v for k, v in f.items() if k.startswith("hdr.")}
        m.f.update({"meta.p1." + k: v for k, v in p1.items()})
        m.valid = set(f["valid"]) | {"meta.p1", "meta.bridge"}
        m.action("thc_detail_index", [])
        m.apply_table("thc_current_op")
        m.apply_table("thc_passes_op")
        return m.f.get("meta.bridge.passes", 0)

    def _deparsed(self, f: dict) -> bytes:
        """The headers a pass's ingress deparser emits (tests/tna/lanes.py's DEPARSE order;
        the lanes aside), the valid ones, as bytes."""
        value, bits = 0, 0
        for path in ("meta.bridge", "meta.p1", "hdr.ethernet", "hdr.ipv4", "hdr.udp", "hdr.thc"):
            if path in f["valid"]:
                for name, w in self.p.layout(path):
                    value, bits = value << w | f.get(name, 0), bits + w
        return value.to_bytes(bits // 8, "big")

    def _pass(self, packet: bytes, port: int, tstamp: int) -> dict:
        m = Machine(self.p, self.regs, self.counters, self.installed)
        m.packet = packet
        m.f = {"ig_intr_md.ingress_port": port, "ig_intr_md.ingress_mac_tstamp": tstamp}
        m.parse()
        m.run(self.p.apply)
        m.f["valid"] = frozenset(m.valid)
        return m.f

    def _header_only(self, f: dict) -> None:
        """A reply pass 1 only sends (it refreshes the job's idle clock on the way) must not
        reach the words, their lookups or a use's acknowledgements, which this reading does
        not run in pass 1: pass 0 must have said so in the bridge header."""
        want = {"lane_op": "THC_OP_NONE", "payload": "THC_PAY_NONE", "lut_job": "THC_TNA_NO_LUT",
                "last": 1, "reply": 1, "new_use": 0}
        for name, value in want.items():
            value = self.p.consts[value][0] if isinstance(value, str) else value
            got = f.get("meta.bridge." + name, 0)
            if got != value:
                raise AssertionError(f"a header-only pass 1 with bridge {name} {got}, not {value}")

    def withheld(self) -> int:
        """RESULT copies egress withheld (thc_lost_passes): a pass of their use was lost, or
        they come from a late pass of a use another opening replaced."""
        return self.counters["thc_lost_passes", 0]

    def drops(self) -> Counter:
        """thc_drops by reason name, as the model's ``drops``."""
        return Counter({P.DropReason(i).name: n for (c, i), n in self.counters.items()
                        if c == names.DROPS and n})

    def job_counters(self, job_index: int = 0) -> dict[str, int]:
        """The job's five thc_job_counters cells, by protocol.json's names."""
        base = job_index * len(P.JOB_COUNTERS)
        return {k: self.counters[names.JOB_COUNTERS, base + i] for k, i in P.JOB_COUNTERS.items()}
