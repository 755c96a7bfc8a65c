"""``Switch.set_multicast_group``'s writes on each target, p4runtime-shell's group entry
recorded (no switch): BMv2 keeps a group's replicas across a push, so a group P4Runtime
does not know is cleared (inserted empty, deleted) before its insert there, and one held
empty (a clearing cut short) is deleted first; a Tofino's groups are written as they are.
tests/bmv2/test_switch_safety.py shows the BMv2 case on the wire."""
from __future__ import annotations

import pytest

from thc.controller import targets
from thc.controller.switch import Switch


class _Entry:
    """p4runtime-shell's MulticastGroupEntry, its writes appended to ``log``."""
    log: list = []

    def __init__(self, group):
        self.group, self.replicas = group, []

    def add(self, port, instance):
        self.replicas.append((port, instance))

    def _write(self, op):
        self.log.append((op, self.group, tuple(self.replicas)))

    def insert(self):
        self._write("insert")

    def modify(self):
        self._write("modify")

    def delete(self):
        self._write("delete")


@pytest.mark.parametrize("target,held,writes", [
    ("bmv2", {}, [("insert", 5, ()), ("delete", 5, ()), ("insert", 5, ((1, 1),))]),
    ("bmv2", {5: set()}, [("delete", 5, ()), ("insert", 5, ()), ("delete", 5, ()),
                          ("insert", 5, ((1, 1),))]),
    ("bmv2", {5: {(2, 1)}}, [("modify", 5, ((1, 1),))]),
    ("tofino", {}, [("insert", 5, ((1, 1),))]),
    ("tofino", {5: set()}, [("modify", 5, ((1, 1),))]),
    (None, {}, [("insert", 5, ((1, 1),))])])
def test_a_group_is_written_as_its_target_needs(monkeypatch, target, held, writes):
    from p4runtime_sh import shell as sh
    monkeypatch.setattr(sh, "MulticastGroupEntry", _Entry)
    monkeypatch.setattr(_Entry, "log", [])
    sw = Switch()
    sw.target = targets.get(target) if target else None
    monkeypatch.setattr(sw, "_require", lambda: sw)
    monkeypatch.setattr(sw, "multicast_groups", lambda: held)
    sw.set_multicast_group(5, [(1, 1)])
    assert _Entry.log == writes
