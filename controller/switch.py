"""Connection to one switch (BMv2, or Tofino's bf_switchd) over P4Runtime, on
p4runtime-shell's public API.

``Switch`` opens a session with ``p4runtime_sh.shell.setup`` (device id 0 by default, as
``simple_switch_grpc --device-id 0``), optionally pushing the compiled BMv2 pipeline from
``p4src/build`` (bf_switchd loads its program itself), and offers what the other controller
modules need: P4Info name lookup and the program's target (controller/targets/), table
entries as p4runtime ``TableEntry`` messages (or serialized, for thousands of lookup
entries), batched writes that report per-update errors, reads, counters
(``shell.CounterEntry``), multicast groups (``shell.MulticastGroupEntry``) and raw
packet-out. What p4runtime-shell lacks is in controller/p4rt.py.

p4runtime-shell keeps one client per process, so only one ``Switch`` may be open at a time;
every failure becomes a :class:`SwitchError` with the reason.
"""
from __future__ import annotations

import functools
import hashlib
import threading
from pathlib import Path
from typing import Iterable, Iterator

from thc.controller import p4rt, targets
from thc.controller.program import short_name
from thc.controller.toolchain import BUILD_DIR

DEFAULT_GRPC = "127.0.0.1:9559"
DEFAULT_DEVICE_ID = 0
WRITE_BATCH = 2000
"""Updates per WriteRequest: a job's thousands of lookup entries go in a few requests."""

_active_lock = threading.Lock()
_active: "Switch | None" = None



def _why(error) -> str:
    """A P4Runtime error in one line: a gRPC error's code and details (a deadline's too)."""
    if callable(getattr(error, "code", None)) and callable(getattr(error, "details", None)):
        return f"{error.code().name}: {error.details()}"
    return str(error)

class SwitchError(RuntimeError):
    """The switch could not be reached, programmed or queried; the message says why."""


class Displaced(SwitchError):
    """Another controller became primary while the P4Runtime session was open: nothing more
    goes through the session, and what it wrote after that controller's writes stands."""


class NoProgram(SwitchError):
    """The switch runs no P4 program yet (it holds no job)."""


def program_files(program: str = "thc", build_dir: Path | str = BUILD_DIR) -> tuple[Path, Path]:
    """(P4Info text, BMv2 JSON) of a compiled program in ``build_dir``."""
    build_dir = Path(build_dir)
    p4info, bmv2 = build_dir / f"{program}.p4info.txt", build_dir / f"{program}.json"
    for path in (p4info, bmv2):
        if not path.exists():
            raise SwitchError(f"{path} not found: compile the P4 program with `make p4`")
    return p4info, bmv2


def _differences(got, pushed) -> str:
    """How the P4Info a switch reports differs from the one pushed to it, by its tables',
    actions' and counters' ids and names ("" where alike)."""
    out = []
    for kind in ("tables", "actions", "counters"):
        have, want = ({(o.preamble.id, o.preamble.name) for o in getattr(info, kind)}
                      for info in (got, pushed))
        if have != want:
            out.append(f"{kind}: {len(want - have)} pushed not reported, {len(have - want)} "
                       f"reported not pushed")
    return "; ".join(out)


def load_p4info(path: Path | str):
    """A P4Info text file as a ``p4.config.v1.P4Info`` message."""
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2
    path = Path(path)
    if not path.exists():
        raise SwitchError(f"{path} not found: compile the P4 program (`make p4`; for Tofino "
                          f"p4c's Tofino back end with --p4runtime-files)")
    info = p4info_pb2.P4Info()
    try:
        text_format.Merge(path.read_text(), info)
    except text_format.ParseError as e:
        raise SwitchError(f"{path} is no P4Info ({e}): compile the P4 program again") from None
    return info


def encode_value(value, bitwidth: int) -> bytes:
    """An integer, IPv4 address or MAC address as a canonical P4Runtime byte string
    (strings through p4runtime-shell's parser, plus the exact bit-width check it leaves out)."""
    if isinstance(value, str):
        try:
            num = int.from_bytes(p4rt.parse_value(value, bitwidth), "big")
        except ValueError as e:
            raise SwitchError(f"value {value!r} {e}") from None
    else:
        num = int.from_bytes(value, "big") if isinstance(value, bytes) else int(value)
    if num < 0 or num >> bitwidth:
        raise SwitchError(f"value {value!r} does not fit {bitwidth} bits")
    return p4rt.canonical_bytes(num)


@functools.lru_cache(maxsize=1 << 14)
def _encode_cached(value, bitwidth: int) -> bytes:
    """encode_value, memoized for the values lookup entries repeat by the thousand (ints,
    strings and bytes are all hashable; a refusal raises and is not cached)."""
    return encode_value(value, bitwidth)


class _Names:
    """P4Info objects by full name and by short name (the part after the last dot)."""

    def __init__(self, objs):
        self.by_name = {}
        short: dict[str, list] = {}
        for o in objs:
            self.by_name[o.preamble.name] = o
            short.setdefault(short_name(o.preamble.name), []).append(o)
        for name, found in short.items():
            if len(found) == 1:
                self.by_name.setdefault(name, found[0])

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def get(self, name: str, kind: str):
        try:
            return self.by_name[name]
        except KeyError:
            raise SwitchError(f"the switch's P4 program has no {kind} {name!r}: it runs "
                              f"another program (or the P4Info read is another build's); "
                              f"push THC's (`thc controller push`, or `install --push`)"
                              ) from None


class Switch:
    """One P4Runtime session with a switch (use as a context manager)."""

    def __init__(self, grpc_addr: str = DEFAULT_GRPC, device_id: int = DEFAULT_DEVICE_ID,
                 election_id: tuple[int, int] | None = None, timeout: float = 5.0,
                 require_primary: bool = True):
        """``election_id``: a writer's of its own (:func:`p4rt.writer_election_id`, taken as
        the session opens) unless given."""
        self.require_primary = require_primary
        self.is_primary = False
        self.grpc_addr = grpc_addr
        self.device_id = device_id
        self.election_id = election_id
        self.timeout = timeout
        self.client = None
        self.p4info = None
        self.target = None
        self._writer: p4rt.BatchWriter | None = None
        self._taken_by: tuple[int, int] | None = None

    # -- session ------------------------------------------------------------------------
    def connect(self, program: str | None = "thc", build_dir: Path | str = BUILD_DIR) -> "Switch":
        """Open the session; push ``program`` from ``build_dir`` first unless it is None."""
        global _active
        files = program_files(program, build_dir) if program else None
        with _active_lock:
            if _active is not None:
                raise SwitchError(
                    f"a P4Runtime session to {_active.grpc_addr} is already open in this "
                    f"process (p4runtime-shell has one client per process); close it first")
            _active = self
        try:
            self._open(files)
        except BaseException:
            self.close()
            raise
        return self

    def _open(self, files) -> None:
        pipeline = (str(files[0]), str(files[1])) if files else None
        try:
            self.client, p4info, self.is_primary = p4rt.open_session(
                self.grpc_addr, self.device_id, self.election_id, pipeline, self.timeout)
            self.election_id = tuple(self.client.election_id)
        except p4rt.NoPipeline as e:
            raise NoProgram(str(e)) from None
        except p4rt.SessionError as e:
            raise SwitchError(str(e)) from None
        if not self.is_primary and (self.require_primary or files is not None):
            raise SwitchError(
                f"another controller is primary on {self.grpc_addr} (election id "
                f"{self.election_id} is not the highest: a writer that started earlier, or "
                f"one given a higher --election-id, holds the switch); this client cannot "
                f"write: wait for it to finish")
        if not p4info.tables and files is None:
            raise NoProgram(f"the switch at {self.grpc_addr} has no P4 program for device "
                            f"{self.device_id}: push one (`thc controller push`), or give the "
                            f"device id the switch runs (--device-id; a push to another id "
                            f"leaves that device empty)")
        if files is not None and (differ := _differences(p4info, load_p4info(files[0]))):
            raise SwitchError(
                f"the switch at {self.grpc_addr} took the push of {files[0]} but reports "
                f"another program ({differ}): it did not load the one pushed; nothing was "
                f"written")
        self._load_p4info(p4info)
        self._writer = p4rt.BatchWriter(self.grpc_addr, self.device_id, self.election_id)

    def _load_p4info(self, p4info) -> None:
        self._cache: dict = {}
        self.p4info = p4info
        self.target = targets.of_p4info(p4info)
        """The target whose program this is (controller/targets/); None for another program."""
        self.tables = _Names(p4info.tables)
        self.actions = _Names(p4info.actions)
        self.counters = _Names(p4info.counters)

    @classmethod
    def offline(cls, program: str = "thc", build_dir: Path | str = BUILD_DIR) -> "Switch":
        """A Switch that only knows a compiled P4Info (builds entries; cannot talk)."""
        sw = cls()
        sw._load_p4info(load_p4info(Path(build_dir) / f"{program}.p4info.txt"))
        return sw

    def close(self) -> None:
        global _active
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.client is not None:
            p4rt.close_session(self.client)
            self.client = None
        with _active_lock:
            if _active is self:
                _active = None

    def __enter__(self) -> "Switch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _require(self):
        if self.client is None:
            raise SwitchError("not connected: call Switch.connect() first")
        if p4rt.stream_ended(self.client):
            raise SwitchError(
                f"the switch at {self.grpc_addr} ended this controller's P4Runtime stream (it "
                f"restarted, or closed the session): the session no longer holds the switch, "
                f"and what it read before may not be what the switch holds now; nothing more "
                f"goes through it. Run the command again")
        if self.require_primary and self.is_primary and self._taken_by is None \
                and p4rt.can_see_arbitration(self.client):
            self._taken_by = p4rt.primary_taken(self.client)
        if self._taken_by is not None:
            raise Displaced(
                f"another controller (election id {self._taken_by}) became primary on "
                f"{self.grpc_addr} while this P4Runtime session was open: it may have changed "
                f"the switch since this controller read it (installed a job in a slot pool or "
                f"index this one planned to use), and the switch accepts this controller's "
                f"writes again once it closes, so nothing more goes through this P4Runtime "
                f"session. Run the command again when that controller is done")
        return self.client

    def confirm_held(self) -> None:
        """Raise :class:`Displaced` where another controller took the switch since the
        session opened: run after a change's last write, which no later check would see. It
        asks the switch (an arbitration round trip), as an update the switch sent during
        that write may still be on its way."""
        client = self._require()
        if self.require_primary and self.is_primary and p4rt.can_see_arbitration(client):
            self._taken_by = p4rt.primary_taken_by_now(client)
            self._require()

    # -- P4Info -------------------------------------------------------------------------
    def has_table(self, name: str) -> bool:
        return name in self.tables

    def key_names(self, table: str) -> list[str]:
        """The names of a table's match fields, in the P4Info's order."""
        return [f.name for f in self.tables.get(table, "table").match_fields]

    def program_digest(self) -> bytes:
        """A digest of the loaded P4Info: what serialized entries depend on besides their
        values (ids, widths, lanes), so that entries built for one switch serve another."""
        got = self._cache.get("digest")
        if got is None:
            got = self._cache["digest"] = hashlib.blake2b(
                self.p4info.SerializeToString(deterministic=True), digest_size=16).digest()
        return got

    @property
    def lanes(self) -> int:
        """Sum lanes of the loaded program (0 for a program without lookup tables)."""
        return self.target.lanes(self.p4info) if self.target is not None else 0

    def table_entry(self, table: str, match: dict, action: str | None = None,
                    params: dict | None = None):
        """A p4runtime TableEntry (exact matches); ``match`` and ``params`` map P4Info names
        to values (ints, IPv4 or MAC strings). Built from the P4Info ids directly: the same
        message as p4runtime-shell's ``TableEntry(...).msg()`` (tests/bmv2 compare them) at a
        fifth of its cost."""
        from p4.v1 import p4runtime_pb2
        tid, fields = self._ids("table", table)
        te = p4runtime_pb2.TableEntry(table_id=tid)
        for name, value in match.items():
            f = fields.get(name)
            if f is None:
                raise SwitchError(f"table {table} has no match field {name!r} "
                                  f"(has {sorted(fields)})")
            te.match.add(field_id=f[0]).exact.value = encode_value(value, f[1])
        if action is not None:
            aid, pinfo = self._ids("action", action)
            params = params or {}
            if len(params) != len(pinfo) or any(n not in pinfo for n in params):
                raise SwitchError(f"action {action} takes {sorted(pinfo)}, got {sorted(params)}")
            act = te.action.action
            act.action_id = aid
            for name in sorted(params, key=lambda n: pinfo[n][0]):
                pid, width = pinfo[name]
                act.params.add(param_id=pid, value=encode_value(params[name], width))
        return te

    def entry_bytes(self, table: str, match: dict, action: str | None = None,
                    params: dict | None = None) -> bytes:
        """The same entry as a serialized p4runtime Entity, written without building
        messages (controller/p4rt.py says why): for the thousands of lookup entries."""
        if action is None:
            tid, fields = self._ids("table", table)
            return p4rt.exact_entity(tid, self._match_values(table, fields, match))
        return self.entries_bytes(table, action, [(match, params or {})])[0]

    def entries_bytes(self, table: str, action: str, rows) -> list[bytes]:
        """:meth:`entry_bytes` of many (match, params) rows of one table and action: names are
        resolved once, and the pieces rows share are serialized once."""
        tid, fields = self._ids("table", table)
        aid, pinfo = self._ids("action", action)
        order = sorted(pinfo, key=lambda n: pinfo[n][0])
        encoded = []
        for match, params in rows:
            if len(params) != len(pinfo) or any(n not in pinfo for n in params):
                raise SwitchError(f"action {action} takes {sorted(pinfo)}, got {sorted(params)}")
            encoded.append((self._match_values(table, fields, match),
                            [(pinfo[n][0], _encode_cached(params[n], pinfo[n][1]))
                             for n in order]))
        return p4rt.exact_entities(tid, aid, encoded)

    @staticmethod
    def _match_values(table: str, fields: dict, match: dict) -> list:
        out = []
        for name, value in match.items():
            f = fields.get(name)
            if f is None:
                raise SwitchError(f"table {table} has no match field {name!r} "
                                  f"(has {sorted(fields)})")
            out.append((f[0], _encode_cached(value, f[1])))
        out.sort()
        return out

    def _ids(self, kind: str, name: str):
        """(id, {match field or param name: (id, bit width)}) of a table or action, cached."""
        info = self._cache.get((kind, name))
        if info is None:
            obj = (self.tables if kind == "table" else self.actions).get(name, kind)
            fields = obj.match_fields if kind == "table" else obj.params
            info = (obj.preamble.id, {f.name: (f.id, f.bitwidth) for f in fields})
            self._cache[(kind, name)] = info
        return info

    @staticmethod
    def match_values(entry) -> dict:
        """{field_id: int} of a read-back table entry."""
        return {m.field_id: int.from_bytes(m.exact.value, "big") for m in entry.match}

    def field_id(self, table: str, field: str) -> int:
        for f in self.tables.get(table, "table").match_fields:
            if f.name == field:
                return f.id
        raise SwitchError(f"table {table} has no match field {field!r}")

    def param_values(self, entry) -> dict[str, int]:
        """{param name: int} of a read-back table entry's action."""
        action_id = entry.action.action.action_id
        for a in self.p4info.actions:
            if a.preamble.id == action_id:
                names = {p.id: p.name for p in a.params}
                return {names[p.param_id]: int.from_bytes(p.value, "big")
                        for p in entry.action.action.params}
        return {}

    def table_name(self, table_id: int) -> str:
        return next((t.preamble.name for t in self.p4info.tables if t.preamble.id == table_id),
                    str(table_id))

    # -- writes and reads ---------------------------------------------------------------
    def write_entries(self, op: str, entities: Iterable, ignore: Iterable[str] = ()) -> list:
        """Write entities with INSERT/MODIFY/DELETE: serialized Entities (``entry_bytes``) or
        Entity / TableEntry messages, in batches of WRITE_BATCH.

        Returns the entities whose update failed with an error listed in ``ignore`` (e.g.
        ``ALREADY_EXISTS``); any other failure raises SwitchError.
        """
        from google.rpc import code_pb2
        from p4.v1 import p4runtime_pb2
        self._require()
        ents = list(entities)
        blobs = [e if isinstance(e, bytes) else (
            p4runtime_pb2.Entity(table_entry=e) if isinstance(e, p4runtime_pb2.TableEntry)
            else e).SerializeToString() for e in ents]
        try:
            # a session another controller displaced is given the switch back when that one
            # closes: checked before every WriteRequest, at most the one in flight lands
            failed = self._writer.write(p4runtime_pb2.Update.Type.Value(op), blobs, WRITE_BATCH,
                                        before=self._require)
        except p4rt.SessionError as e:
            raise SwitchError(f"{op} on {self.grpc_addr}: {e}") from None
        ignore_codes = {code_pb2.Code.Value(c) for c in ignore}
        bad = [f for f in failed if f.code not in ignore_codes]
        if bad:
            raise SwitchError(f"{op} failed for {len(bad)} of {len(ents)} entries; first: "
                              f"{code_pb2.Code.Name(bad[0].code)} {bad[0].message!r} on "
                              f"{self._describe(ents[bad[0].index])}")
        return [ents[f.index] for f in failed]

    def _describe(self, entity) -> str:
        from google.protobuf import text_format
        from p4.v1 import p4runtime_pb2
        if isinstance(entity, bytes):
            entity = p4runtime_pb2.Entity.FromString(entity)
        if isinstance(entity, p4runtime_pb2.TableEntry):
            entity = p4runtime_pb2.Entity(table_entry=entity)
        if entity.HasField("table_entry"):
            return (f"table {self.table_name(entity.table_entry.table_id)} "
                    f"{text_format.MessageToString(entity.table_entry, as_one_line=True)}")
        return text_format.MessageToString(entity, as_one_line=True)

    def read(self, entity) -> Iterator:
        """All entities matching ``entity`` (a p4runtime Entity; wildcards allowed)."""
        client = self._require()
        try:
            for rep in client.read_one(entity):
                yield from rep.entities
        except Exception as e:  # noqa: BLE001 - P4RuntimeException, or grpc.RpcError
            why = e.details() if callable(getattr(e, "details", None)) else e
            raise SwitchError(f"P4Runtime read from {self.grpc_addr} failed: {why}") from None

    def read_table(self, table: str) -> list:
        from p4.v1 import p4runtime_pb2
        ent = p4runtime_pb2.Entity()
        ent.table_entry.table_id = self.tables.get(table, "table").preamble.id
        return [e.table_entry for e in self.read(ent)]

    def read_counter(self, name: str) -> dict[int, int]:
        """{index: packets} of an indirect counter (``shell.CounterEntry`` wildcard read)."""
        from p4runtime_sh import shell as sh
        self._require()
        self.counters.get(name, "counter")
        try:
            with p4rt.quiet_shell():
                return {c.index: c.packet_count
                        for c in sh.CounterEntry(short_name(name)).read()}
        except Exception as e:  # noqa: BLE001 - P4RuntimeException while iterating
            raise SwitchError(f"reading counter {name} from {self.grpc_addr} failed: {e}") from None

    def counter_zeros(self, name: str, indices: Iterable[int]) -> list:
        """The p4runtime Entities that zero counter cells (written with MODIFY)."""
        from p4.v1 import p4runtime_pb2
        cid = self.counters.get(name, "counter").preamble.id
        ents = []
        for i in indices:
            ent = p4runtime_pb2.Entity()
            ent.counter_entry.counter_id = cid
            ent.counter_entry.index.index = i
            ent.counter_entry.data.packet_count = 0
            ent.counter_entry.data.byte_count = 0
            ents.append(ent)
        return ents

    def reset_counter(self, name: str, indices: Iterable[int]) -> bool:
        """Zero counter cells; False where the switch answers that it does not write counters
        (UNIMPLEMENTED). Any other refusal raises SwitchError, naming it: a write that failed
        is not a target without counter writes."""
        return not self.write_entries("MODIFY", self.counter_zeros(name, indices),
                                      ignore=("UNIMPLEMENTED",))

    # -- packet replication -------------------------------------------------------------
    def multicast_groups(self) -> dict[int, set[tuple[int, int]]]:
        """{group: {(egress port, instance)}} of the installed multicast groups."""
        from p4runtime_sh import shell as sh
        self._require()
        try:
            with p4rt.quiet_shell():
                return {g.group_id: {(r.egress_port, r.instance) for r in g.replicas}
                        for g in sh.MulticastGroupEntry().read()}
        except Exception as e:  # noqa: BLE001 - P4RuntimeException while iterating
            raise SwitchError(f"reading multicast groups from {self.grpc_addr} failed: "
                              f"{e}") from None

    def set_multicast_group(self, group: int, replicas: Iterable[tuple[int, int]]) -> None:
        """Create or replace a multicast group (``shell.MulticastGroupEntry``).

        On a target that keeps a group's replicas across a pipeline push, where P4Runtime
        forgets the group (BMv2: an insert then adds to the replicas it kept, so a job's
        results would also go out of ports its workers left), a group P4Runtime does not
        know is first inserted empty and deleted, which clears them. A group P4Runtime
        holds empty is such a clearing cut short: deleted, then cleared the same way (a
        modify would keep what the engine kept)."""
        import grpc
        from p4runtime_sh import shell as sh
        from p4runtime_sh.p4runtime import P4RuntimeWriteException
        from p4runtime_sh.utils import UserError
        self._require()
        clear = self.target is not None and self.target.keeps_groups_across_push
        try:
            with p4rt.quiet_shell():
                self._set_group(sh, group, replicas, clear)
        except (P4RuntimeWriteException, grpc.RpcError) as e:   # the latter: the deadline
            raise SwitchError(f"multicast group {group}: {_why(e)}") from None
        except (UserError, ValueError) as e:   # the shell's own refusals (group 0, -1)
            raise SwitchError(f"multicast group {group}: {e}") from None

    def _set_group(self, sh, group: int, replicas, clear: bool) -> None:
        entry = sh.MulticastGroupEntry(group)
        for port, instance in replicas:
            entry.add(port, instance)
        held = self.multicast_groups()
        if held.get(group) or (group in held and not clear):
            self._require()
            entry.modify()
            return
        steps = [sh.MulticastGroupEntry(group).delete] if clear and group in held else []
        if clear:
            steps += [sh.MulticastGroupEntry(group).insert, sh.MulticastGroupEntry(group).delete]
        for step in steps + [entry.insert]:
            self._require()   # as before each WriteRequest of write_entries
            step()

    def delete_multicast_group(self, group: int) -> bool:
        """Delete a multicast group; False when it did not exist."""
        import grpc
        from p4runtime_sh import shell as sh
        from p4runtime_sh.p4runtime import P4RuntimeWriteException
        if group not in self.multicast_groups():
            return False
        try:
            with p4rt.quiet_shell():
                sh.MulticastGroupEntry(group).delete()
        except (P4RuntimeWriteException, grpc.RpcError) as e:
            raise SwitchError(f"deleting multicast group {group}: {_why(e)}") from None
        return True

    # -- packet I/O ---------------------------------------------------------------------
    def packet_out(self, payloads: Iterable[bytes]) -> int:
        """Inject frames at the CPU port (raw: the program defines no packet_out header)."""
        return p4rt.send_raw_packets(self._require(), payloads)
