"""The in-memory switch (controller/testing/memswitch.py) refuses what BMv2's P4Runtime server
refuses, reads back what was written, and runs RESET as p4src/thc.p4 does: tests of the
controller's safety on it (tests/test_jobs_safety.py) mean something only if it does."""
from __future__ import annotations

import pytest

from thc.controller import counters, installed, job_entries, p4rt
from thc.controller.frames import reset_frame, udp_frame
from thc.controller.switch import SwitchError
from thc.controller.targets import tofino
from thc.controller.testing.memswitch import MemorySwitch
from thc.wire import protocol as P
from thc.wire.jobs import SWITCH_AGG_IP, SWITCH_AGG_MAC


@pytest.fixture
def sw():
    s = MemorySwitch().connect()
    yield s
    s.close()


def ids(sw, table: str, action: str | None = None):
    t = sw.tables.get(table, "table")
    fields = {f.name: f.id for f in t.match_fields}
    if action is None:
        return t.preamble.id, fields
    a = sw.actions.get(action, "action")
    return t.preamble.id, fields, a.preamble.id, {p.name: p.id for p in a.params}


def raw_job_entry(sw, job_id: int, **params) -> bytes:
    """A thc_job entry written without the client's checks (values as given)."""
    tid, fields, aid, pids = ids(sw, "thc_job", "set_job")
    values = {name: 1 for name in pids} | params
    return p4rt.exact_entity(tid, [(fields["job_id"], p4rt.canonical_bytes(job_id))], aid,
                             sorted((pids[n], p4rt.canonical_bytes(v)) for n, v in values.items()))


def test_unknown_names_are_refused_by_the_client(sw):
    with pytest.raises(SwitchError, match="no table 'thc_nope'"):
        sw.table_entry("thc_nope", {"job_id": 1})
    with pytest.raises(SwitchError, match="no counter 'nope'"):
        sw.read_counter("nope")
    with pytest.raises(SwitchError, match="takes"):
        sw.table_entry("thc_job", {"job_id": 1}, "set_job", {"job_index": 0})


def _job_table(sw) -> int:
    return ids(sw, "thc_job")[0]


def _action(sw, name: str) -> int:
    return sw.actions.get(name, "action").preamble.id


BAD = "INVALID_ARGUMENT"
BAD_UPDATES = {     # case: (entity, code, message), as BMv2 answers (tests/bmv2 compares)
    "unknown_table": (lambda sw: p4rt.exact_entity(999, [(1, b"\x01")]), BAD, "no table 999"),
    "param_too_wide": (lambda sw: raw_job_entry(sw, 1, sum_bits=256), BAD,
                       "sum_bits = 256 does not fit within 8"),
    "match_too_wide": (lambda sw: raw_job_entry(sw, 1 << 16), BAD, "job_id = 65536 does not fit"),
    "match_missing": (lambda sw: p4rt.exact_entity(_job_table(sw), [], _action(sw, "set_job"),
                                                   []), BAD, "match fields \\['job_id'\\] missing"),
    "foreign_action": (lambda sw: p4rt.exact_entity(_job_table(sw), [(1, b"\x01")],
                                                    _action(sw, "set_worker"), [(1, b"\x01")]),
                       BAD, "cannot hold action"),
    "default_only_action": (lambda sw: p4rt.exact_entity(_job_table(sw), [(1, b"\x01")],
                                                         _action(sw, "NoAction"), []),
                            "PERMISSION_DENIED", "cannot hold action"),
    "no_action": (lambda sw: p4rt.exact_entity(_job_table(sw), [(1, b"\x01")]), BAD,
                  "without action"),
}


@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_invalid_updates_are_refused_and_change_nothing(sw, case):
    entity, code, why = BAD_UPDATES[case]
    with pytest.raises(SwitchError, match=f"{code} .*{why}"):
        sw.write_entries("INSERT", [entity(sw)])
    assert sw.device.log == [] and installed.installed_jobs(sw) == {}


def test_inserts_modifies_and_deletes_follow_p4runtime(sw):
    first, again = raw_job_entry(sw, 1), raw_job_entry(sw, 1, epoch=7)
    assert sw.write_entries("INSERT", [first]) == []
    with pytest.raises(SwitchError, match="ALREADY_EXISTS"):
        sw.write_entries("INSERT", [again])
    assert sw.write_entries("INSERT", [again], ignore=["ALREADY_EXISTS"]) == [again]
    sw.write_entries("MODIFY", [again])
    assert installed.installed_jobs(sw)[1]["epoch"] == 7
    (read,) = sw.read_table("thc_job")
    assert installed.canonical(read) == again, "read back as written, canonical bytes"
    sw.write_entries("DELETE", [read])
    with pytest.raises(SwitchError, match="NOT_FOUND"):
        sw.write_entries("DELETE", [read])
    with pytest.raises(SwitchError, match="NOT_FOUND"):
        sw.write_entries("MODIFY", [again])
    sw.write_entries("INSERT", [raw_job_entry(sw, j) for j in range(P.MAX_JOBS)])
    with pytest.raises(SwitchError, match="UNKNOWN 'Error when adding match entry to target"):
        sw.write_entries("INSERT", [raw_job_entry(sw, P.MAX_JOBS)])


def test_reset_runs_as_the_program_runs_it(sw):
    sw.write_entries("INSERT", [raw_job_entry(sw, 5, job_index=3, pool_size=4, epoch=9),
                                job_entries.install_entry(sw, 5, 9)])
    sw.packet_out([reset_frame(5, 3, SWITCH_AGG_MAC, SWITCH_AGG_IP, 1, 9),
                   reset_frame(5, 2, SWITCH_AGG_MAC, SWITCH_AGG_IP, 1, 8),  # another install's
                   reset_frame(5, 4, SWITCH_AGG_MAC, SWITCH_AGG_IP, 0, 9),  # outside the pool
                   reset_frame(6, 0, SWITCH_AGG_MAC, SWITCH_AGG_IP, 0, 9)])  # no such job
    assert sw.device.slot_resets == [(5, 3, 1)]
    assert counters.resets(sw, 3) == 1 and counters.resets(sw, 0) == 0
    drops = counters.drops(sw)
    assert drops["slot_outside_pool"] == drops["unknown_job"] == drops["stale_reset"] == 1
    assert [e.op for e in sw.device.log] == ["INSERT"] * 2 + ["PACKET_OUT"] * 4
    with pytest.raises(NotImplementedError, match="RESET packet-outs only"):
        sw.packet_out([udp_frame(SWITCH_AGG_MAC, SWITCH_AGG_MAC, SWITCH_AGG_IP, SWITCH_AGG_IP,
                                 P.UDP_PORT, P.UDP_PORT, bytes(P.HEADER_BYTES))])


def bad_resets(job_id: int, other_job: int, mac: str, ip: str) -> list[bytes]:
    """RESETs that p4src/thc.p4 drops: with a payload (for ``job_id``, then for
    ``other_job``, not installed), a header cut short, a slot version beyond 1, and one of
    no install of ``job_id`` (epoch 0: an install's epoch is never 0)."""
    def frame(payload: bytes) -> bytes:
        return udp_frame(mac, mac, ip, ip, P.UDP_PORT, P.UDP_PORT, payload)
    hdr = P.Header(P.PktType.RESET, 0, job_id, 1, 0, 0, 0, 0, 0).pack()
    return [frame(hdr + bytes(2)),
            frame(P.Header(P.PktType.RESET, 0, other_job, 1, 0, 0, 0, 0, 0).pack() + bytes(2)),
            frame(hdr[:20]),
            frame(P.Header(P.PktType.RESET, 0, job_id, 1, 2, 0, 0, 0, 0).pack()),
            frame(P.Header(P.PktType.RESET, 0, job_id, 1, 0, 0, 0, 0, 0).pack())]


BAD_RESET_DROPS = {"bad_lanes": 1, "unknown_job": 1, "malformed": 2, "stale_reset": 1}
"""What :func:`bad_resets` leaves in the drop counters, in the program's order of checks:
the header, the job, the payload's length, the install."""


def test_bad_resets_are_dropped_where_the_program_drops_them(sw):
    sw.write_entries("INSERT", [raw_job_entry(sw, 5, job_index=3, pool_size=4)])
    sw.packet_out(bad_resets(5, 6, SWITCH_AGG_MAC, SWITCH_AGG_IP))
    assert sw.device.slot_resets == []
    assert {k: v for k, v in counters.drops(sw).items() if v} == BAD_RESET_DROPS


def test_a_new_session_sees_the_device_and_a_push_clears_it(sw):
    sw.write_entries("INSERT", [raw_job_entry(sw, 1)])
    sw.set_multicast_group(1, [(0, 1)])
    again = MemorySwitch(device=sw.device).connect(program=None)
    assert set(installed.installed_jobs(again)) == {1} and again.multicast_groups() == {1: {(0, 1)}}
    again.connect(program="thc")
    assert installed.installed_jobs(sw) == {} and sw.multicast_groups() == {}
    with pytest.raises(SwitchError, match="no P4 program"):
        MemorySwitch().connect(program=None)


def test_a_closed_session_cannot_write(sw):
    sw.close()
    with pytest.raises(SwitchError, match="not connected"):
        sw.write_entries("INSERT", [raw_job_entry(sw, 1)])


def test_counters_report_the_results_a_tofino_withheld():
    """thc_lost_passes (the Tofino program's egress: RESULT copies withheld for a lost pass)
    is in the snapshot where the program has it, and not for BMv2's."""
    sw = MemorySwitch().connect("thc_tna", tofino.TARGET.build_dir)
    assert counters.snapshot(sw)["lost_passes"] == 0
    sw.device._count(counters.LOST_PASSES, 0, 3)
    assert counters.snapshot(sw)["lost_passes"] == 3
    assert "lost_passes" not in counters.snapshot(MemorySwitch().connect())
