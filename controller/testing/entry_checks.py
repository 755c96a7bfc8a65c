"""What a P4Runtime server checks of a table-entry update, for a switch that cannot run here.

controller/testing/memswitch.py keeps table entries in memory; to be worth testing against,
it must refuse what BMv2's P4Runtime server (p4lang/PI) refuses. :class:`EntryChecker`
decodes a serialized ``p4.v1.Entity`` (as controller/p4rt.py writes it, or a message
serialized) and checks it against the P4Info: the table, its match fields and the action
exist, the action is one the table may hold (not ``@defaultonly``), every exact match field
and every parameter is given once, and each value fits its bit width. A refusal is
:class:`Refused` with PI's code (INVALID_ARGUMENT for an unknown id or a value too wide).

The decoder is hand-written: with the pure-Python protobuf runtime p4runtime-shell pins,
``Entity.FromString`` costs about 0.2 ms, and one install writes 32768 lookup entries.
"""
from __future__ import annotations

from functools import lru_cache

from google.rpc import code_pb2

Key = tuple  # ((match field id, value), ...) sorted by id
Action = tuple  # (action id, ((param id, value), ...) sorted by id)


class Refused(Exception):
    """An update the server refuses: ``code`` is a google.rpc code."""

    def __init__(self, code: int, message: str):
        super().__init__(f"{code_pb2.Code.Name(code)}: {message}")
        self.code, self.message = code, message


def _invalid(message: str) -> Refused:
    return Refused(code_pb2.INVALID_ARGUMENT, message)


def _numbers() -> dict[str, int]:
    from p4.v1 import p4runtime_pb2 as pb

    def n(message, field):
        return message.DESCRIPTOR.fields_by_name[field].number
    return {"entity.table_entry": n(pb.Entity, "table_entry"),
            "table.id": n(pb.TableEntry, "table_id"), "table.match": n(pb.TableEntry, "match"),
            "table.action": n(pb.TableEntry, "action"),
            "match.id": n(pb.FieldMatch, "field_id"), "match.exact": n(pb.FieldMatch, "exact"),
            "exact.value": n(pb.FieldMatch.Exact, "value"),
            "table_action.action": n(pb.TableAction, "action"),
            "action.id": n(pb.Action, "action_id"), "action.params": n(pb.Action, "params"),
            "param.id": n(pb.Action.Param, "param_id"),
            "param.value": n(pb.Action.Param, "value")}


_N = _numbers()


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) of one message: varints as ints, length-delimited as bytes."""
    out, pos, end = [], 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise _invalid(f"unexpected wire type {wire}")
        out.append((key >> 3, value))
    if pos != end:
        raise _invalid("truncated message")
    return out


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise _invalid("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, pos


def _only(fields, allowed: set[int], what: str) -> None:
    extra = {num for num, _ in fields} - allowed
    if extra:
        raise Refused(code_pb2.UNIMPLEMENTED,
                      f"{what} fields {sorted(extra)} are not handled by the in-memory switch")


@lru_cache(maxsize=1 << 14)
def _id_value(piece: bytes, id_field: int, holder: int | None, value_field: int) -> tuple:
    """(id, value bytes) of a FieldMatch (value inside ``exact``) or an Action.Param."""
    fields = _fields(piece)
    _only(fields, {id_field, value_field if holder is None else holder}, "match/param")
    ident, value = 0, None
    for num, v in fields:
        if num == id_field:
            ident = v
        elif holder is None:
            value = v
        else:
            inner = _fields(v)
            _only(inner, {value_field}, "exact match")
            value = next((x for n, x in inner if n == value_field), b"")
    if value is None:
        raise _invalid(f"field or parameter {ident} has no exact value")
    return ident, bytes(value)


class EntryChecker:
    """Decodes and checks table-entry updates against one P4Info."""

    def __init__(self, p4info):
        self.tables = {t.preamble.id: t for t in p4info.tables}
        self.actions = {a.preamble.id: a for a in p4info.actions}
        self._widths = {i: {f.id: (f.name, f.bitwidth) for f in t.match_fields}
                        for i, t in self.tables.items()}
        self._widths.update({i: {p.id: (p.name, p.bitwidth) for p in a.params}
                             for i, a in self.actions.items()})
        self._cache: dict[bytes, tuple] = {}
        self._pieces: dict[tuple, tuple] = {}

    def check(self, entity: bytes, with_action: bool) -> tuple[int, Key, Action | None]:
        """(table id, key, action) of a serialized Entity; Refused when invalid.
        ``with_action``: the update needs one (INSERT, MODIFY)."""
        got = self._cache.get(entity)
        if got is None:
            got = self._decode(entity)
            if len(self._cache) > 1 << 17:
                self._cache.clear()
                self._pieces.clear()
            self._cache[entity] = got
        if with_action and got[2] is None:
            raise _invalid(f"table {self.tables[got[0]].preamble.name}: an entry without action")
        return got

    def _decode(self, entity: bytes) -> tuple:
        fields = _fields(entity)
        _only(fields, {_N["entity.table_entry"]}, "Entity")
        if not fields:
            raise _invalid("an empty Entity")
        te = _fields(fields[0][1])
        _only(te, {_N["table.id"], _N["table.match"], _N["table.action"]}, "TableEntry")
        table_id = next((v for n, v in te if n == _N["table.id"]), 0)
        table = self.tables.get(table_id)
        if table is None:
            raise _invalid(f"invalid P4 id: no table {table_id}")
        matches = tuple(v for n, v in te if n == _N["table.match"])
        key = self._pieces.get((table_id, matches))
        if key is None:
            if any(f.match_type != f.EXACT for f in table.match_fields):
                raise Refused(code_pb2.UNIMPLEMENTED, f"table {table.preamble.name}: only "
                              f"exact matches are handled by the in-memory switch")
            key = self._values(table_id, table.preamble.name, "match field", [
                _id_value(v, _N["match.id"], _N["match.exact"], _N["exact.value"])
                for v in matches])
            self._pieces[(table_id, matches)] = key
        actions = [v for n, v in te if n == _N["table.action"]]
        action = None
        if actions:
            action = self._pieces.get((table_id, actions[-1]))
            if action is None:
                action = self._pieces[(table_id, actions[-1])] = self._action(table,
                                                                             actions[-1])
        return table_id, key, action

    def _action(self, table, table_action: bytes) -> Action:
        outer = _fields(table_action)
        _only(outer, {_N["table_action.action"]}, "TableAction")
        fields = _fields(outer[0][1]) if outer else []
        _only(fields, {_N["action.id"], _N["action.params"]}, "Action")
        action_id = next((v for n, v in fields if n == _N["action.id"]), 0)
        action = self.actions.get(action_id)
        if action is None:
            raise _invalid(f"invalid P4 id: no action {action_id}")
        ref = next((r for r in table.action_refs if r.id == action_id), None)
        if ref is None or ref.scope == ref.DEFAULT_ONLY:
            raise _invalid(f"table {table.preamble.name} cannot hold action "
                           f"{action.preamble.name} in an entry")
        params = [_id_value(v, _N["param.id"], None, _N["param.value"])
                  for n, v in fields if n == _N["action.params"]]
        return action_id, self._values(action_id, action.preamble.name, "parameter", params)

    def _values(self, owner_id: int, owner: str, kind: str, given) -> tuple:
        """Every P4Info field given once and within its bit width, as sorted (id, int)."""
        widths = self._widths[owner_id]
        out = {}
        for ident, raw in given:
            if ident not in widths:
                raise _invalid(f"{owner} has no {kind} {ident}")
            if ident in out:
                raise _invalid(f"{owner}: {kind} {widths[ident][0]} given twice")
            value = int.from_bytes(raw, "big")
            if value >> widths[ident][1]:
                raise _invalid(f"{owner}: {kind} {widths[ident][0]} = {value} does not fit "
                               f"within {widths[ident][1]} bits")
            out[ident] = value
        missing = sorted(name for i, (name, _) in widths.items() if i not in out)
        if missing:
            raise _invalid(f"{owner}: {kind}s {missing} missing")
        return tuple(sorted(out.items()))
