"""The BMv2 target: p4src/thc.p4 on simple_switch_grpc, and its lookup tables.

Lanes come in groups of eight; each group has four lookup tables, one per DATA byte of the
group (two 4-bit indices), whose entries place the byte's two lanes' table values where they
sit in the group's 32-bit sum words:

  ThcIngress.thc_g<k>.thc_lut_<b>  (job_id, idx) -> thc_lut_set_<b>(value)
                                   the last byte: thc_lut_sum8 / thc_lut_sum16 (adds the words too)
                                   256 entries x 4 bytes x LANES/8 lane groups per job
"""
from __future__ import annotations

from collections.abc import Collection

from thc.controller.targets.base import Target
from thc.controller.toolchain import BUILD_DIR
from thc.wire import protocol as P
from thc.wire.jobs import ConfigError

GROUP = "ThcIngress.thc_g{}"
LUT_TABLE = GROUP + ".thc_lut_{}"
LUT_ACTION = GROUP + ".thc_lut_set_{}"
LUT_SUM_ACTION = GROUP + ".thc_lut_sum{}"
GROUP_LANES = P.GROUP_LANES
GROUP_BYTES = GROUP_LANES * P.INDEX_BITS // 8


def lut_values(job) -> list[list[int]]:
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


class Bmv2(Target):
    name = "bmv2"
    max_mcast_group = (1 << 15) - 1
    """BMv2's pre refuses ids from 32768 ("Group id value is too high")."""
    keeps_groups_across_push = True
    program = "thc"
    build_dir = BUILD_DIR
    lut_table = LUT_TABLE

    def lanes(self, p4info) -> int:
        return GROUP_LANES * self.groups(p4info)

    def check_job(self, job) -> None:
        """BMv2 grows a packet by at most 512 bytes: a header-only FLUSH comes back as a whole
        RESULT, so a job whose RESULT is longer is refused (gen_p4.py generates no program for
        one)."""
        try:
            P.check_lanes(job.lanes, switch=True, sum_bits=job.sum_bits,
                          aggregation=job.aggregation)
        except ValueError as e:
            raise ConfigError(f"job {job.job_id}: {e}") from None

    def lut_entries(self, sw, job, job_index: int, with_action: bool = True,
                    tables: Collection[str] | None = None) -> list[bytes]:
        """256 x 4 lookup entries per lane group, keyed on the job id."""
        values = lut_values(job) if with_action else None
        out = []
        for group in range(sw.lanes // GROUP_LANES):
            for pos in range(GROUP_BYTES):
                table = LUT_TABLE.format(group, pos)
                if not self.wanted(sw, table, tables):
                    continue
                if with_action:
                    out += sw.entries_bytes(table, lut_action(group, pos, job.sum_bits), [
                        ({"job_id": job.job_id, "idx": byte}, {"value": values[pos][byte]})
                        for byte in range(256)])
                else:
                    out += [sw.entry_bytes(table, {"job_id": job.job_id, "idx": byte})
                            for byte in range(256)]
        return out


TARGET = Bmv2()
