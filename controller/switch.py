"""Connection to one BMv2 switch over P4Runtime (p4runtime-shell's client and P4Info context).

``Switch`` connects (device id 0 by default, as ``simple_switch_grpc --device-id 0``),
optionally pushes the compiled pipeline from ``p4src/build``, and offers what the other
controller modules need: P4Info name lookup, table-entry construction, batched writes that
report per-update errors, reads, counters, multicast groups and packet-out.

p4runtime-shell keeps one global client per process and calls ``sys.exit`` when a setup
step fails; this module never lets that reach the caller: every failure becomes a
:class:`SwitchError` with the reason, and only one ``Switch`` may be open at a time.
"""
from __future__ import annotations

import ipaddress
import logging
import threading
from pathlib import Path
from typing import Iterable, Iterator

ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = ROOT / "p4src" / "build"
DEFAULT_GRPC = "127.0.0.1:9559"
DEFAULT_DEVICE_ID = 0
WRITE_BATCH = 2000
"""Updates per WriteRequest: a job's 16 x LANES lookup entries go in a few requests."""

GRPC_OPTIONS = [("grpc.max_metadata_size", 64 << 20),
                ("grpc.absolute_max_metadata_size", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20)]

_active_lock = threading.Lock()
_active: "Switch | None" = None


class SwitchError(RuntimeError):
    """The switch could not be reached, programmed or queried; the message says why."""


def program_files(program: str = "thc", build_dir: Path | str = BUILD_DIR) -> tuple[Path, Path]:
    """(P4Info text, BMv2 JSON) of a compiled program in ``build_dir``."""
    build_dir = Path(build_dir)
    p4info, bmv2 = build_dir / f"{program}.p4info.txt", build_dir / f"{program}.json"
    for path in (p4info, bmv2):
        if not path.exists():
            raise SwitchError(f"{path} not found: compile the P4 program with `make p4`")
    return p4info, bmv2


def short_name(name: str) -> str:
    return name.rsplit(".", 1)[-1]


# -- protobuf wire encoding of the few messages written in bulk -------------------------
_UPDATE_TYPES = {"INSERT": 1, "MODIFY": 2, "DELETE": 3}


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _vi(field: int, n: int) -> bytes:
    """A varint field."""
    return _varint(field << 3) + _varint(n)


def _ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field (bytes or a sub-message)."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def encode_value(value, bitwidth: int) -> bytes:
    """An integer, IPv4 address or MAC address as a canonical P4Runtime byte string."""
    if isinstance(value, bytes):
        num = int.from_bytes(value, "big")
    elif isinstance(value, str):
        if value.count(":") == 5:
            num = int(value.replace(":", ""), 16)
        elif value.count(".") == 3:
            num = int(ipaddress.IPv4Address(value))
        else:
            num = int(value, 0)
    else:
        num = int(value)
    if num < 0 or num >> bitwidth:
        raise SwitchError(f"value {value!r} does not fit {bitwidth} bits")
    return num.to_bytes(max(1, (num.bit_length() + 7) // 8), "big")


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
            raise SwitchError(f"the switch's P4 program has no {kind} {name!r}") from None


class Switch:
    """One P4Runtime session with a BMv2 switch (use as a context manager)."""

    def __init__(self, grpc_addr: str = DEFAULT_GRPC, device_id: int = DEFAULT_DEVICE_ID,
                 election_id: tuple[int, int] = (1, 0), timeout: float = 5.0,
                 require_primary: bool = True):
        self.require_primary = require_primary
        self.is_primary = False
        self.grpc_addr = grpc_addr
        self.device_id = device_id
        self.election_id = election_id
        self.timeout = timeout
        self.client = None
        self.p4info = None
        self._raw_write = None

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
            with _active_lock:
                _active = None
            self._close_client()
            raise
        return self

    def _open(self, files) -> None:
        import grpc
        from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc
        from p4runtime_sh import p4runtime as shp4rt
        from p4runtime_sh import shell as sh

        probe = grpc.insecure_channel(self.grpc_addr)
        try:
            grpc.channel_ready_future(probe).result(timeout=self.timeout)
        except grpc.FutureTimeoutError:
            raise SwitchError(f"no P4Runtime server at {self.grpc_addr} (is simple_switch_grpc "
                              f"running with --grpc-server-addr {self.grpc_addr}?)") from None
        finally:
            probe.close()

        switch = self

        class Client(shp4rt.P4RuntimeClient):
            def __init__(self, device_id, grpc_addr, election_id):
                # p4runtime-shell's constructor, with a channel that accepts the large error
                # details of a big batch (one p4.v1.Error per update in trailing metadata)
                self.device_id = device_id
                self.election_id = election_id
                self.role_name = None
                self.ssl_options = shp4rt.SSLOptions(True)
                self.channel = grpc.insecure_channel(grpc_addr, options=GRPC_OPTIONS)
                self.stub = p4runtime_pb2_grpc.P4RuntimeStub(self.channel)
                self.set_up_stream()

            # p4runtime-shell's handshake calls sys.exit on failure; raise instead.
            def handshake(self):
                req = p4runtime_pb2.StreamMessageRequest()
                req.arbitration.device_id = self.device_id
                req.arbitration.election_id.high = self.election_id[0]
                req.arbitration.election_id.low = self.election_id[1]
                self.stream_out_q.put(req)
                rep = self.get_stream_packet("arbitration", timeout=switch.timeout)
                if rep is None:
                    self.tear_down()
                    raise SwitchError(
                        f"P4Runtime arbitration with device {self.device_id} at "
                        f"{switch.grpc_addr} failed (does the switch run with --device-id "
                        f"{self.device_id}? does another client use election id "
                        f"{self.election_id}?)")
                switch.is_primary = rep.arbitration.status.code == 0
                if not switch.is_primary and switch.require_primary:
                    self.tear_down()
                    raise SwitchError(
                        f"another controller is primary on {switch.grpc_addr} (election id "
                        f"{self.election_id} is not the highest); this session cannot write")

        try:
            self.client = Client(self.device_id, self.grpc_addr, self.election_id)
        except SystemExit:
            raise SwitchError(f"could not open a P4Runtime session with {self.grpc_addr}") from None
        if files is not None and not self.is_primary:
            raise SwitchError(f"cannot push a pipeline to {self.grpc_addr}: another controller "
                              f"is primary")
        try:
            if files is not None:
                p4info_path, bmv2_path = files
                self.client.set_fwd_pipe_config(str(p4info_path), str(bmv2_path))
            p4info = self.client.get_p4info()
        except shp4rt.P4RuntimeException as e:
            what = "pushing the pipeline" if files is not None else "reading the P4Info"
            raise SwitchError(f"{what} failed on {self.grpc_addr}: {e}") from None
        except SystemExit:
            raise SwitchError(f"p4runtime-shell gave up talking to {self.grpc_addr}") from None
        if not p4info.tables and files is None:
            raise SwitchError(f"the switch at {self.grpc_addr} has no P4 program: push one "
                              f"(`thc controller push`)")
        self._load_p4info(p4info)
        # p4runtime-shell's module globals, so its objects (and users' shells) work too
        sh.client = self.client
        sh.context.set_p4info(p4info)

    def _load_p4info(self, p4info) -> None:
        self._tcache, self._acache = {}, {}
        self.p4info = p4info
        self.tables = _Names(p4info.tables)
        self.actions = _Names(p4info.actions)
        self.counters = _Names(p4info.counters)

    @classmethod
    def offline(cls, program: str = "thc", build_dir: Path | str = BUILD_DIR) -> "Switch":
        """A Switch that only knows a compiled P4Info (builds entries; cannot talk)."""
        from google.protobuf import text_format
        from p4.config.v1 import p4info_pb2
        p4info_path, _ = program_files(program, build_dir)
        info = p4info_pb2.P4Info()
        text_format.Merge(p4info_path.read_text(), info)
        sw = cls()
        sw._load_p4info(info)
        return sw

    def _close_client(self) -> None:
        if self.client is not None:
            try:
                self.client.tear_down()
            except Exception:  # noqa: BLE001 - best effort on a broken channel
                logging.debug("P4Runtime tear_down failed", exc_info=True)
            self.client = None
            self._raw_write = None
            try:
                from p4runtime_sh import shell as sh
                sh.client = None
            except ImportError:
                pass

    def close(self) -> None:
        global _active
        self._close_client()
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
        return self.client

    # -- P4Info -------------------------------------------------------------------------
    def has_table(self, name: str) -> bool:
        return name in self.tables

    @property
    def lanes(self) -> int:
        """Sum lanes of the loaded program: 8 per lane group (each group has one thc_lut_0)."""
        return 8 * sum(1 for t in self.p4info.tables
                       if short_name(t.preamble.name) == "thc_lut_0")

    def entry_bytes(self, table: str, match: dict, action: str | None = None,
                    params: dict | None = None) -> bytes:
        """A serialized p4runtime Entity holding one table entry (exact matches).

        ``match`` and ``params`` map P4Info names to values. Encoded by hand: with the pure
        Python protobuf runtime that p4runtime-shell's pin gives, building messages is what
        makes installing 16 x LANES lookup entries slow.
        """
        tinfo = self._table_info(table)
        tid, fields = tinfo
        te = _vi(1, tid)
        for name, value in match.items():
            f = fields.get(name)
            if f is None:
                raise SwitchError(f"table {table} has no match field {name!r} "
                                  f"(has {sorted(fields)})")
            te += _ld(2, _vi(1, f[0]) + _ld(2, _ld(1, encode_value(value, f[1]))))
        if action is not None:
            aid, pinfo = self._action_info(action)
            params = params or {}
            if len(params) != len(pinfo) or any(n not in pinfo for n in params):
                raise SwitchError(f"action {action} takes {sorted(pinfo)}, got {sorted(params)}")
            act = _vi(1, aid)
            for name, value in params.items():
                pid, width = pinfo[name]
                act += _ld(4, _vi(2, pid) + _ld(3, encode_value(value, width)))
            te += _ld(3, _ld(1, act))
        return _ld(2, te)

    def _table_info(self, table: str):
        info = self._tcache.get(table)
        if info is None:
            t = self.tables.get(table, "table")
            info = (t.preamble.id, {f.name: (f.id, f.bitwidth) for f in t.match_fields})
            self._tcache[table] = info
        return info

    def _action_info(self, action: str):
        info = self._acache.get(action)
        if info is None:
            a = self.actions.get(action, "action")
            info = (a.preamble.id, {p.name: (p.id, p.bitwidth) for p in a.params})
            self._acache[action] = info
        return info

    def table_entry(self, table: str, match: dict, action: str | None = None,
                    params: dict | None = None):
        """The same entry as a p4runtime TableEntry message."""
        from p4.v1 import p4runtime_pb2
        return p4runtime_pb2.Entity.FromString(
            self.entry_bytes(table, match, action, params)).table_entry

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

    # -- writes and reads ---------------------------------------------------------------
    def write(self, updates: list[bytes], batch: int = WRITE_BATCH) -> list[tuple[bytes, int, str]]:
        """Send serialized Updates in batches; return the failed ones as
        (update bytes, grpc code, message)."""
        import grpc
        from google.rpc import code_pb2, status_pb2
        from p4.v1 import p4runtime_pb2
        client = self._require()
        if self._raw_write is None:
            self._raw_write = client.channel.unary_unary(
                "/p4.v1.P4Runtime/Write", request_serializer=None,
                response_deserializer=p4runtime_pb2.WriteResponse.FromString)
        head = p4runtime_pb2.WriteRequest(device_id=self.device_id)
        head.election_id.high, head.election_id.low = self.election_id
        head = head.SerializeToString()
        failed = []
        for start in range(0, len(updates), batch):
            chunk = updates[start:start + batch]
            try:
                self._raw_write(head + b"".join(_ld(4, u) for u in chunk))
            except grpc.RpcError as e:
                # Per-update errors travel in the status details, one p4.v1.Error per update
                # (p4runtime-shell 0.0.6's iterator over them loops forever on an OK entry,
                # so they are decoded here).
                details = None
                for key, value in (e.trailing_metadata() or ()):
                    if key == "grpc-status-details-bin":
                        details = status_pb2.Status.FromString(value).details
                if e.code() != grpc.StatusCode.UNKNOWN or not details:
                    raise SwitchError(f"P4Runtime write to {self.grpc_addr} failed: "
                                      f"{e.code().name}: {e.details()}") from None
                for i, anyerr in enumerate(details):
                    err = p4runtime_pb2.Error()
                    anyerr.Unpack(err)
                    if err.canonical_code != code_pb2.OK:
                        failed.append((chunk[i], err.canonical_code, err.message))
        return failed

    def write_entries(self, op: str, entities: Iterable, ignore: Iterable[str] = ()) -> list:
        """Write entities with INSERT/MODIFY/DELETE: serialized Entity bytes (``entry_bytes``),
        or Entity / TableEntry messages.

        Returns the entities (serialized Entity bytes) whose update failed with an error listed
        in ``ignore`` (e.g. ``ALREADY_EXISTS``); any other failure raises SwitchError.
        """
        from google.rpc import code_pb2
        from p4.v1 import p4runtime_pb2
        prefix = _vi(1, _UPDATE_TYPES[op])
        blobs = []
        for ent in entities:
            if isinstance(ent, p4runtime_pb2.TableEntry):
                ent = _ld(2, ent.SerializeToString())
            elif isinstance(ent, p4runtime_pb2.Entity):
                ent = ent.SerializeToString()
            blobs.append(ent)
        ignore_codes = {code_pb2.Code.Value(c) for c in ignore}
        updates = [prefix + _ld(2, b) for b in blobs]
        blob_of = {id(u): b for u, b in zip(updates, blobs)}
        failed = self.write(updates)
        bad = [f for f in failed if f[1] not in ignore_codes]
        if bad:
            upd, code, msg = bad[0]
            entity = p4runtime_pb2.Update.FromString(upd).entity
            raise SwitchError(f"{op} failed for {len(bad)} of {len(blobs)} entries; first: "
                              f"{code_pb2.Code.Name(code)} {msg!r} on {self._describe(entity)}")
        return [blob_of[id(f[0])] for f in failed]

    def _describe(self, entity) -> str:
        from google.protobuf import text_format
        if entity.HasField("table_entry"):
            tid = entity.table_entry.table_id
            name = next((t.preamble.name for t in self.p4info.tables if t.preamble.id == tid), tid)
            return f"table {name} {text_format.MessageToString(entity.table_entry, as_one_line=True)}"
        return text_format.MessageToString(entity, as_one_line=True)

    def read(self, entity) -> Iterator:
        """All entities matching ``entity`` (a p4runtime Entity; wildcards allowed)."""
        from p4runtime_sh import p4runtime as shp4rt
        client = self._require()
        try:
            for rep in client.read_one(entity):
                yield from rep.entities
        except shp4rt.P4RuntimeException as e:
            raise SwitchError(f"P4Runtime read failed: {e}") from None
        except Exception as e:  # grpc.RpcError while iterating
            raise SwitchError(f"P4Runtime read from {self.grpc_addr} failed: "
                              f"{getattr(e, 'details', lambda: e)()}") from None

    def read_table(self, table: str) -> list:
        from p4.v1 import p4runtime_pb2
        ent = p4runtime_pb2.Entity()
        ent.table_entry.table_id = self.tables.get(table, "table").preamble.id
        return [e.table_entry for e in self.read(ent)]

    def read_counter(self, name: str) -> dict[int, int]:
        """{index: packets} of an indirect counter."""
        from p4.v1 import p4runtime_pb2
        ent = p4runtime_pb2.Entity()
        ent.counter_entry.counter_id = self.counters.get(name, "counter").preamble.id
        return {e.counter_entry.index.index: e.counter_entry.data.packet_count
                for e in self.read(ent)}

    def reset_counter(self, name: str, indices: Iterable[int]) -> bool:
        """Zero counter cells; False when the switch does not support counter writes."""
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
        try:
            self.write_entries("MODIFY", ents)
        except SwitchError:
            return False
        return True

    # -- packet replication -------------------------------------------------------------
    def multicast_entity(self, group: int, replicas: Iterable[tuple[int, int]]):
        """Entity of multicast group ``group`` with (egress port, instance) replicas."""
        from p4.v1 import p4runtime_pb2
        ent = p4runtime_pb2.Entity()
        mg = ent.packet_replication_engine_entry.multicast_group_entry
        mg.multicast_group_id = group
        for port, instance in replicas:
            mg.replicas.add(egress_port=port, instance=instance)
        return ent

    def set_multicast_group(self, group: int, replicas: Iterable[tuple[int, int]]) -> None:
        """Create or replace a multicast group."""
        ent = self.multicast_entity(group, list(replicas))
        if self.write_entries("INSERT", [ent], ignore=["ALREADY_EXISTS"]):
            self.write_entries("MODIFY", [ent])

    def delete_multicast_group(self, group: int) -> bool:
        """Delete a multicast group; False when it did not exist."""
        return not self.write_entries("DELETE", [self.multicast_entity(group, [])],
                                      ignore=["NOT_FOUND"])

    # -- packet I/O ---------------------------------------------------------------------
    def packet_out(self, payloads: Iterable[bytes]) -> int:
        """Inject frames at the CPU port (raw: the program defines no packet_out header)."""
        from p4.v1 import p4runtime_pb2
        client = self._require()
        n = 0
        for payload in payloads:
            msg = p4runtime_pb2.StreamMessageRequest()
            msg.packet.payload = payload
            client.stream_out_q.put(msg)
            n += 1
        return n
