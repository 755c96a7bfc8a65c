"""Controller pieces that need no switch: frames, value encoding, entries from the P4Info."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from p4.v1 import p4runtime_pb2

from thc.controller import job_checks, job_entries, p4rt
from thc.controller.targets import bmv2 as bmv2_target
from thc.controller.frames import parse_udp_frame, reset_frame, udp_frame
from thc.controller.switch import Switch, SwitchError, encode_value
from thc.wire import protocol as P
from thc.wire.jobs import ConfigError, Job, Worker


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


def test_entries_equal_p4runtime_shells_table_entry():
    """Switch.table_entry builds from P4Info ids (fast); the message is the one
    p4runtime-shell's TableEntry entity gives for the same names and values."""
    from p4runtime_sh import shell as sh
    from p4runtime_sh.global_options import global_options
    sw = Switch.offline()
    sh.context.set_p4info(sw.p4info)
    global_options["verbose"] = False
    params = {"worker_mac": "02:00:00:00:00:01", "worker_ip": "10.0.0.1",
              "worker_port": 20001, "agg_mac": "02:00:00:00:00:fe", "agg_ip": "10.0.0.254"}
    ref = sh.TableEntry("thc_worker_addr")(action="set_worker_addr")
    ref.match["job_id"], ref.match["worker_id"] = "300", "0"
    for k, v in params.items():
        ref.action[k] = str(v)
    ours = sw.table_entry("thc_worker_addr", {"job_id": 300, "worker_id": 0},
                          "set_worker_addr", params)
    assert ours == ref.msg()
    blob = sw.entry_bytes("thc_worker_addr", {"job_id": 300, "worker_id": 0},
                          "set_worker_addr", params)
    assert blob == p4runtime_pb2.Entity(table_entry=ref.msg()).SerializeToString()


def test_serialized_entries_equal_protobufs_for_every_table():
    """entry_bytes writes bytes without messages (controller/p4rt.py): byte for byte what
    protobuf serialises, for every table and action of the program, at random values."""
    import random
    rnd = random.Random(1)
    sw = Switch.offline()
    actions = {a.preamble.id: a for a in sw.p4info.actions}
    for t in sw.p4info.tables:
        match = {f.name: rnd.getrandbits(f.bitwidth) for f in t.match_fields}
        for ref in t.action_refs:
            a = actions[ref.id]
            params = {p.name: rnd.getrandbits(p.bitwidth) for p in a.params}
            want = p4runtime_pb2.Entity(table_entry=sw.table_entry(
                t.preamble.name, match, a.preamble.name, params)).SerializeToString()
            blob = sw.entry_bytes(t.preamble.name, match, a.preamble.name, params)
            assert blob == want
            assert p4rt.entity_table_id(blob) == t.preamble.id
        key = p4runtime_pb2.Entity(table_entry=sw.table_entry(t.preamble.name, match))
        assert sw.entry_bytes(t.preamble.name, match) == key.SerializeToString()


def _job(job_id=5, n=3, **kw) -> Job:
    workers = tuple(Worker(i, f"10.0.{job_id}.{i + 1}", 4000 + i,
                           f"02:00:00:00:{job_id:02x}:{i + 1:02x}", i) for i in range(n))
    return Job(job_id=job_id, workers=workers, table=tuple(range(16)), granularity=30, **kw)


def test_job_entries_from_the_committed_p4info():
    sw = Switch.offline()
    assert sw.lanes == P.LANES
    job = _job().validate()
    lut = job_entries.lut_entries(sw, job, 3)
    assert len(lut) == P.LANES // bmv2_target.GROUP_LANES * bmv2_target.GROUP_BYTES * 256
    e = job_entries.job_entry(sw, job, 3, epoch=0xDEADBEEF)
    assert sw.param_values(e) == {"job_index": 3, "n_workers": 3, "pool_base": 0,
                                  "pool_size": job.pool_size, "full_bitmap": 7,
                                  "mcast_grp": 5, "sum_bits": 8, "epoch": 0xDEADBEEF,
                                  "aggregation": P.AGGREGATIONS["thc"]}
    vote = Job.vote(6, _job(6).workers).validate()
    assert sw.param_values(job_entries.job_entry(sw, vote, 4, epoch=1))["aggregation"] == \
        P.AGGREGATIONS["vote"]
    # the vote job's lookup entries count a sign bit: index 1 -> 1, every other -> 0
    values = bmv2_target.lut_values(vote)
    assert values[0][0x10] == 1 << 24 and values[0][0x22] == 0
    with pytest.raises(ConfigError, match="epoch"):
        job_entries.job_entry(sw, job, 3, epoch=0)
    (w0,) = job_entries.worker_entries(sw, job)[:1]
    assert sw.param_values(w0) == {"worker_bit": 1}
    with pytest.raises(SwitchError, match="no table"):
        sw.table_entry("thc_nonexistent", {})
    with pytest.raises(SwitchError, match="takes"):
        sw.table_entry("thc_job", {"job_id": 1}, "set_job", {"job_index": 1})


# -- bad control input is refused before any write (check_job runs first) ----------------

def _others(*jobs_at):
    return {j.job_id: job_checks.config_of(j, idx) for j, idx in jobs_at}


def test_workers_colliding_on_address_across_jobs_are_refused():
    sw = Switch.offline()
    a = _job(5, pool_base=0, pool_size=8)
    w = a.workers[1]
    clash_port = _job(6, pool_base=8, pool_size=8)
    clash_port = dataclasses.replace(clash_port, workers=(clash_port.workers[0],
        dataclasses.replace(clash_port.workers[1], ip=w.ip, port=w.port)))
    with pytest.raises(ConfigError, match=rf"{w.ip}:{w.port} is used by a worker of job 5"):
        job_checks.check_job(sw, clash_port, 1, _others((a, 0)))
    other_host = dataclasses.replace(_job(6, pool_base=8, pool_size=8), workers=(
        dataclasses.replace(_job(6).workers[0], mac=w.mac),))
    with pytest.raises(ConfigError, match=f"MAC {w.mac} belongs to {w.ip}"):
        job_checks.check_job(sw, other_host, 1, _others((a, 0)))
    moved = dataclasses.replace(other_host, workers=(dataclasses.replace(
        other_host.workers[0], ip=w.ip, switch_port=w.switch_port + 1),))
    with pytest.raises(ConfigError, match="switch port"):
        job_checks.check_job(sw, moved, 1, _others((a, 0)))
    same_host = dataclasses.replace(moved, workers=(dataclasses.replace(
        moved.workers[0], switch_port=w.switch_port),))
    job_checks.check_job(sw, same_host, 1, _others((a, 0)))   # one host in two jobs: allowed


def test_index_group_and_pool_collisions_are_refused():
    sw = Switch.offline()
    a = _job(5, pool_base=0, pool_size=8)
    b = _job(6, pool_base=4, pool_size=8)
    with pytest.raises(ConfigError, match="overlaps job 5"):
        job_checks.check_job(sw, b, 1, _others((a, 0)))
    with pytest.raises(ConfigError, match="index 0 is taken by job 5"):
        job_checks.check_job(sw, dataclasses.replace(b, pool_base=8), 0, _others((a, 0)))
    with pytest.raises(ConfigError, match="multicast group 5 is taken"):
        job_checks.check_job(sw, dataclasses.replace(b, pool_base=8, mcast_grp=5), 1,
                       _others((a, 0)))


def test_table_value_above_granularity_is_refused():
    sw = Switch.offline()
    job = dataclasses.replace(_job(), table=tuple(range(15)) + (31,))
    with pytest.raises(ConfigError, match=r"table values must lie in 0\.\.30"):
        job_checks.check_job(sw, job, 0, {})


def test_sums_that_overflow_even_16_bits_are_refused():
    sw = Switch.offline()
    job = dataclasses.replace(_job(n=3), granularity=30000)
    assert job.n_workers * job.granularity > 0xFFFF
    with pytest.raises(ConfigError, match="overflows"):
        job_checks.check_job(sw, job, 0, {})


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
    values = np.array(bmv2_target.lut_values(job), dtype=np.uint64)
    rng = np.random.default_rng(n_workers)
    idx = rng.integers(0, 16, (n_workers, P.LANES))
    idx[0] = 15                                  # the largest table value in every lane
    data = (idx[:, 0::2] << 4 | idx[:, 1::2]).reshape(n_workers, -1, bmv2_target.GROUP_BYTES)
    per_byte = values[np.arange(bmv2_target.GROUP_BYTES), data]          # worker, group, byte
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
