"""An in-memory switch for the controller's tests: a switch that cannot run here.

The controller's job-safety rules (controller/jobs.py: the pool reset before workers go
live, live jobs left alone unless forced, bad input refused before any write, a restarted
controller leaving running jobs alone) concern what is written to the switch and when, not
packets, yet BMv2 is absent on most machines. :class:`MemorySwitch` is controller/switch.py's
``Switch`` (P4Info lookups and entry building inherited) whose calls to the switch a
:class:`MemoryDevice` answers, as a fake server beside a real client. The device keeps

* table entries, multicast groups and counter cells, each update checked against the P4Info
  as BMv2's P4Runtime server checks it (controller/testing/entry_checks.py), with its
  per-update errors (ALREADY_EXISTS, NOT_FOUND, and for a full table BMv2's UNKNOWN);
* ``log``: every write, counter reset and packet-out in order;
* RESET packet-outs run as p4src/thc.p4 runs them: a RESET of the install the job's
  thc_install entry names clears the job's slot inside its pool (``slot_resets``;
  ``reset_cells``: the register cell, from the job entry's pool_base when the RESET runs)
  and ``thc_resets[job_index]`` counts, else a drop reason (``cpu_port = False``:
  packet-outs are lost); any other packet raises NotImplementedError;
* worker traffic counted where the program counts it (``deliver``; inside ``sending`` one
  packet before every counter read, a worker that keeps sending).

A second MemorySwitch on the same device is a restarted controller.
"""
from __future__ import annotations

import contextlib
import functools
import ipaddress
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from google.rpc import code_pb2

from thc.controller import counters, p4rt, targets
from thc.controller.frames import parse_udp_frame
from thc.controller.program import WORKER_PORT_KEY
from thc.controller.switch import BUILD_DIR, NoProgram, Switch, SwitchError, short_name
from thc.controller.testing.entry_checks import EntryChecker, Refused
from thc.wire import protocol as P


class Event(NamedTuple):
    """INSERT/MODIFY/DELETE (table, (key, action)), GROUP_SET/GROUP_DELETE (group,
    replicas), COUNTER_RESET (counter, indices) or PACKET_OUT (None, frame)."""
    op: str
    target: str | int | None
    detail: object


@functools.lru_cache(maxsize=4)
def _program(program: str, build_dir: str) -> tuple:
    """(P4Info, EntryChecker) of a compiled program, shared by devices (its decode cache
    saves most of an install's time when tests install the same job ids)."""
    p4info = Switch.offline(program, build_dir).p4info
    return p4info, EntryChecker(p4info)


class MemoryDevice:
    """The switch's state: what a P4Runtime server would hold for a pushed program."""

    def __init__(self, program: str | None = "thc", build_dir: Path | str = BUILD_DIR):
        self.p4info = None
        self.log: list[Event] = []
        self.cpu_port = True
        """False: a switch started without ``--cpu-port``; packet-outs are lost."""
        self.counter_writes = True
        """False: a target that does not write counters (answers UNIMPLEMENTED)."""
        self._senders: list[tuple] = []
        """Workers that keep sending (:meth:`sending`), through pushes: they are hosts."""
        if program:
            self.push(program, build_dir)

    def push(self, program: str = "thc", build_dir: Path | str = BUILD_DIR) -> None:
        """Load a compiled program: every entry, group and counter starts empty."""
        self.p4info, self.checker = _program(program, str(build_dir))
        self.tables = {t.preamble.id: t for t in self.p4info.tables}
        self.table_ids = {short_name(t.preamble.name): t.preamble.id for t in self.p4info.tables}
        self.entries: dict[int, dict] = {tid: {} for tid in self.tables}
        self.groups: dict[int, set[tuple[int, int]]] = {}
        self.counter_sizes = {short_name(c.preamble.name): c.size for c in self.p4info.counters}
        self.cells: dict[str, dict[int, int]] = {name: {} for name in self.counter_sizes}
        self.slot_resets: list[tuple[int, int, int]] = []
        """(job_id, slot, version) of every RESET the data plane applied, in order."""
        self.reset_cells: list[int] = []
        """The slot registers' cell each of them cleared: (pool_base + slot) * 2 + version,
        pool_base + slot in 16 bits, as thc.p4 indexes them."""

    # -- control plane --------------------------------------------------------------------
    def write(self, op: str, entity: bytes) -> None:
        """Apply one update; Refused as the server would refuse it."""
        if op not in ("INSERT", "MODIFY", "DELETE"):
            raise Refused(code_pb2.INVALID_ARGUMENT, f"update type {op}")
        tid, key, action = self.checker.check(entity, with_action=op != "DELETE")
        table, name = self.entries[tid], self.checker.names[tid]
        if op == "INSERT" and key in table:
            raise Refused(code_pb2.ALREADY_EXISTS, f"{name}: entry {key} exists")
        if op != "INSERT" and key not in table:
            raise Refused(code_pb2.NOT_FOUND, f"{name}: no entry {key}")
        if op == "INSERT" and len(table) >= self.checker.sizes[tid]:
            raise Refused(code_pb2.UNKNOWN, f"Error when adding match entry to target "
                                            f"({name} is full)")
        if op == "DELETE":
            del table[key]
        else:
            table[key] = action
        self.log.append(Event(op, name, (key, action)))

    def table_entries(self, table_id: int) -> Iterator:
        """The entries of one table (every table for id 0) as p4runtime TableEntry messages,
        values as canonical byte strings (as BMv2 returns them)."""
        from p4.v1 import p4runtime_pb2
        if table_id and table_id not in self.entries:
            raise Refused(code_pb2.INVALID_ARGUMENT, f"invalid P4 id: no table {table_id}")
        for tid in ([table_id] if table_id else list(self.entries)):
            for key, action in list(self.entries[tid].items()):
                te = p4runtime_pb2.TableEntry(table_id=tid)
                for fid, value in key:
                    te.match.add(field_id=fid).exact.value = p4rt.canonical_bytes(value)
                if action is not None:
                    te.action.action.action_id = action[0]
                    for pid, value in action[1]:
                        te.action.action.params.add(param_id=pid,
                                                    value=p4rt.canonical_bytes(value))
                yield te

    def set_group(self, group: int, replicas: Iterable[tuple[int, int]]) -> None:
        replicas = set(replicas)
        # BMv2's pre refuses ids from 32768, Tofino's takes 16 bits
        target = targets.of_p4info(self.p4info) if self.p4info is not None else None
        top = (target or targets.TARGETS["bmv2"]).max_mcast_group
        if group <= 0:
            raise SwitchError(f"multicast group {group}: {group} is not a valid group_id for "
                              f"MulticastGroupEntry")
        if group > top:
            raise SwitchError(f"multicast group {group}: OUT_OF_RANGE 'Group id value is too "
                              f"high' (ids 1..{top})")
        if any(not 0 <= port < 1 << 9 for port, _ in replicas):
            raise SwitchError(f"multicast group {group}: INVALID_ARGUMENT (9-bit ports)")
        self.groups[group] = replicas
        self.log.append(Event("GROUP_SET", group, frozenset(replicas)))

    def delete_group(self, group: int) -> bool:
        if self.groups.pop(group, None) is None:
            return False
        self.log.append(Event("GROUP_DELETE", group, None))
        return True

    def read_counter(self, name: str) -> dict[int, int]:
        """{index: packets} of every cell; each active sender first delivers a packet."""
        for job, worker_id, cell in list(self._senders):
            self.deliver(job, worker_id, cell=cell)
        cells = self.cells[name]
        return {i: cells.get(i, 0) for i in range(self.counter_sizes[name])}

    def reset_counter(self, name: str, indices: Iterable[int]) -> bool:
        """False where ``counter_writes`` is off, as a target answers UNIMPLEMENTED."""
        if not self.counter_writes:
            return False
        indices = list(indices)
        if any(not 0 <= i < self.counter_sizes[name] for i in indices):
            raise SwitchError(f"counter {name}: index outside 0..{self.counter_sizes[name] - 1}")
        for i in indices:
            self.cells[name].pop(i, None)
        self.log.append(Event("COUNTER_RESET", name, tuple(indices)))
        return True

    # -- data plane -----------------------------------------------------------------------
    def _count(self, counter: str, index: int, n: int = 1) -> None:
        self.cells[counter][index] = self.cells[counter].get(index, 0) + n

    def _drop(self, reason: str) -> None:
        self._count(counters.DROPS, P.DropReason[reason])

    def _worker_key(self, job, w, ip: int) -> dict[str, int]:
        """The thc_worker key of a packet from worker ``w``, on its own switch port."""
        return {"job_id": job.job_id, "worker_id": w.id, "src_ip": ip, "src_port": w.port,
                WORKER_PORT_KEY: w.switch_port}

    def _params(self, table: str, match: dict[str, int]) -> dict[str, int] | None:
        """{param: value} of the entry of ``table`` (short name) that ``match`` hits."""
        tid = self.table_ids[table]
        fids = {f.name: f.id for f in self.tables[tid].match_fields}
        action = self.entries[tid].get(tuple(sorted((fids[k], v) for k, v in match.items())))
        if action is None:
            return None
        names = self.checker.params[action[0]]
        return {names[pid]: value for pid, value in action[1]}

    def packet_out(self, frame: bytes) -> None:
        """A frame injected at the CPU port: RESET runs; nothing else can run here."""
        self.log.append(Event("PACKET_OUT", None, frame))
        if not self.cpu_port:
            return
        parsed = parse_udp_frame(frame)
        payload = parsed[6] if parsed and parsed[5] == P.UDP_PORT else None
        if payload is None or (payload and payload[0] != P.PktType.RESET):
            raise NotImplementedError("the in-memory switch runs RESET packet-outs only")
        if len(payload) < P.HEADER_BYTES:
            self._drop("malformed")
            return
        hdr = P.Header.unpack(payload)
        job = self._params("thc_job", {"job_id": hdr.job_id})
        # p4src/thc.p4's order: the header, the job, the payload's length, the slot
        if hdr.version > 1:
            self._drop("malformed")
        elif job is None:
            self._drop("unknown_job")
        elif len(payload) != P.HEADER_BYTES:
            self._drop("bad_lanes")
        elif hdr.slot >= job["pool_size"]:
            self._drop("slot_outside_pool")
        elif self._params("thc_install", {"job_id": hdr.job_id, "epoch": hdr.epoch}) is None:
            self._drop("stale_reset")
        else:
            self.slot_resets.append((hdr.job_id, hdr.slot, hdr.version))
            self.reset_cells.append((job["pool_base"] + hdr.slot) % (1 << 16) * 2 + hdr.version)
            self._count(counters.RESETS, job["job_index"])

    def deliver(self, job, worker_id: int = 0, n: int = 1, cell: str = "packets") -> None:
        """``n`` DATA packets of worker ``worker_id`` of ``job`` (host/wire/jobs.py Job),
        counted where p4src/thc.p4 counts them: one of the job's cells, by what the packet
        did (``packets``: no reply; ``completions``, ``retransmissions``, ``pending``,
        ``held``)."""
        w = job.worker(worker_id)
        cfg = self._params("thc_job", {"job_id": job.job_id})
        ip = int(ipaddress.IPv4Address(w.ip))
        if cfg is None:
            self._drop("unknown_job")
        elif worker_id >= cfg["n_workers"]:
            self._drop("worker_outside_job")
        elif self._params("thc_worker", self._worker_key(job, w, ip)) is None:
            self._drop("unknown_worker")
        else:
            self._count(counters.JOB_COUNTERS,
                        counters.job_counter_index(cfg["job_index"], cell), n)

    @contextlib.contextmanager
    def sending(self, job, worker_id: int = 0, cell: str = "packets"):
        """A worker that keeps sending: one packet before every counter read (counted in
        ``cell``, as :meth:`deliver`)."""
        self._senders.append((job, worker_id, cell))
        try:
            yield self
        finally:
            self._senders.remove((job, worker_id, cell))

    # -- for assertions ---------------------------------------------------------------------
    def state(self, skip: Iterable[str] = ()) -> dict:
        """Every table (by name; but the tables named in ``skip``, by short name) and
        multicast group, comparable with ==."""
        skip = set(skip)
        tables = {t.preamble.name: dict(self.entries[tid]) for tid, t in self.tables.items()
                  if short_name(t.preamble.name) not in skip}
        return {"tables": tables, "groups": {g: set(r) for g, r in self.groups.items()}}


class MemorySwitch(Switch):
    """controller/switch.py's Switch on a :class:`MemoryDevice` (a new device unless given)."""

    def __init__(self, grpc_addr: str = "memory", device_id: int = 0,
                 election_id: tuple[int, int] = (1, 0), timeout: float = 5.0,
                 require_primary: bool = True, device: MemoryDevice | None = None):
        super().__init__(grpc_addr, device_id, election_id, timeout, require_primary)
        self.device = device if device is not None else MemoryDevice(program=None)

    def connect(self, program: str | None = "thc",
                build_dir: Path | str = BUILD_DIR) -> MemorySwitch:
        """Push ``program`` (clearing the device) unless None, then read the P4Info."""
        if program:
            self.device.push(program, build_dir)
        if self.device.p4info is None:
            raise NoProgram(f"the switch at {self.grpc_addr} has no P4 program: push one "
                            f"(`thc controller push`)")
        self._load_p4info(self.device.p4info)
        self.client, self.is_primary = self.device, True
        return self

    def close(self) -> None:
        self.client = None

    def write_entries(self, op: str, entities: Iterable, ignore: Iterable[str] = ()) -> list:
        from p4.v1 import p4runtime_pb2
        self._require()
        ents = list(entities)
        failed = []
        for i, e in enumerate(ents):
            if isinstance(e, p4runtime_pb2.TableEntry):
                e = p4runtime_pb2.Entity(table_entry=e)
            try:
                self.device.write(op, e if isinstance(e, bytes) else e.SerializeToString())
            except Refused as r:
                failed.append((i, r))
        codes = {code_pb2.Code.Value(c) for c in ignore}
        bad = [(i, r) for i, r in failed if r.code not in codes]
        if bad:
            i, r = bad[0]
            raise SwitchError(f"{op} failed for {len(bad)} of {len(ents)} entries; first: "
                              f"{code_pb2.Code.Name(r.code)} {r.message!r} on "
                              f"{self._describe(ents[i])}")
        return [ents[i] for i, _ in failed]

    def read(self, entity) -> Iterator:
        from p4.v1 import p4runtime_pb2
        self._require()
        if entity.WhichOneof("entity") != "table_entry":
            raise SwitchError("the in-memory switch reads table entries only")
        try:
            for te in self.device.table_entries(entity.table_entry.table_id):
                yield p4runtime_pb2.Entity(table_entry=te)
        except Refused as r:
            raise SwitchError(f"P4Runtime read from {self.grpc_addr} failed: {r}") from None

    def _counter(self, name: str) -> str:
        self._require()
        return short_name(self.counters.get(name, "counter").preamble.name)

    def read_counter(self, name: str) -> dict[int, int]:
        return self.device.read_counter(self._counter(name))

    def reset_counter(self, name: str, indices: Iterable[int]) -> bool:
        return self.device.reset_counter(self._counter(name), indices)

    def multicast_groups(self) -> dict[int, set[tuple[int, int]]]:
        self._require()
        return {g: set(r) for g, r in self.device.groups.items()}

    def set_multicast_group(self, group: int, replicas: Iterable[tuple[int, int]]) -> None:
        self._require()
        self.device.set_group(group, replicas)

    def delete_multicast_group(self, group: int) -> bool:
        self._require()
        return self.device.delete_group(group)

    def packet_out(self, payloads: Iterable[bytes]) -> int:
        self._require()
        frames = list(payloads)
        for frame in frames:
            self.device.packet_out(frame)
        return len(frames)
