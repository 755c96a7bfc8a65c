"""The entries of one job, as the switch's tables hold them, and how they are written.

A job (host/wire/jobs.py ``Job``) becomes

  thc_job          job_id -> set_job(job_index, n_workers, pool_base, pool_size,
                                     full_bitmap, mcast_grp, sum_bits, epoch,
                                     aggregation)
                   epoch: the job's configuration tag and a fresh nonce at every install,
                   returned in every reply (host/wire/protocol.py EPOCH_TAG_SHIFT)
  thc_install      (job_id, epoch) -> set_install(): the install the job's slot RESETs
                   carry, so that RESETs queued from an earlier install clear nothing
  thc_worker       (job_id, worker_id, src_ip, src_port, ingress_port) -> set_worker(worker_bit)
                   ingress_port: the worker's switch_port
  thc_worker_addr  (job_id, worker_id) -> set_worker_addr(worker_mac, worker_ip,
                                                          worker_port, agg_mac, agg_ip)  [egress]
  lookup tables    (job_id, byte) -> two lanes' table values: the target's own tables
                   (controller/targets/, e.g. 32768 entries a job on BMv2, 16384 on Tofino)

besides its multicast group and routes (controller/jobs.py writes those).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields

from thc.controller.job_checks import target_of
from thc.controller.program import (ADDR_TABLE, INSTALL_TABLE, JOB_TABLE, SET_INSTALL, SET_JOB,
                                    SET_WORKER, SET_WORKER_ADDR, WORKER_PORT_KEY, WORKER_TABLE)
from thc.controller.switch import Switch
from thc.wire import protocol as P
from thc.wire.jobs import SWITCH_AGG_IP, SWITCH_AGG_MAC, Cluster, ConfigError, Job


@dataclass(frozen=True)
class AggAddress:
    """Where results come from: the aggregator's (switch's) address, named as the
    ``set_worker_addr`` parameters and the Cluster fields are."""
    agg_ip: str = SWITCH_AGG_IP
    agg_mac: str = SWITCH_AGG_MAC

    @classmethod
    def of(cls, cluster: Cluster) -> "AggAddress":
        return cls(cluster.agg_ip, cluster.agg_mac)


def job_entry(sw: Switch, job: Job, job_index: int, epoch: int):
    if not 0 < epoch < 1 << 32:
        raise ConfigError(f"job {job.job_id}: epoch {epoch} outside 1..2^32-1")
    return sw.table_entry(JOB_TABLE, {"job_id": job.job_id}, SET_JOB, {
        "job_index": job_index, "n_workers": job.n_workers, "pool_base": job.pool_base,
        "pool_size": job.pool_size, "full_bitmap": job.full_bitmap, "mcast_grp": job.mcast_grp,
        "sum_bits": job.sum_bits, "epoch": epoch,
        "aggregation": P.AGGREGATIONS[job.aggregation]})


def install_entry(sw: Switch, job_id: int, epoch: int):
    return sw.table_entry(INSTALL_TABLE, {"job_id": job_id, "epoch": epoch}, SET_INSTALL, {})


def worker_match(job: Job, w) -> dict:
    """The worker table's key of worker ``w``: its addresses and its switch port."""
    return {"job_id": job.job_id, "worker_id": w.id, "src_ip": w.ip, "src_port": w.port,
            WORKER_PORT_KEY: w.switch_port}


def worker_entries(sw: Switch, job: Job) -> list:
    return [sw.table_entry(WORKER_TABLE, worker_match(job, w), SET_WORKER,
                           {"worker_bit": 1 << w.id})
            for w in job.workers]


def addr_entries(sw: Switch, job: Job, agg: AggAddress) -> list:
    return [sw.table_entry(ADDR_TABLE, {"job_id": job.job_id, "worker_id": w.id},
                           SET_WORKER_ADDR, {"worker_mac": w.mac, "worker_ip": w.ip,
                                               "worker_port": w.port, "agg_mac": agg.agg_mac,
                                               "agg_ip": agg.agg_ip})
            for w in job.workers]


LUT_KEPT = 4
"""Jobs' lookup entry lists kept (a few MB each): one command writes, compares and deletes
the same job's tens of thousands of entries several times (install, verify, re-install)."""
_luts: OrderedDict = OrderedDict()


def lut_entries(sw: Switch, job: Job, job_index: int, with_action: bool = True) -> list:
    """The job's lookup entries for the switch's target (serialized: see Switch.entry_bytes);
    without action: their keys. BMv2 keys them on the job id, Tofino on the job's index.
    Built once for a program, job (its workers aside: the target checks them every time)
    and index, then taken from the last :data:`LUT_KEPT`."""
    target = target_of(sw)
    target.check_job(job)
    key = (sw.program_digest(), job_index, with_action,
           tuple(getattr(job, f.name) for f in fields(job) if f.name != "workers"))
    got = _luts.get(key)
    if got is None:
        got = _luts[key] = tuple(build_lut_entries(sw, job, job_index, with_action))
        while len(_luts) > LUT_KEPT:
            _luts.popitem(last=False)
    else:
        _luts.move_to_end(key)
    return list(got)


def forget_lut_entries() -> None:
    """Drop the kept lists: a benchmark times each command as a new controller process."""
    _luts.clear()


def build_lut_entries(sw: Switch, job: Job, job_index: int, with_action: bool = True) -> list:
    """:func:`lut_entries` built afresh (what a new controller process pays)."""
    return target_of(sw).lut_entries(sw, job, job_index, with_action)


def upsert(sw: Switch, entries: list, exists: bool = False) -> None:
    """Insert or modify; ``exists``: the entries probably exist (modify first)."""
    first, then, missing = ("MODIFY", "INSERT", "NOT_FOUND") if exists else \
        ("INSERT", "MODIFY", "ALREADY_EXISTS")
    rest = sw.write_entries(first, entries, ignore=[missing])
    if rest:
        sw.write_entries(then, rest)


def delete(sw: Switch, entries: list) -> None:
    for e in entries:
        e.ClearField("action")
    if entries:
        sw.write_entries("DELETE", entries, ignore=["NOT_FOUND"])
