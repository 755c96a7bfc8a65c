"""Every write the controller makes for a job, on each target, checked against that target's
committed P4Info: runs everywhere, without p4c, BMv2 or a switch.

A cluster of an 8-bit THC job, a vote job and a 16-bit job is installed on the in-memory
switch (controller/testing/memswitch.py) loaded with the target's P4Info, then removed; every
table write, counter write, multicast group and packet-out is recorded as the controller
made it and checked here against the P4Info text file, decoded with protobuf (not with the
controller's own encoder or the in-memory switch's decoder): ids and names exist, every key
field and action parameter is present once and fits its width, the action is one the table
may hold. Of the lookup entries the controller serializes itself (32768 a job on BMv2)
protobuf decodes one in :data:`LOOKUP_STRIDE`, every table's among them: its pure-Python
decoder took about 40 s for all of them. The in-memory switch checks every write as BMv2's
P4Runtime server does (controller/testing/entry_checks.py, tests/test_memswitch.py), and
tests/bmv2/test_controller_offline.py checks that serializer byte for byte against protobuf.
Both targets run the whole cluster; a vote job with 16-bit counts is refused on the Tofino
before any write.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from google.protobuf import text_format
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2

from thc.controller import installed, job_entries, jobs, program, targets
from thc.controller.frames import parse_udp_frame, reset_frame
from thc.controller.targets import tofino
from thc.controller.testing.memswitch import MemoryDevice, MemorySwitch
from thc.wire import protocol as P
from thc.wire.jobs import SWITCH_AGG_IP, SWITCH_AGG_MAC, Cluster, ConfigError, Job, Worker

TABLE = (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)


def committed_p4info(target: targets.Target) -> p4info_pb2.P4Info:
    path = target.p4info_file
    if not path.exists():
        pytest.skip(f"{path} is not committed yet (p4c's Tofino back end writes it: "
                    f"--p4runtime-files with --p4runtime-force-std-externs)")
    info = p4info_pb2.P4Info()
    text_format.Merge(path.read_text(), info)
    return info


def _workers(job_id: int, n: int) -> tuple[Worker, ...]:
    """On ports 256-319: a Tofino's pipe 2, the CPU port's (BMv2 takes them too)."""
    return tuple(Worker(i, f"10.{job_id}.0.{i + 1}", 20000 + i,
                        f"02:00:00:00:{job_id:02x}:{i + 1:02x}", 256 + (job_id * 11 + i) % 64)
                 for i in range(n))


def sample_cluster() -> Cluster:
    """An 8-bit THC job, a vote job and a 16-bit THC job (10 workers x granularity 30)."""
    thc8 = Job(job_id=5, workers=_workers(5, 3), table=TABLE, granularity=30, pool_size=8)
    vote = Job.vote(6, _workers(6, 4), pool_base=8, pool_size=4)
    thc16 = Job(job_id=7, workers=_workers(7, 10), table=TABLE, granularity=30, pool_base=12,
                pool_size=4)
    assert (thc8.sum_bits, vote.sum_bits, thc16.sum_bits) == (8, 8, 16)
    return Cluster(jobs=(thc8, vote, thc16), agg_ip=SWITCH_AGG_IP,
                   agg_mac=SWITCH_AGG_MAC).validate()


class Recording(MemorySwitch):
    """The in-memory switch, recording every write as the real Switch would send it."""

    def __init__(self, device: MemoryDevice):
        super().__init__(device=device)
        self.writes: list[tuple[str, bytes]] = []
        self.serialized: set[int] = set()
        """Indices of the writes the controller serialized itself (the lookup entries)."""
        self.groups: list[tuple[str, int, set]] = []
        self.packets: list[bytes] = []

    def write_entries(self, op, entities, ignore=()):
        ents = list(entities)
        for e in ents:
            if isinstance(e, p4runtime_pb2.TableEntry):
                e = p4runtime_pb2.Entity(table_entry=e)
            self.writes.append((op, e if isinstance(e, bytes) else e.SerializeToString()))
            if isinstance(e, bytes):
                self.serialized.add(len(self.writes) - 1)
        return super().write_entries(op, ents, ignore)

    def reset_counter(self, name, indices):
        indices = list(indices)
        self.writes += [("MODIFY", e.SerializeToString())
                        for e in self.counter_zeros(name, indices)]
        return super().reset_counter(name, indices)

    def set_multicast_group(self, group, replicas):
        replicas = set(replicas)
        self.groups.append(("SET", group, replicas))
        super().set_multicast_group(group, replicas)

    def delete_multicast_group(self, group):
        self.groups.append(("DELETE", group, set()))
        return super().delete_multicast_group(group)

    def packet_out(self, payloads):
        frames = list(payloads)
        self.packets += frames
        return super().packet_out(frames)


def recording_switch(target: targets.Target) -> Recording:
    committed_p4info(target)
    device = MemoryDevice(target.program, target.build_dir)
    return Recording(device).connect(program=None)


# ---- the checks ---------------------------------------------------------------------------

def _fits(value: bytes, width: int) -> str | None:
    """Why ``value`` is no canonical P4Runtime byte string of ``width`` bits, or None."""
    if not value:
        return "empty value"
    if len(value) > 1 and value[0] == 0:
        return f"value {value.hex()} is not canonical (leading zero byte)"
    if int.from_bytes(value, "big") >> width:
        return f"value 0x{value.hex()} does not fit {width} bits"
    return None


class WriteChecker:
    """Checks serialized p4runtime Entities against one P4Info."""

    def __init__(self, p4info: p4info_pb2.P4Info):
        self.tables = {t.preamble.id: t for t in p4info.tables}
        self.actions = {a.preamble.id: a for a in p4info.actions}
        self.counters = {c.preamble.id: c for c in p4info.counters}

    def problems(self, op: str, blob: bytes) -> list[str]:
        return self.check(op, blob)[1]

    def check(self, op: str, blob: bytes) -> tuple[str | None, list[str]]:
        """(the table or counter written, what is wrong with the write)."""
        ent = p4runtime_pb2.Entity.FromString(blob)
        kind = ent.WhichOneof("entity")
        if kind == "counter_entry":
            info = self.counters.get(ent.counter_entry.counter_id)
            return info and info.preamble.name, self._counter(op, ent.counter_entry)
        if kind != "table_entry":
            return None, [f"{op}: unexpected entity {kind}"]
        info = self.tables.get(ent.table_entry.table_id)
        return info and info.preamble.name, self._table(op, ent.table_entry)

    def _counter(self, op: str, c) -> list[str]:
        info = self.counters.get(c.counter_id)
        if info is None:
            return [f"{op}: no counter with id {c.counter_id}"]
        out = []
        if op != "MODIFY":
            out.append(f"{op} on counter {info.preamble.name}: counters are only modified")
        if not 0 <= c.index.index < info.size:
            out.append(f"counter {info.preamble.name}: index {c.index.index} outside "
                       f"0..{info.size - 1}")
        return out

    def _table(self, op: str, te) -> list[str]:
        table = self.tables.get(te.table_id)
        if table is None:
            return [f"{op}: no table with id {te.table_id}"]
        name, out = table.preamble.name, []
        fields = {f.id: f for f in table.match_fields}
        given = [m.field_id for m in te.match]
        if sorted(given) != sorted(fields):
            out.append(f"{name}: match fields {sorted(given)}, the table has {sorted(fields)}")
        for m in te.match:
            f = fields.get(m.field_id)
            if f is None:
                continue
            if m.WhichOneof("field_match_type") != "exact" or \
                    f.match_type != p4info_pb2.MatchField.EXACT:
                out.append(f"{name}.{f.name}: not an exact match")
                continue
            why = _fits(m.exact.value, f.bitwidth)
            if why:
                out.append(f"{name}.{f.name}: {why}")
        if op == "DELETE":
            return out
        if not te.HasField("action") or te.action.WhichOneof("type") != "action":
            return out + [f"{op} {name}: no action"]
        act = te.action.action
        info = self.actions.get(act.action_id)
        refs = {r.id: r for r in table.action_refs}
        if info is None:
            return out + [f"{name}: no action with id {act.action_id}"]
        aname = info.preamble.name
        if act.action_id not in refs:
            out.append(f"{name}: action {aname} is not one of the table's")
        elif refs[act.action_id].scope == p4info_pb2.ActionRef.DEFAULT_ONLY:
            out.append(f"{name}: action {aname} is default-only")
        params = {p.id: p for p in info.params}
        got = [p.param_id for p in act.params]
        if sorted(got) != sorted(params):
            out.append(f"{aname}: parameters {sorted(got)}, the action takes {sorted(params)}")
        for p in act.params:
            spec = params.get(p.param_id)
            why = spec is not None and _fits(p.value, spec.bitwidth)
            if why:
                out.append(f"{aname}({spec.name}): {why}")
        return out


def _width(p4info, kind: str, short: str, field: str) -> int:
    """The width of a key field (kind "table") or action parameter (kind "action")."""
    objs = p4info.tables if kind == "table" else p4info.actions
    for o in objs:
        if program.short_name(o.preamble.name) == short:
            for f in (o.match_fields if kind == "table" else o.params):
                if f.name == field:
                    return f.bitwidth
    raise AssertionError(f"the P4Info has no {kind} {short} with {field}")


def group_problems(p4info, job: Job, group: int, replicas: set) -> list[str]:
    """A job's multicast group: an id set_job can carry, one replica per worker on its port
    (fits l2_set_port's width) with instance worker_id + 1 (egress's worker_id, its width)."""
    out = []
    if not 0 < group < 1 << _width(p4info, "action", program.SET_JOB, "mcast_grp"):
        out.append(f"group {group} does not fit set_job's mcast_grp")
    port_bits = _width(p4info, "action", program.L2_SET_PORT, "port")
    worker_bits = _width(p4info, "table", program.ADDR_TABLE, "worker_id")
    for port, instance in replicas:
        if port >> port_bits:
            out.append(f"group {group}: port {port} does not fit {port_bits} bits")
        if not 0 < instance <= 1 << worker_bits:
            out.append(f"group {group}: instance {instance} is no worker id + 1")
    if replicas != {(w.switch_port, w.id + 1) for w in job.workers}:
        out.append(f"group {group}: replicas {sorted(replicas)} are not one per worker")
    return out


def reset_problems(p4info, job: Job, frames: list[bytes], epoch: int) -> list[str]:
    """A job's RESET packet-outs: raw frames (the program defines no packet_out header), one
    per slot of the pool and version, each a RESET of the job's install ``epoch``."""
    out = [f"the program has a controller header {m.preamble.name}: raw packet-outs lack it"
           for m in p4info.controller_packet_metadata if m.preamble.name == "packet_out"]
    seen = []
    for frame in frames:
        parsed = parse_udp_frame(frame)
        if parsed is None or parsed[5] != P.UDP_PORT:
            out.append("a packet-out that is no THC frame")
            continue
        hdr = P.Header.unpack(parsed[6])
        if hdr.pkt_type != P.PktType.RESET or (hdr.job_id, hdr.epoch) != (job.job_id, epoch):
            out.append(f"packet-out {hdr.pkt_type} of job {hdr.job_id}, epoch {hdr.epoch}")
        seen.append((hdr.slot, hdr.version))
    if sorted(seen) != [(s, v) for s in range(job.pool_size) for v in (0, 1)]:
        out.append(f"job {job.job_id}: resets of {sorted(seen)}, not every slot version")
    return out


LOOKUP_STRIDE = 8
"""One write in this many of those the controller serialized itself is decoded: with 256
entries a table, 32 of every table's."""


def table_id(blob: bytes) -> int:
    """The table id of a serialized ``Entity{table_entry{table_id: N, ...}}``: field 2, then
    its field 1, both first (as every encoder writes them)."""
    def varint(at: int) -> tuple[int, int]:
        value, shift = 0, 0
        while True:
            byte = blob[at]
            value |= (byte & 0x7F) << shift
            at, shift = at + 1, shift + 7
            if byte < 0x80:
                return value, at
    assert blob[0] == 0x12, f"not a table entry: {blob[:8].hex()}"
    _, at = varint(1)
    assert blob[at] == 0x08, f"the table id is not first: {blob[:8].hex()}"
    return varint(at + 1)[0]


def check_everything(p4info, sw: Recording, cluster: Cluster) -> dict[str, int]:
    """Every recorded write (those the controller serialized itself: one in LOOKUP_STRIDE),
    group and packet-out; {table or counter name: writes}."""
    checker = WriteChecker(p4info)
    problems, written, decoded = [], {}, set()
    for i, (op, blob) in enumerate(sw.writes):
        if i in sw.serialized and i % LOOKUP_STRIDE:
            info = checker.tables.get(table_id(blob))
            name = info and info.preamble.name
        else:
            name, wrong = checker.check(op, blob)
            problems += wrong
            decoded.add(name)
        written[name] = written.get(name, 0) + 1
    assert set(written) <= decoded, f"no write decoded for {sorted(set(written) - decoded)}"
    for op, group, replicas in sw.groups:
        if op == "SET":
            job = next(j for j in cluster.jobs if j.mcast_grp == group)
            problems += group_problems(p4info, job, group, replicas)
    by_job: dict[int, list[bytes]] = {}
    for frame in sw.packets:
        by_job.setdefault(P.Header.unpack(parse_udp_frame(frame)[6]).job_id, []).append(frame)
    for job in cluster.jobs:
        problems += reset_problems(p4info, job, by_job.get(job.job_id, []),
                                   installed.installed_jobs(sw)[job.job_id]["epoch"])
    assert problems == [], problems[:10]
    return written


# ---- each target ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(targets.TARGETS))
def test_every_write_of_install_and_remove_fits_the_committed_p4info(name):
    target = targets.get(name)
    p4info = committed_p4info(target)
    sw = recording_switch(target)
    assert sw.target is target and sw.lanes == P.LANES
    cluster = sample_cluster()
    jobs.install_cluster(sw, cluster)
    assert sorted(installed.installed_jobs(sw)) == sorted(j.job_id for j in cluster.jobs)
    written = check_everything(p4info, sw, cluster)

    luts = installed.lut_tables(sw)
    assert len(luts) == {"bmv2": P.LANES // 2, "tofino": 64}[name]
    n_workers = sum(j.n_workers for j in cluster.jobs)
    shared = {program.JOB_TABLE: len(cluster.jobs), program.INSTALL_TABLE: len(cluster.jobs),
              program.WORKER_TABLE: n_workers,
              program.ADDR_TABLE: n_workers, program.L2_TABLE: n_workers}
    full = {sw.tables.get(t, "table").preamble.name: n for t, n in shared.items()}
    counter = sw.counters.get(program.JOB_COUNTERS, "counter").preamble.name
    assert written == {**{t: 256 * len(cluster.jobs) for t in luts}, **full,
                         counter: len(cluster.jobs) * len(P.JOB_COUNTERS)}
    assert [op for op, *_ in sw.groups] == ["SET"] * len(cluster.jobs)

    sw.writes.clear()
    sw.serialized.clear()
    sw.groups.clear()
    sw.packets.clear()
    for job in cluster.jobs:
        jobs.remove_job(sw, job.job_id, force=True)
    removed = check_everything(p4info, sw, Cluster(jobs=()))
    assert {op for op, _ in sw.writes} == {"DELETE"}
    assert removed == {t: n for t, n in written.items() if t != counter}, \
        "every entry written is deleted"
    assert [op for op, *_ in sw.groups] == ["DELETE"] * len(cluster.jobs)
    assert all(not entries for entries in sw.device.entries.values())
    assert sw.device.groups == {} and sw.packets == []


def wide_vote_cluster() -> Cluster:
    """The sample cluster with a vote job whose counts are 16-bit (asked for, not needed)."""
    full = sample_cluster()
    vote = Job.vote(9, _workers(9, 3), pool_base=16, pool_size=4, sum_bits=16)
    return Cluster(jobs=full.jobs + (vote,), agg_ip=full.agg_ip, agg_mac=full.agg_mac).validate()


def test_tofino_refuses_a_job_of_32_workers_before_any_write():
    """Bit 31 of a Tofino slot's bitmap marks a use closed by a FLUSH: a 32nd worker's bit
    would read as a close. BMv2 takes 32 workers."""
    big = Job(job_id=7, workers=_workers(7, 32), table=TABLE, granularity=30, pool_size=4)
    cluster = Cluster(jobs=(big,), agg_ip=sample_cluster().agg_ip,
                      agg_mac=sample_cluster().agg_mac).validate()
    sw = recording_switch(targets.get("tofino"))
    with pytest.raises(ConfigError, match=r"job 7 has 32 workers; the Tofino program takes at "
                                          r"most 31"):
        jobs.install_cluster(sw, cluster)
    assert sw.writes == [] and sw.groups == [] and sw.packets == [] and sw.device.log == []
    bmv2 = recording_switch(targets.get("bmv2"))
    jobs.install_cluster(bmv2, cluster)
    assert bmv2.writes

def test_tofino_refuses_a_16_bit_vote_job_before_any_write():
    sw = recording_switch(targets.get("tofino"))
    with pytest.raises(ConfigError, match=r"job 9 is a vote job with 16-bit sums.*8-bit.*BMv2"):
        jobs.install_cluster(sw, wide_vote_cluster())
    assert sw.writes == [] and sw.groups == [] and sw.packets == [] and sw.device.log == []
    with pytest.raises(ConfigError, match=r"job 9 is a vote job with 16-bit sums"):
        job_entries.lut_entries(sw, wide_vote_cluster().job(9), 0)


def test_tofino_holds_four_jobs_and_keys_their_lookups_on_the_job_index():
    """The Tofino program's lookups hold 256 entries of each of four jobs, keyed on the job's
    index (pass 0 bridges it): the entries of the job at index 2 carry 2, and a fifth job
    is refused before any write, naming the four that stay."""
    sw = recording_switch(targets.get("tofino"))
    for k in range(4):
        job = Job(job_id=20 + k, workers=_workers(20 + k, 3), table=TABLE, granularity=30,
                  pool_base=8 * k, pool_size=8)
        assert jobs.install_job(sw, job) == k
    entries = job_entries.lut_entries(sw, Job(job_id=22, workers=_workers(22, 3), table=TABLE,
                                       granularity=30, pool_base=16, pool_size=8), 2)
    assert len(entries) == 64 * 256
    job_index = set()
    for raw in entries:
        te = p4runtime_pb2.Entity.FromString(raw).table_entry
        fid = sw.field_id(sw.table_name(te.table_id), "job_index")
        job_index |= {int.from_bytes(m.exact.value, "big") for m in te.match if m.field_id == fid}
    assert job_index == {2}
    before = len(sw.writes)
    fifth = Job(job_id=30, workers=_workers(30, 3), table=TABLE, granularity=30,
                pool_base=40, pool_size=8)
    with pytest.raises(ConfigError, match=r"hold 4 jobs at once.*20, 21, 22, 23"):
        jobs.install_job(sw, fifth)
    assert len(sw.writes) == before
    jobs.remove_job(sw, 21, force=True)
    assert jobs.install_job(sw, fifth) == 1


def test_a_cluster_of_more_jobs_than_a_tofino_holds_is_refused_as_a_cluster():
    """Five jobs in one cluster: the refusal was job 5's, calling jobs 1-4 installed, on a
    switch (or dry run) that held none of them."""
    sw = recording_switch(targets.get("tofino"))
    five = [Job(job_id=1 + k, workers=_workers(1 + k, 2), table=TABLE, granularity=30,
                pool_base=8 * k, pool_size=8) for k in range(5)]
    cluster = Cluster(jobs=tuple(five), agg_ip=SWITCH_AGG_IP, agg_mac=SWITCH_AGG_MAC)
    with pytest.raises(ConfigError, match=r"^the cluster has 5 jobs \(1, 2, 3, 4, 5\); the "
                                          r"tofino program's lookup tables hold 4 jobs at once$"):
        jobs.install_cluster(sw, cluster)
    assert not sw.writes
    jobs.install_job(sw, Job(job_id=9, workers=_workers(9, 2), table=TABLE, granularity=30,
                             pool_base=48, pool_size=8))
    four = Cluster(jobs=tuple(five[:4]), agg_ip=SWITCH_AGG_IP, agg_mac=SWITCH_AGG_MAC)
    with pytest.raises(ConfigError, match=r"has 4 jobs .*1 installed jobs it does not name stay "
                                          r"\(9; --prune removes them\)"):
        jobs.install_cluster(sw, four)
    assert jobs.install_cluster(sw, four, prune=True) == {1: 0, 2: 1, 3: 2, 4: 3}


def test_tofino_refuses_a_worker_at_its_cpu_port():
    """Packet-outs enter a Tofino at port 320 (BMv2: 255): no worker may sit there."""
    for name, port in (("tofino", tofino.CPU_PORT), ("bmv2", P.CPU_PORT)):
        sw = recording_switch(targets.get(name))
        workers = (*_workers(9, 2), Worker(2, "10.9.0.3", 20002, "02:00:00:00:09:03", port))
        job = Job(job_id=9, workers=workers, table=TABLE, granularity=30, pool_size=8)
        with pytest.raises(ConfigError, match=f"switch_port {port} is not a front-panel port"):
            jobs.install_job(sw, job)
        assert sw.writes == []
    sw = recording_switch(targets.get("tofino"))
    workers = (*_workers(9, 2), Worker(2, "10.9.0.3", 20002, "02:00:00:00:09:03", 319))
    jobs.install_job(sw, Job(job_id=9, workers=workers, table=TABLE, granularity=30,
                             pool_size=8))


@pytest.mark.parametrize("port", [324, 321, 383])
def test_tofino_refuses_a_worker_at_a_recirculation_port(port):
    """Pipe 2's ports from 320 up are not front-panel ports; at 324 (the program's pass
    port, 68 in the pipe) the job's RESULT copies would come back in as passes, their bridge
    header read from the frame's MAC bytes."""
    sw = recording_switch(targets.get("tofino"))
    workers = (*_workers(9, 2), Worker(2, "10.9.0.3", 20002, "02:00:00:00:09:03", port))
    with pytest.raises(ConfigError, match=f"switch_port {port} is not a front-panel port"
                                          r".*ports 256-319"):
        jobs.install_job(sw, Job(job_id=9, workers=workers, table=TABLE, granularity=30,
                                 pool_size=8))
    assert sw.writes == []


def test_tofino_keeps_a_job_in_the_cpu_ports_pipe():
    """A job's slot registers live in one pipe and RESETs enter at the CPU port (320, pipe
    2): a worker on another pipe is refused before any write, naming the ports to use."""
    sw = recording_switch(targets.get("tofino"))
    workers = (*_workers(9, 2), Worker(2, "10.9.0.3", 20002, "02:00:00:00:09:03", 384))
    with pytest.raises(ConfigError, match=r"port 384, pipe 3.*ports 256-319"):
        jobs.install_job(sw, Job(job_id=9, workers=workers, table=TABLE, granularity=30,
                                 pool_size=8))
    assert sw.writes == []


def test_kept_lookup_entries_are_those_of_the_program_job_and_index_asked_for():
    """The controller keeps the lookup entries it built: each call still gives what a fresh
    build gives for that program, job and index, and the Tofino's pipe check still runs for
    a job whose entries are kept."""
    job_entries.forget_lut_entries()
    bm, tf = recording_switch(targets.get("bmv2")), recording_switch(targets.get("tofino"))
    job = Job(job_id=9, workers=_workers(9, 2), table=TABLE, granularity=30, pool_size=8)
    asks = [(job, 0, True), (job, 1, True), (job, 0, False),
            (replace(job, table=tuple(range(16))), 0, True), (replace(job, job_id=10), 0, True),
            (Job(job_id=9, workers=_workers(9, 12), table=TABLE, granularity=30, pool_size=8),
             0, True)]
    assert asks[-1][0].sum_bits == 16 != job.sum_bits
    for sw, its_asks in ((tf, asks), (bm, asks[2:4])):
        for ask in its_asks:
            assert job_entries.lut_entries(sw, *ask) == job_entries.lut_entries(sw, *ask) \
                == job_entries.build_lut_entries(sw, *ask)
    assert job_entries.lut_entries(bm, job, 0, False) != job_entries.lut_entries(tf, job, 0, False)
    away = replace(job, workers=(*job.workers[:1], replace(job.workers[1], switch_port=384)))
    with pytest.raises(ConfigError, match="pipe 3"):
        job_entries.lut_entries(tf, away, 0)


@pytest.mark.parametrize("name", sorted(targets.TARGETS))
def test_a_cluster_installed_again_is_left_alone(name):
    """A restarted controller compares what is installed with the cluster: on Tofino it read
    the lookup tables by a job id they are not keyed on, and every install after the first
    failed ("has no match field 'job_id'")."""
    sw = recording_switch(targets.get(name))
    index = jobs.install_cluster(sw, sample_cluster(), live_window=0.05)
    mark = len(sw.writes)
    assert jobs.install_cluster(sw, sample_cluster(), live_window=0.05) == index
    assert sw.writes[mark:] == []
    changed = Cluster(jobs=(replace(sample_cluster().jobs[0], table=tuple(range(16))),
                            *sample_cluster().jobs[1:]), agg_ip=SWITCH_AGG_IP,
                      agg_mac=SWITCH_AGG_MAC).validate()
    assert jobs.install_cluster(sw, changed, live_window=0.05) == index
    assert len(sw.writes) > mark


@pytest.mark.parametrize("name", sorted(targets.TARGETS))
def test_the_lookup_tables_hold_every_job_the_switch_holds(name):
    """Each lookup table holds 256 entries of each job the target takes at once (BMv2:
    MAX_JOBS; Tofino: its lookups' size, which the job checks enforce); thc_job one each."""
    target = targets.get(name)
    p4info = committed_p4info(target)
    room = target.max_jobs(p4info)
    assert room == (P.MAX_JOBS if name == "bmv2" else 4)
    sizes = {t.preamble.name: t.size for t in p4info.tables}
    for t, size in sizes.items():
        if program.short_name(t).startswith("thc_lut_"):
            assert size >= 256 * room, t
    job_table = next(t for t in sizes if program.short_name(t) == program.JOB_TABLE)
    assert sizes[job_table] >= P.MAX_JOBS


# ---- the checks catch what they look for ------------------------------------------------------

def test_the_write_checks_catch_bad_writes():
    p4info = committed_p4info(targets.get("bmv2"))
    checker = WriteChecker(p4info)
    sw = recording_switch(targets.get("bmv2"))
    job = sample_cluster().job(5)
    good = p4runtime_pb2.Entity(table_entry=job_entries.job_entry(sw, job, 0, epoch=1))
    assert checker.problems("INSERT", good.SerializeToString()) == []

    def found(change, what: str) -> bool:
        ent = p4runtime_pb2.Entity()
        ent.CopyFrom(good)
        change(ent.table_entry)
        return any(what in p for p in checker.problems("INSERT", ent.SerializeToString()))

    def other_action(te):
        act = te.action.action
        act.action_id = sw.actions.get(program.SET_WORKER, "action").preamble.id
        del act.params[1:]

    assert found(lambda te: setattr(te, "table_id", 1), "no table")
    assert found(lambda te: setattr(te.match[0].exact, "value", b"\x01\x00\x00"), "fit 16 bits")
    assert found(lambda te: te.match.pop(), "match fields")
    assert found(lambda te: te.action.action.params.pop(), "parameters")
    assert found(lambda te: setattr(te.action.action, "action_id", 3), "no action with id")
    assert found(lambda te: setattr(te.action.action.params[0], "value", b"\x01\xff"),
                 "fit 8 bits")
    assert found(other_action, "not one of the table's")
    assert found(lambda te: te.ClearField("action"), "no action")
    too_far = sw.counter_zeros(program.RESETS, [P.MAX_JOBS])[0].SerializeToString()
    assert any("outside" in p for p in checker.problems("MODIFY", too_far))

    assert group_problems(p4info, job, 5, {(w.switch_port, w.id) for w in job.workers})
    assert group_problems(p4info, job, 5, {(600, 1)})
    frames = [reset_frame(job.job_id, s, SWITCH_AGG_MAC, SWITCH_AGG_IP, v, 7)
              for s in range(job.pool_size) for v in (0, 1)]
    assert reset_problems(p4info, job, frames, 7) == []
    assert reset_problems(p4info, job, frames[:-1], 7)
    assert reset_problems(p4info, job, frames, 8)
    other = Job(job_id=9, workers=job.workers, table=TABLE, granularity=30, pool_size=8)
    assert reset_problems(p4info, other, frames, 7)


# ---- what the Tofino lookups compute ----------------------------------------------------------

def test_tofino_lookup_values_add_into_8_bit_lanes_in_order():
    """Byte 2*NN + h of a pass's indices keys word NN's table h; its value is the two lanes'
    table values (first lane high). Summed over workers as 16-bit values (8-bit sums carry
    nothing into the neighbour), the words read back as the pass's lanes in order."""
    n = 8
    job = Job(job_id=3, workers=_workers(3, n), table=TABLE, granularity=30).validate()
    values = np.array(tofino.lut_values(job, 0), dtype=np.uint32)
    assert tofino.lut_values(job, 1) == tofino.lut_values(job, 0)
    rng = np.random.default_rng(3)
    lanes_a_pass = 128                                   # a pass: words 00-31
    idx = rng.integers(0, 16, (n, lanes_a_pass))
    idx[0] = 15
    key = idx[:, 0::2] << 4 | idx[:, 1::2]                  # worker, byte 2*NN + h
    assert key.shape[1] == lanes_a_pass // tofino.WORD_LANES * tofino.WORD_KEYS
    total = values[key].sum(axis=0)
    assert total.max() < 1 << 16
    lanes = np.frombuffer(total.astype(">u2").tobytes(), np.uint8)
    np.testing.assert_array_equal(lanes, np.asarray(TABLE)[idx].sum(axis=0))


def test_each_target_takes_the_multicast_groups_its_engine_takes():
    """BMv2's pre refuses group ids from 32768, Tofino's takes 16 bits: the check before any
    write and the in-memory switch follow the target."""
    for name, ok, bad in (("tofino", 40000, 65536), ("bmv2", 32767, 32768)):
        sw = recording_switch(targets.get(name))
        job = Job(job_id=5, workers=_workers(5, 2), table=TABLE, granularity=30,
                  mcast_grp=ok)
        jobs.install_job(sw, job)
        assert ok in sw.multicast_groups()
        top = ok if name == "bmv2" else 65535
        mark = len(sw.writes)
        with pytest.raises(ConfigError, match=f"multicast group {bad} outside 1..{top}"):
            jobs.install_job(sw, Job(job_id=6, workers=_workers(6, 2), table=TABLE,
                                     granularity=30, pool_base=8, mcast_grp=bad))
        assert len(sw.writes) == mark, "refused after writes began"
