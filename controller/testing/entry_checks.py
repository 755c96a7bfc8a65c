"""What a P4Runtime server checks of a table-entry update, for a switch that cannot run here.

controller/testing/memswitch.py keeps table entries in memory; to be worth testing against,
it must refuse what BMv2's P4Runtime server (p4lang/PI) refuses. :class:`EntryChecker`
decodes a serialized ``p4.v1.Entity`` (as controller/p4rt.py writes it, or a message
serialized) and checks it against the P4Info: the table, its match fields and the action
exist, the action is one the table may hold (not ``@defaultonly``), every exact match field
and every parameter is given once, and each value fits its bit width. A refusal is
:class:`Refused` with the code BMv2 gives (INVALID_ARGUMENT for an unknown id or a value too
wide, PERMISSION_DENIED for a ``@defaultonly`` action; tests/bmv2/test_memswitch_parity.py
compares them).

The decoder is hand-written: with the pure-Python protobuf runtime p4runtime-shell pins,
``Entity.FromString`` costs about 0.2 ms, and one install writes 32768 lookup entries.
"""
from __future__ import annotations

from functools import lru_cache

from google.rpc import code_pb2

from thc.controller.p4rt import read_varint

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
    try:
        while pos < end:
            key = buf[pos]
            pos += 1
            if key >= 0x80:
                key, pos = read_varint(buf, pos - 1)
            wire, value = key & 7, buf[pos]
            pos += 1
            if value >= 0x80:
                value, pos = read_varint(buf, pos - 1)
            if wire == 2:
                value, pos = buf[pos:pos + value], pos + value
            elif wire != 0:
                raise _invalid(f"unexpected wire type {wire}")
            out.append((key >> 3, value))
    except IndexError:
        raise _invalid("truncated message") from None
    if pos != end:
        raise _invalid("truncated message")
    return out




def _only(fields, allowed: set[int], what: str) -> None:
    for num, _ in fields:
        if num not in allowed:
            raise Refused(code_pb2.UNIMPLEMENTED, f"{what} field {num} is not handled by the "
                                                  f"in-memory switch")


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
        def sig(fields):
            return tuple(sorted((f.id, f.name, f.bitwidth) for f in fields))
        self.names = {t.preamble.id: t.preamble.name for t in p4info.tables}
        self.names.update({a.preamble.id: a.preamble.name for a in p4info.actions})
        self.sizes = {t.preamble.id: t.size for t in p4info.tables}
        self.params = {a.preamble.id: {p.id: p.name for p in a.params} for a in p4info.actions}
        self._sig = {t.preamble.id: sig(t.match_fields) for t in p4info.tables}
        self._sig.update({a.preamble.id: sig(a.params) for a in p4info.actions})
        self._exact = {t.preamble.id: all(f.match_type == f.EXACT for f in t.match_fields)
                       for t in p4info.tables}
        self._allowed = {t.preamble.id: {r.id: r.scope != r.DEFAULT_ONLY for r in t.action_refs}
                         for t in p4info.tables}
        self._cache: dict = {}

    def check(self, entity: bytes, with_action: bool) -> tuple[int, Key, Action | None]:
        """(table id, key, action) of a serialized Entity; Refused when invalid.
        ``with_action``: the update needs one (INSERT, MODIFY)."""
        got = self._cache.get(entity)
        if got is None:
            if len(self._cache) > 1 << 18:
                self._cache.clear()
            got = self._cache[entity] = self._decode(entity)
        if with_action and got[2] is None:
            raise _invalid(f"table {self.names[got[0]]}: an entry without action")
        return got

    def _cached(self, key: tuple, make):
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = make()
        return got

    def _decode(self, entity: bytes) -> tuple:
        fields = _fields(entity)
        _only(fields, {_N["entity.table_entry"]}, "Entity")
        if not fields:
            raise _invalid("an empty Entity")
        te = _fields(fields[0][1])
        _only(te, {_N["table.id"], _N["table.match"], _N["table.action"]}, "TableEntry")
        table_id = next((v for n, v in te if n == _N["table.id"]), 0)
        if table_id not in self._exact:
            raise _invalid(f"invalid P4 id: no table {table_id}")
        if not self._exact[table_id]:
            raise Refused(code_pb2.UNIMPLEMENTED, f"table {self.names[table_id]}: only exact "
                                                  f"matches are handled by the in-memory switch")
        matches = tuple(v for n, v in te if n == _N["table.match"])
        key = self._cached((self._sig[table_id], matches), lambda: self._values(
            table_id, "match field", [_id_value(v, _N["match.id"], _N["match.exact"],
                                                _N["exact.value"]) for v in matches]))
        actions = [v for n, v in te if n == _N["table.action"]]
        action = self._cached((table_id, actions[-1]), lambda: self._action(
            table_id, actions[-1])) if actions else None
        return table_id, key, action

    def _action(self, table_id: int, table_action: bytes) -> Action:
        outer = _fields(table_action)
        _only(outer, {_N["table_action.action"]}, "TableAction")
        fields = _fields(outer[0][1]) if outer else []
        _only(fields, {_N["action.id"], _N["action.params"]}, "Action")
        action_id = next((v for n, v in fields if n == _N["action.id"]), 0)
        if action_id not in self.params:
            raise _invalid(f"invalid P4 id: no action {action_id}")
        allowed = self._allowed[table_id].get(action_id)
        if not allowed:     # BMv2: PERMISSION_DENIED for a @defaultonly action
            raise Refused(code_pb2.INVALID_ARGUMENT if allowed is None else
                          code_pb2.PERMISSION_DENIED, f"table {self.names[table_id]} cannot "
                          f"hold action {self.names[action_id]} in an entry")
        params = tuple(v for n, v in fields if n == _N["action.params"])
        return action_id, self._cached((self._sig[action_id], params), lambda: self._values(
            action_id, "parameter", [_id_value(v, _N["param.id"], None, _N["param.value"])
                                     for v in params]))

    def _values(self, owner_id: int, kind: str, given) -> tuple:
        """Every P4Info field given once and within its bit width, as sorted (id, int)."""
        owner = self.names[owner_id]
        widths = {i: (name, bits) for i, name, bits in self._sig[owner_id]}
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
