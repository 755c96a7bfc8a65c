"""The table entries that program one job on the switch (see controller/jobs.py for what
they are and in which order they go in): the job's row, its workers' rows and addresses,
and the lookup tables of every lane group."""
from __future__ import annotations

from dataclasses import dataclass

from controller.switch import Switch
from host.wire import protocol as P
from host.wire.jobs import SWITCH_AGG_IP, SWITCH_AGG_MAC, Cluster, ConfigError, Job

JOB_TABLE = "thc_job"
WORKER_TABLE = "thc_worker"
ADDR_TABLE = "thc_worker_addr"
GROUP = "ThcIngress.thc_g{}"
LUT_TABLE = GROUP + ".thc_lut_{}"
LUT_ACTION = GROUP + ".thc_lut_set_{}"
LUT_SUM_ACTION = GROUP + ".thc_lut_sum{}"
GROUP_BYTES = P.GROUP_LANES * P.INDEX_BITS // 8


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
    return sw.table_entry(JOB_TABLE, {"job_id": job.job_id}, "set_job", {
        "job_index": job_index, "n_workers": job.n_workers, "pool_base": job.pool_base,
        "pool_size": job.pool_size, "full_bitmap": job.full_bitmap, "mcast_grp": job.mcast_grp,
        "sum_bits": job.sum_bits, "epoch": epoch,
        "aggregation": P.AGGREGATIONS[job.aggregation]})


def worker_entries(sw: Switch, job: Job) -> list:
    return [sw.table_entry(WORKER_TABLE, {"job_id": job.job_id, "worker_id": w.id,
                                          "src_ip": w.ip, "src_port": w.port},
                           "set_worker", {"worker_bit": 1 << w.id})
            for w in job.workers]


def addr_entries(sw: Switch, job: Job, agg: AggAddress) -> list:
    return [sw.table_entry(ADDR_TABLE, {"job_id": job.job_id, "worker_id": w.id},
                           "set_worker_addr", {"worker_mac": w.mac, "worker_ip": w.ip,
                                               "worker_port": w.port, "agg_mac": agg.agg_mac,
                                               "agg_ip": agg.agg_ip})
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


def lut_action(group: int, pos: int, sum_bits: int) -> str:
    """The action of a lookup entry: the last byte's also adds the group's words (one
    action per sum width, so BMv2 runs no further table for them)."""
    if pos == GROUP_BYTES - 1:
        return LUT_SUM_ACTION.format(group, sum_bits)
    return LUT_ACTION.format(group, pos)


def lut_entries(sw: Switch, job: Job, with_action: bool = True) -> list:
    """256 x 4 lookup entries per lane group (serialized: see Switch.entry_bytes)."""
    values = lut_values(job) if with_action else None
    out = []
    for group in range(sw.lanes // P.GROUP_LANES):
        for pos in range(GROUP_BYTES):
            table = LUT_TABLE.format(group, pos)
            if with_action:
                out += sw.entries_bytes(table, lut_action(group, pos, job.sum_bits), [
                    ({"job_id": job.job_id, "idx": byte}, {"value": values[pos][byte]})
                    for byte in range(256)])
            else:
                out += [sw.entry_bytes(table, {"job_id": job.job_id, "idx": byte})
                        for byte in range(256)]
    return out
