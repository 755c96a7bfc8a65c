"""Controller pieces that need no switch: frames, value encoding, entries from the P4Info."""
from __future__ import annotations

import time

import numpy as np
import pytest

from controller import jobs
from controller.frames import parse_udp_frame, reset_frame, udp_frame
from controller.switch import Switch, SwitchError, encode_value
from host.wire import protocol as P
from host.wire.jobs import ConfigError, Job, Worker


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
    assert len(lut) == P.LANES // jobs.GROUP_LANES * jobs.GROUP_BYTES * 256
    e = jobs.job_entry(sw, job, 3, epoch=0xDEADBEEF)
    assert sw.param_values(e) == {"job_index": 3, "n_workers": 3, "pool_base": 0,
                                  "pool_size": job.pool_size, "full_bitmap": 7,
                                  "mcast_grp": 5, "sum_bits": 8, "epoch": 0xDEADBEEF}
    with pytest.raises(ConfigError, match="epoch"):
        jobs.job_entry(sw, job, 3, epoch=0)
    (w0,) = jobs.worker_entries(sw, job)[:1]
    assert sw.param_values(w0) == {"worker_bit": 1}
    with pytest.raises(SwitchError, match="no table"):
        sw.table_entry("thc_nonexistent", {})
    with pytest.raises(SwitchError, match="takes"):
        sw.table_entry("thc_job", {"job_id": 1}, "set_job", {"job_index": 1})


@pytest.mark.parametrize("n_workers", [3, 32])
def test_lookup_values_add_as_packed_words_into_result_lanes(n_workers):
    """What a lane group does with the controller's lookup values (byte -> two lanes' table
    values, placed in a 32-bit word), summed over workers as 32-bit words, must read back
    as the RESULT payload: every lane's exact sum, big-endian, in the job's width."""
    job = Job(job_id=9, workers=tuple(Worker(i, f"10.0.0.{i + 1}", 4000 + i)
                                      for i in range(n_workers)),
              table=(0, 1, 2, 4, 6, 8, 11, 14, 16, 19, 22, 24, 26, 28, 29, 30),
              granularity=30).validate()
    assert job.sum_bits == (8 if n_workers * 30 <= 255 else 16)
    values = np.array(jobs.lut_values(job), dtype=np.uint64)
    rng = np.random.default_rng(n_workers)
    idx = rng.integers(0, 16, (n_workers, P.LANES))
    idx[0] = 15                                  # the largest table value in every lane
    data = (idx[:, 0::2] << 4 | idx[:, 1::2]).reshape(n_workers, -1, jobs.GROUP_BYTES)
    per_byte = values[np.arange(jobs.GROUP_BYTES), data]          # worker, group, byte
    if job.sum_bits == 8:
        words = np.stack([per_byte[..., 0] | per_byte[..., 1],
                          per_byte[..., 2] | per_byte[..., 3]], axis=-1)
    else:
        words = per_byte
    total = words.sum(axis=0) % (1 << 32)
    assert total.max() < 1 << 32
    payload = total.astype(">u4").tobytes()
    assert len(payload) == P.payload_bytes(P.PktType.RESULT, P.LANES, job.sum_bits)
    sums = np.frombuffer(payload, P.sum_dtype(job.sum_bits))
    np.testing.assert_array_equal(sums, np.asarray(job.table)[idx].sum(axis=0))
