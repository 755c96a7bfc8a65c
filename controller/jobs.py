"""Install and remove THC jobs: every table entry, group and slot a job owns on the switch.

A job (host/wire/jobs.py ``Job``) becomes

  thc_job          job_id -> set_job(job_index, n_workers, pool_base, pool_size,
                                     full_bitmap, mcast_grp, sum_bits, epoch)
                   epoch: a fresh nonzero value at every install, returned in every reply
  thc_worker       (job_id, worker_id, src_ip, src_port) -> set_worker(worker_bit)
  thc_worker_addr  (job_id, worker_id) -> set_worker_addr(worker_mac, worker_ip,
                                                          worker_port, agg_mac, agg_ip)  [egress]
  thc_g<k>.thc_lut_<b>  (job_id, byte) -> thc_lut_set_<b>(two lanes' values, packed)
                   256 entries x 4 bytes x LANES/8 lane groups
  multicast group  job.group: one replica per worker (its switch_port, instance worker_id + 1)
  l2_forward       worker MAC -> switch_port
  RESET x 2 x pool packet-outs that clear the job's slot versions in the data plane,
                   because BMv2's P4Runtime server cannot write registers

``install_job`` is idempotent: entries that exist are modified, entries of an earlier version
of the job that the new one lacks (workers, groups, MACs) are deleted, the pool is reset and
the job's counters are zeroed, so running it twice leaves the same state as running it once.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from controller import counters, forwarding
from controller.frames import mac_str, reset_frame
from controller.switch import Switch, SwitchError
from host.wire import protocol as P
from host.wire.jobs import Cluster, ConfigError, Job

JOB_TABLE = "thc_job"
WORKER_TABLE = "thc_worker"
ADDR_TABLE = "thc_worker_addr"
GROUP = "ThcIngress.thc_g{}"
LUT_TABLE = GROUP + ".thc_lut_{}"
LUT_ACTION = GROUP + ".thc_lut_set_{}"
GROUP_LANES = 8
GROUP_BYTES = GROUP_LANES * P.INDEX_BITS // 8


class JobNotInstalled(SwitchError):
    pass


@dataclass(frozen=True)
class AggAddress:
    """Where results come from: the aggregator's (switch's) IPv4 and MAC address."""
    ip: str = "10.0.0.254"
    mac: str = "02:00:00:00:00:fe"

    @classmethod
    def of(cls, cluster: Cluster) -> "AggAddress":
        return cls(cluster.agg_ip, cluster.agg_mac)


# ---- reading what is installed ------------------------------------------------------------

def installed_jobs(sw: Switch) -> dict[int, dict]:
    """{job_id: set_job parameters} of the jobs on the switch."""
    fid = sw.field_id(JOB_TABLE, "job_id")
    return {sw.match_values(e)[fid]: sw.param_values(e) for e in sw.read_table(JOB_TABLE)}


def _job_entries(sw: Switch, table: str, job_id: int) -> list:
    fid = sw.field_id(table, "job_id")
    return [e for e in sw.read_table(table) if sw.match_values(e)[fid] == job_id]


def _worker_macs(sw: Switch, job_id: int | None = None, exclude: int | None = None) -> set[str]:
    """MACs in thc_worker_addr entries of one job (or of all jobs but ``exclude``)."""
    jfid = sw.field_id(ADDR_TABLE, "job_id")
    macs = set()
    for e in sw.read_table(ADDR_TABLE):
        jid = sw.match_values(e)[jfid]
        if (job_id is None or jid == job_id) and jid != exclude:
            macs.add(mac_str(sw.param_values(e)["worker_mac"].to_bytes(6, "big")))
    return macs


# ---- entries of one job -------------------------------------------------------------------

def _check(sw: Switch, job: Job, job_index: int, others: dict[int, dict]) -> None:
    job.validate()
    if job.lanes != sw.lanes:
        raise ConfigError(f"job {job.job_id} has {job.lanes} lanes; the switch program was "
                          f"compiled for {sw.lanes}")
    if not 0 <= job_index < P.MAX_JOBS:
        raise ConfigError(f"job index {job_index} outside 0..{P.MAX_JOBS - 1}")
    if job.pool_base + job.pool_size > P.SWITCH_SLOTS:
        raise ConfigError(f"job {job.job_id}: pool {job.pool_base}..{job.pool_base + job.pool_size - 1}"
                          f" does not fit the switch's {P.SWITCH_SLOTS} slots")
    for w in job.workers:
        if not 0 <= w.switch_port < 511 or w.switch_port == P.CPU_PORT:
            raise ConfigError(f"job {job.job_id} worker {w.id}: switch_port {w.switch_port} "
                              f"is not a front-panel port")
    for jid, cfg in others.items():
        if cfg["job_index"] == job_index:
            raise ConfigError(f"job index {job_index} is taken by job {jid}")
        if cfg["mcast_grp"] == job.group:
            raise ConfigError(f"multicast group {job.group} is taken by job {jid}")
        lo, hi = cfg["pool_base"], cfg["pool_base"] + cfg["pool_size"]
        if job.pool_base < hi and lo < job.pool_base + job.pool_size:
            raise ConfigError(f"job {job.job_id}'s slot pool {job.pool_base}.."
                              f"{job.pool_base + job.pool_size - 1} overlaps job {jid}'s "
                              f"{lo}..{hi - 1}")


def new_epoch(previous: int | None = None) -> int:
    """A fresh nonzero 32-bit epoch, unlike ``previous``: replies carry it, so a client
    sees that the switch's job (and its slot state) was installed anew."""
    while True:
        epoch = secrets.randbits(32)
        if epoch and epoch != previous:
            return epoch


def job_entry(sw: Switch, job: Job, job_index: int, epoch: int):
    if not 0 < epoch < 1 << 32:
        raise ConfigError(f"job {job.job_id}: epoch {epoch} outside 1..2^32-1")
    return sw.table_entry(JOB_TABLE, {"job_id": job.job_id}, "set_job", {
        "job_index": job_index, "n_workers": job.n_workers, "pool_base": job.pool_base,
        "pool_size": job.pool_size, "full_bitmap": job.full_bitmap, "mcast_grp": job.group,
        "sum_bits": job.sum_bits, "epoch": epoch})


def worker_entries(sw: Switch, job: Job) -> list:
    return [sw.table_entry(WORKER_TABLE, {"job_id": job.job_id, "worker_id": w.id,
                                          "src_ip": w.ip, "src_port": w.port},
                           "set_worker", {"worker_bit": 1 << w.id})
            for w in job.workers]


def addr_entries(sw: Switch, job: Job, agg: AggAddress) -> list:
    return [sw.table_entry(ADDR_TABLE, {"job_id": job.job_id, "worker_id": w.id},
                           "set_worker_addr", {"worker_mac": w.mac, "worker_ip": w.ip,
                                               "worker_port": w.port, "agg_mac": agg.mac,
                                               "agg_ip": agg.ip})
            for w in job.workers]


def lut_values(job: Job) -> list[list[int]]:
    """[byte position in a lane group][DATA byte] -> the action value: the byte's two lanes'
    table values placed where they sit in a 32-bit sum word (four 8-bit lanes a word: even
    bytes fill the high half, odd bytes the low half; two 16-bit lanes a word: one byte)."""
    t = job.table
    out = []
    for pos in range(GROUP_BYTES):
        row = []
        for byte in range(256):
            hi, lo = t[byte >> 4], t[byte & 0x0F]
            if job.sum_bits == 8:
                row.append(((hi << 8) | lo) << (16 if pos % 2 == 0 else 0))
            else:
                row.append((hi << 16) | lo)
        out.append(row)
    return out


def lut_entries(sw: Switch, job: Job, with_action: bool = True) -> list:
    """256 x 4 lookup entries per lane group (serialized: see Switch.entry_bytes)."""
    values = lut_values(job) if with_action else None
    out = []
    for group in range(sw.lanes // GROUP_LANES):
        for pos in range(GROUP_BYTES):
            table = LUT_TABLE.format(group, pos)
            for byte in range(256):
                if with_action:
                    out.append(sw.entry_bytes(table, {"job_id": job.job_id, "idx": byte},
                                              LUT_ACTION.format(group, pos),
                                              {"value": values[pos][byte]}))
                else:
                    out.append(sw.entry_bytes(table, {"job_id": job.job_id, "idx": byte}))
    return out


def _upsert(sw: Switch, entries: list, exists: bool = False) -> None:
    """Insert or modify; ``exists``: the entries probably exist (modify first)."""
    if exists:
        missing = sw.write_entries("MODIFY", entries, ignore=["NOT_FOUND"])
        if missing:
            sw.write_entries("INSERT", missing)
    else:
        existing = sw.write_entries("INSERT", entries, ignore=["ALREADY_EXISTS"])
        if existing:
            sw.write_entries("MODIFY", existing)


def _delete_stale(sw: Switch, table: str, job_id: int, keep: list) -> None:
    wanted = {tuple(sorted(sw.match_values(e).items())) for e in keep}
    stale = [e for e in _job_entries(sw, table, job_id)
             if tuple(sorted(sw.match_values(e).items())) not in wanted]
    if stale:
        for e in stale:
            e.ClearField("action")
        sw.write_entries("DELETE", stale, ignore=["NOT_FOUND"])


# ---- slot reset ---------------------------------------------------------------------------

def reset_pool(sw: Switch, job: Job, job_index: int, agg: AggAddress,
               timeout: float = 10.0) -> None:
    """Clear every slot of the job (RESET packet-outs) and wait until the switch applied them."""
    before = counters.resets(sw, job_index)
    sw.packet_out(reset_frame(job.job_id, slot, agg.mac, agg.ip, version)
                  for slot in range(job.pool_size) for version in (0, 1))
    deadline = time.monotonic() + timeout
    done = 0
    while time.monotonic() < deadline:
        done = counters.resets(sw, job_index) - before
        if done >= 2 * job.pool_size:
            return
        time.sleep(0.01)
    raise SwitchError(f"job {job.job_id}: only {done} of {2 * job.pool_size} slot resets reached "
                      f"the data plane within {timeout:.0f}s (is the switch started with "
                      f"--cpu-port {P.CPU_PORT}?)")


# ---- install / remove ---------------------------------------------------------------------

def install_job(sw: Switch, job: Job, agg: AggAddress = AggAddress(),
                job_index: int | None = None) -> int:
    """Install or re-install ``job``; returns its job index."""
    installed = installed_jobs(sw)
    previous = installed.pop(job.job_id, None)
    if job_index is None:
        if previous is not None:
            job_index = previous["job_index"]
        else:
            taken = {cfg["job_index"] for cfg in installed.values()}
            free = [i for i in range(P.MAX_JOBS) if i not in taken]
            if not free:
                raise ConfigError(f"the switch holds {P.MAX_JOBS} jobs already")
            job_index = free[0]
    _check(sw, job, job_index, installed)
    old_macs = _worker_macs(sw, job.job_id) if previous is not None else set()

    workers, addrs = worker_entries(sw, job), addr_entries(sw, job, agg)
    again = previous is not None
    _upsert(sw, addrs, again)
    _upsert(sw, workers, again)
    _upsert(sw, lut_entries(sw, job), again)
    sw.set_multicast_group(job.group, [(w.switch_port, w.id + 1) for w in job.workers])
    forwarding.install(sw, {w.mac: w.switch_port for w in job.workers})
    epoch = new_epoch(previous.get("epoch") if previous else None)
    _upsert(sw, [job_entry(sw, job, job_index, epoch)], again)

    # leftovers of an earlier version of this job
    _delete_stale(sw, WORKER_TABLE, job.job_id, workers)
    _delete_stale(sw, ADDR_TABLE, job.job_id, addrs)
    if previous is not None and previous["mcast_grp"] != job.group:
        sw.delete_multicast_group(previous["mcast_grp"])
    gone = old_macs - {w.mac.lower() for w in job.workers} - _worker_macs(sw, exclude=job.job_id)
    if gone:
        forwarding.remove(sw, gone)

    reset_pool(sw, job, job_index, agg)
    counters.clear_job_counters(sw, job_index)
    return job_index


def remove_job(sw: Switch, job_id: int) -> None:
    """Delete everything ``install_job`` created for ``job_id``."""
    installed = installed_jobs(sw)
    cfg = installed.get(job_id)
    if cfg is None:
        raise JobNotInstalled(f"job {job_id} is not installed on the switch "
                              f"(installed: {sorted(installed) or 'none'})")
    macs = _worker_macs(sw, job_id) - _worker_macs(sw, exclude=job_id)
    # the job entry first: from here on the job's packets drop as unknown_job
    sw.write_entries("DELETE", [sw.table_entry(JOB_TABLE, {"job_id": job_id})],
                     ignore=["NOT_FOUND"])
    for table in (WORKER_TABLE, ADDR_TABLE):
        entries = _job_entries(sw, table, job_id)
        for e in entries:
            e.ClearField("action")
        sw.write_entries("DELETE", entries, ignore=["NOT_FOUND"])
    lut_keys = [sw.entry_bytes(LUT_TABLE.format(group, pos), {"job_id": job_id, "idx": byte})
                for group in range(sw.lanes // GROUP_LANES) for pos in range(GROUP_BYTES)
                for byte in range(256)]
    sw.write_entries("DELETE", lut_keys, ignore=["NOT_FOUND"])
    sw.delete_multicast_group(cfg["mcast_grp"])
    if macs:
        forwarding.remove(sw, macs)


def install_cluster(sw: Switch, cluster: Cluster, prune: bool = False) -> dict[int, int]:
    """Install every job of a cluster, job index = position in the cluster; returns
    {job_id: job_index}. With ``prune``, jobs on the switch that the cluster lacks are removed
    first; without it they stay (and must not collide with the cluster's indices or pools)."""
    cluster.validate(total_slots=P.SWITCH_SLOTS)
    wanted = {j.job_id for j in cluster.jobs}
    installed = installed_jobs(sw)
    for jid in sorted(set(installed) - wanted):
        if prune:
            remove_job(sw, jid)
    # jobs whose index moves are taken off first, so indices can be swapped
    for i, job in enumerate(cluster.jobs):
        cfg = installed.get(job.job_id)
        if cfg is not None and cfg["job_index"] != i:
            remove_job(sw, job.job_id)
    agg = AggAddress.of(cluster)
    return {job.job_id: install_job(sw, job, agg, job_index=i)
            for i, job in enumerate(cluster.jobs)}
