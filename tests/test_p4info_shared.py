"""The TNA and v1model programs agree on every table, action, parameter and counter that the
controller uses by shared name (controller/program.py), as their committed P4Infos say: key
names, widths and match kinds, the tables' actions, parameter names and widths, counter sizes.
Runs everywhere; the comparison needs the committed Tofino P4Info."""
from __future__ import annotations

import pytest
from p4.config.v1 import p4info_pb2

from thc.controller import program, targets
from tests.test_target_writes import committed_p4info


def _by_short(objs) -> dict[str, list]:
    out: dict[str, list] = {}
    for o in objs:
        out.setdefault(program.short_name(o.preamble.name), []).append(o)
    return out


def _one(found: dict[str, list], name: str):
    objs = found.get(name, [])
    if len(objs) != 1:
        return "missing" if not objs else f"ambiguous: {[o.preamble.name for o in objs]}"
    return objs[0]


def interface(p4info: p4info_pb2.P4Info) -> dict[str, object]:
    """What the controller relies on, by short name: each shared table's keys and listed
    actions (with their scope), each such action's parameters, each shared counter's size."""
    tables, actions = _by_short(p4info.tables), _by_short(p4info.actions)
    counters = _by_short(p4info.counters)
    action_names = {a.preamble.id: program.short_name(a.preamble.name) for a in p4info.actions}
    out: dict[str, object] = {}
    for name, wanted in program.TABLE_ACTIONS.items():
        t = _one(tables, name)
        if isinstance(t, str):
            out[f"table {name}"] = t
            continue
        refs = {action_names.get(r.id): p4info_pb2.ActionRef.Scope.Name(r.scope)
                for r in t.action_refs}
        out[f"table {name} keys"] = [
            (f.name, f.bitwidth, p4info_pb2.MatchField.MatchType.Name(f.match_type))
            for f in t.match_fields]
        for a in wanted:
            out[f"table {name} action {a}"] = refs.get(a, "missing")
            act = _one(actions, a)
            out[f"action {a}"] = act if isinstance(act, str) else \
                [(p.name, p.bitwidth) for p in act.params]
    for name in program.COUNTERS:
        c = _one(counters, name)
        out[f"counter {name}"] = c if isinstance(c, str) else \
            (c.size, p4info_pb2.CounterSpec.Unit.Name(c.spec.unit))
    return out


def differences(a: p4info_pb2.P4Info, b: p4info_pb2.P4Info) -> list[str]:
    ia, ib = interface(a), interface(b)
    return [f"{key}: {ia.get(key, 'missing')} vs {ib.get(key, 'missing')}"
            for key in sorted(set(ia) | set(ib)) if ia.get(key) != ib.get(key)]


def test_the_v1model_program_has_everything_the_controller_names():
    found = interface(committed_p4info(targets.get("bmv2")))
    assert [k for k, v in found.items() if isinstance(v, str) and
            (v == "missing" or v.startswith("ambiguous"))] == []


def test_tna_and_v1model_programs_agree_on_shared_names():
    bmv2 = committed_p4info(targets.get("bmv2"))
    tofino = committed_p4info(targets.get("tofino"))
    assert differences(bmv2, tofino) == []


def _mutated(change) -> p4info_pb2.P4Info:
    info = p4info_pb2.P4Info()
    info.CopyFrom(committed_p4info(targets.get("bmv2")))
    change(info)
    return info


def _named(objs, short: str):
    return next(o for o in objs if program.short_name(o.preamble.name) == short)


def _add_ambiguous(info):
    info.tables.add().CopyFrom(_named(info.tables, program.JOB_TABLE))
    info.tables[-1].preamble.name = "ThcEgress.thc_job"


@pytest.mark.parametrize("change, key", [
    (lambda i: setattr(_named(i.actions, "set_job").params[2], "name", "base"),
     "action set_job"),
    (lambda i: setattr(_named(i.actions, "set_worker").params[0], "bitwidth", 16),
     "action set_worker"),
    (lambda i: setattr(_named(i.tables, "thc_worker").match_fields[2], "bitwidth", 31),
     "table thc_worker keys"),
    (lambda i: setattr(_named(i.tables, "thc_worker_addr").match_fields[1], "name", "wid"),
     "table thc_worker_addr keys"),
    (lambda i: setattr(_named(i.tables, "l2_forward").match_fields[0], "match_type",
                       p4info_pb2.MatchField.TERNARY), "table l2_forward keys"),
    (lambda i: setattr(_named(i.actions, "l2_set_port").preamble, "name", "ThcIngress.port"),
     "action l2_set_port"),
    (lambda i: _named(i.tables, "thc_dscp").action_refs.pop(), "table thc_dscp action"),
    (lambda i: setattr(_named(i.counters, "thc_resets"), "size", 8), "counter thc_resets"),
    (_add_ambiguous, "table thc_job"),
])
def test_a_differing_name_or_width_is_found(change, key):
    diffs = differences(committed_p4info(targets.get("bmv2")), _mutated(change))
    assert any(d.startswith(key) for d in diffs), diffs
