"""Controller pieces that need no switch: frames, value encoding, entries from the P4Info."""
from __future__ import annotations

import time

import pytest

from controller import jobs
from controller.frames import parse_udp_frame, reset_frame, udp_frame
from controller.switch import Switch, SwitchError, encode_value
from host.wire import protocol as P
from host.wire.jobs import Job, Worker


def test_encode_value_is_canonical():
    assert encode_value(0, 16) == b"\x00"
    assert encode_value(0x1234, 16) == b"\x12\x34"
    assert encode_value("10.0.0.1", 32) == bytes([10, 0, 0, 1])
    assert encode_value("02:00:00:00:00:fe", 48) == bytes([2, 0, 0, 0, 0, 0xFE])
    with pytest.raises(SwitchError):
        encode_value(16, 4)


def test_frames_round_trip():
    f = udp_frame("02:00:00:00:00:01", "02:00:00:00:00:02", "10.0.0.1", "10.0.0.2", 1, 2, b"xyz")
    assert parse_udp_frame(f) == ("02:00:00:00:00:01", "02:00:00:00:00:02", "10.0.0.1",
                                  "10.0.0.2", 1, 2, b"xyz")
    assert parse_udp_frame(f + bytes(10))[6] == b"xyz", "Ethernet padding is cut"
    r = parse_udp_frame(reset_frame(7, 3, "02:00:00:00:00:fe", "10.0.0.254"))
    hdr = P.Header.unpack(r[6])
    assert (hdr.pkt_type, hdr.job_id, hdr.slot, r[5]) == (P.PktType.RESET, 7, 3, P.UDP_PORT)


def test_hand_encoded_entries_equal_protobuf():
    from p4.v1 import p4runtime_pb2
    sw = Switch.offline()
    blob = sw.entry_bytes("thc_worker_addr", {"job_id": 300, "worker_id": 0},
                          "set_worker_addr", {"worker_mac": "02:00:00:00:00:01",
                                              "worker_ip": "10.0.0.1", "worker_port": 20001,
                                              "agg_mac": "02:00:00:00:00:fe",
                                              "agg_ip": "10.0.0.254"})
    t = sw.tables.get("thc_worker_addr", "table")
    a = sw.actions.get("set_worker_addr", "action")
    ref = p4runtime_pb2.Entity()
    te = ref.table_entry
    te.table_id = t.preamble.id
    te.match.add(field_id=t.match_fields[0].id).exact.value = (300).to_bytes(2, "big")
    te.match.add(field_id=t.match_fields[1].id).exact.value = b"\x00"
    te.action.action.action_id = a.preamble.id
    for p, v in zip(a.params, [bytes([2, 0, 0, 0, 0, 1]), bytes([10, 0, 0, 1]),
                               (20001).to_bytes(2, "big"), bytes([2, 0, 0, 0, 0, 0xFE]),
                               bytes([10, 0, 0, 254])]):
        te.action.action.params.add(param_id=p.id, value=v)
    assert p4runtime_pb2.Entity.FromString(blob) == ref
    assert blob == ref.SerializeToString()


def test_job_entries_from_the_committed_p4info_are_fast():
    sw = Switch.offline()
    assert sw.lanes == P.LANES
    job = Job(job_id=5, workers=tuple(Worker(i, f"10.0.0.{i + 1}", 4000 + i,
                                             f"02:00:00:00:00:{i + 1:02x}", i)
                                      for i in range(3)),
              table=tuple(range(16)), granularity=30).validate()
    t0 = time.perf_counter()
    lut = jobs.lut_entries(sw, job)
    assert time.perf_counter() - t0 < 1.0
    assert len(lut) == P.LANES * 16
    e = jobs.job_entry(sw, job, 3)
    assert sw.param_values(e) == {"job_index": 3, "n_workers": 3, "pool_base": 0,
                                  "pool_size": job.pool_size, "full_bitmap": 7,
                                  "mcast_grp": 5}
    (w0,) = jobs.worker_entries(sw, job)[:1]
    assert sw.param_values(w0) == {"worker_bit": 1}
    with pytest.raises(SwitchError, match="no table"):
        sw.table_entry("thc_nonexistent", {})
    with pytest.raises(SwitchError, match="takes"):
        sw.table_entry("thc_job", {"job_id": 1}, "set_job", {"job_index": 1})
