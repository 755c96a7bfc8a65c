"""The Tofino target: p4src/thc_tna.p4 under bf_switchd's P4Runtime server, and its lookup
tables.

A pass of the pipeline carries 128 lanes as 32 words of four 8-bit lanes, and a packet's 256
lanes take two passes through the same tables. Each word has two lookup tables, one per byte
of the pass's index segment that feeds it (byte 2*NN + h: two 4-bit indices, the first lane
in the high nibble), returning both lanes' table values at once (the first lane in the high
byte):

  ThcIngress.thc_w<NN>.thc_lut_<h>  (job_id, idx) -> thc_lut_pair(value = T[hi] << 8 | T[lo])
                                    NN = 00..31, h = 0, 1: 64 tables x 256 entries per job,
                                    every table the same entries (both passes use them)

Vote jobs use the same tables: the switch deposits two vote bits in a key byte as nibbles,
and the vote table maps 0 -> 0, 1 -> 1. Jobs with 16-bit sums do not run here (check_job).

The P4Info is p4c's Tofino back end's, written with ``--p4runtime-files`` and
``--p4runtime-force-std-externs`` (without it, table names gain a ``pipe.`` prefix and the
counters become Tofino externs that P4Runtime's counter reads do not address).
"""
from __future__ import annotations

from controller.targets.base import Target
from controller.toolchain import BUILD_DIR
from host.wire.jobs import ConfigError

WORD = "ThcIngress.thc_w{:02d}"
LUT_TABLE = WORD + ".thc_lut_{}"
LUT_ACTION = WORD + ".thc_lut_pair"
WORD_LANES = 4
WORD_KEYS = 2
"""Key bytes (lookup tables) a word: four 4-bit indices."""
PASSES = 2
SUM_BITS = 8


def lut_values(job) -> list[int]:
    """[key byte] -> the action value: the two lanes' table values, the first (high nibble)
    in the high byte."""
    t = job.table
    return [t[byte >> 4] << 8 | t[byte & 0x0F] for byte in range(256)]


class Tofino(Target):
    name = "tofino"
    program = "thc_tna"
    build_dir = BUILD_DIR / "tofino"
    lut_table = LUT_TABLE
    push_refusal = ("bf_switchd loads the Tofino program when it starts (its --conf-file "
                    "names the compiled binary); connect to it without pushing")

    def lanes(self, p4info) -> int:
        return WORD_LANES * self.groups(p4info) * PASSES

    def check_job(self, job) -> None:
        if job.sum_bits != SUM_BITS:
            raise ConfigError(
                f"job {job.job_id} has {job.sum_bits}-bit sums ({job.n_workers} workers x "
                f"granularity {job.granularity} = {job.n_workers * job.granularity}, above "
                f"{(1 << SUM_BITS) - 1}); the Tofino program adds 8-bit lanes only: a pass "
                f"carries 32 words of four 8-bit lanes, so 256 16-bit lanes would need four "
                f"passes. Run the job on BMv2 (--target bmv2) or the software aggregator, or "
                f"lower its granularity to {((1 << SUM_BITS) - 1) // job.n_workers} or less")

    def lut_entries(self, sw, job, with_action: bool = True) -> list[bytes]:
        """256 entries in each of the 64 lookup tables."""
        self.check_job(job)
        words = sw.lanes // (WORD_LANES * PASSES)
        out = []
        if with_action:
            rows = [({"job_id": job.job_id, "idx": byte}, {"value": value})
                    for byte, value in enumerate(lut_values(job))]
        for word in range(words):
            for h in range(WORD_KEYS):
                table = LUT_TABLE.format(word, h)
                if with_action:
                    out += sw.entries_bytes(table, LUT_ACTION.format(word), rows)
                else:
                    out += [sw.entry_bytes(table, {"job_id": job.job_id, "idx": byte})
                            for byte in range(256)]
        return out


TARGET = Tofino()
