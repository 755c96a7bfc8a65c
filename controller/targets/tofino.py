"""The Tofino target: p4src/thc_tna.p4 under bf_switchd's P4Runtime server, and its lookup
tables.

The program adds a packet's 256 lanes in words of four 8-bit lanes, 32 words a pass (pass 1
the last 128 lanes, pass 2 the first 128, in words 00-31; docs/switch.md, "Tofino"), or of
two 16-bit lanes (passes 1-4, 64 lanes each, the last first). Each word has two lookup
tables, one per key byte (two 4-bit indices, the first lane in the high nibble). For an
8-bit job the word's two key bytes are four indices, and each table returns its byte's
two lanes' table values at once (the first lane in the high byte); for a 16-bit job both
key bytes are the same index byte (the program doubles it), and table h returns the value
of its lane h, 16 bits:

  ThcIngress.thc_w<NN>.thc_lut_<h>   (job_index, idx) -> thc_lut_set_<h>(value: 16 bits)
                                     NN = 00..31, h = 0, 1: 256 entries a job in each, the
                                     same in every table of one h; keyed on the job's index
                                     (set_job's job_index, which pass 0 bridges to the
                                     adding passes)

A vote job's DATA carries one sign bit a lane; pass 0 spreads them over the index bytes
(p4src/gen_tna.py, spread), two sign bits a key byte at VOTE_BITS, and the job's entries
count them (8-bit counts). Vote jobs with 16-bit sums, and jobs of 32 workers (bit 31 of a
slot's bitmap marks a use closed by a FLUSH), do not run here (check_job).

The P4Info is p4c's Tofino back end's, written with ``--p4runtime-files`` and
``--p4runtime-force-std-externs`` (without it, table names gain a ``pipe.`` prefix and the
counters become Tofino externs that P4Runtime's counter reads do not address).
"""
from __future__ import annotations

from collections.abc import Collection

from thc.controller.targets.base import Target
from thc.controller.toolchain import BUILD_DIR
from thc.wire import protocol as P
from thc.wire.jobs import ConfigError

WORD = "ThcIngress.thc_w{:02d}"
LUT_TABLE = WORD + ".thc_lut_{}"
LUT_ACTION = WORD + ".thc_lut_set_{}"
WORD_LANES = 4
WORD_KEYS = 2
"""Key bytes (lookup tables) a word: four 4-bit indices."""
CPU_PORT = 320
"""Tofino-1's PCIe CPU port (pipe 2, port 64, on a four-pipe part)."""
PIPE_SHIFT = 7
"""A port's pipe: its number's bits 8-7. Each pipe has its own registers."""
FRONT_PANEL = 64
"""A Tofino-1 pipe's front-panel ports are its ports 0-63; 64-71 are its CPU and
recirculation ports, the program's pass port among them (gen_tna.RECIRC_PORT, 68): a frame
arriving there is parsed as a pass, its bridge header read from the frame's first bytes."""
CLOSED_BIT = 31
"""The slot bitmap's bit that marks a use closed by a FLUSH: no worker may hold it."""


VOTE_BITS = ((1, 0), (7, 6))
"""Where pass 0 leaves a vote DATA's two sign bits in a key byte of table h (first lane,
second lane): bits 25-22 and 9-6 of each index header, gen_tna.spread. The other bits of
the byte are not defined: every byte value has its entry."""


def lut_values(job, h: int) -> list[int]:
    """[key byte] -> the action value of table h. A THC byte holds two indices (the first
    lane in the high nibble): an 8-bit job's value is both lanes' table values, the first
    lane's in the high byte; a 16-bit job's is lane h's alone. A vote byte holds two sign
    bits at VOTE_BITS[h] (VOTE_TABLE counts them)."""
    t = job.table
    if job.sum_bits == 16:
        return [t[byte >> 4] if h == 0 else t[byte & 0x0F] for byte in range(256)]
    if job.aggregation == "vote":
        first, second = VOTE_BITS[h]
        return [t[byte >> first & 1] << 8 | t[byte >> second & 1] for byte in range(256)]
    return [t[byte >> 4] << 8 | t[byte & 0x0F] for byte in range(256)]


class Tofino(Target):
    name = "tofino"
    program = "thc_tna"
    build_dir = BUILD_DIR / "tofino"
    lut_table = LUT_TABLE
    cpu_port = CPU_PORT
    push_refusal = ("bf_switchd loads the Tofino program when it starts (its --conf-file "
                    "names the compiled binary); connect to it without pushing")

    def lanes(self, p4info) -> int:
        return P.LANES if self.groups(p4info) else 0

    def front_panel(self, port: int) -> bool:
        return 0 <= port < 4 << PIPE_SHIFT and port & ((1 << PIPE_SHIFT) - 1) < FRONT_PANEL

    @property
    def front_panel_ports(self) -> str:
        pipes = (f"{p << PIPE_SHIFT}..{(p << PIPE_SHIFT) + FRONT_PANEL - 1}" for p in range(4))
        return f"ports 0..{FRONT_PANEL - 1} of a pipe: {', '.join(pipes)}"

    def check_job(self, job) -> None:
        if job.aggregation == "vote" and job.sum_bits != 8:
            raise ConfigError(
                f"job {job.job_id} is a vote job with {job.sum_bits}-bit sums; the Tofino "
                f"program counts votes in 8-bit lanes (counts of at most {CLOSED_BIT} workers): "
                f"leave sum_bits out, or run the job on BMv2 (--target bmv2) or the software "
                f"aggregator")
        pipe = CPU_PORT >> PIPE_SHIFT
        first = pipe << PIPE_SHIFT
        ports = f"{first}-{first + FRONT_PANEL - 1}"
        away = [w for w in job.workers if w.switch_port >> PIPE_SHIFT != pipe]
        if away:
            raise ConfigError(
                f"job {job.job_id}: worker {away[0].id} sits at port {away[0].switch_port}, "
                f"pipe {away[0].switch_port >> PIPE_SHIFT}; a job's slot registers live in "
                f"one pipe, and the RESET packet-outs that clear them enter at the CPU port "
                f"{CPU_PORT} (pipe {pipe}): put the job's workers on its front-panel ports "
                f"{ports}")
        inside = [w for w in job.workers if not self.front_panel(w.switch_port)]
        if inside:
            raise ConfigError(
                f"job {job.job_id} worker {inside[0].id}: switch_port {inside[0].switch_port} "
                f"is not a front-panel port (pipe {pipe}'s ports {first + FRONT_PANEL} and up "
                f"are its CPU and recirculation ports, where the program's passes come back "
                f"in): put the job's workers on ports {ports}")
        if job.n_workers > CLOSED_BIT:
            raise ConfigError(
                f"job {job.job_id} has {job.n_workers} workers; the Tofino program takes at "
                f"most {CLOSED_BIT} (bit {CLOSED_BIT} of a slot's bitmap marks a use closed "
                f"by a FLUSH)")

    def lut_entries(self, sw, job, job_index: int, with_action: bool = True,
                    tables: Collection[str] | None = None) -> list[bytes]:
        """256 entries in each word's two index tables, keyed on the job's index (pass 0
        bridges it to the passes that look up)."""
        self.check_job(job)
        out = []
        for word in range(self.groups(sw.p4info)):
            for h in range(WORD_KEYS):
                table = LUT_TABLE.format(word, h)
                if not self.wanted(sw, table, tables):
                    continue
                out += self._entries(sw, table, LUT_ACTION.format(word, h),
                                     lut_values(job, h), job_index, with_action)
        return out

    @staticmethod
    def _entries(sw, table: str, action: str, values: list[int], job_index: int,
                 with_action: bool) -> list[bytes]:
        if with_action:
            return sw.entries_bytes(table, action, [
                ({"job_index": job_index, "idx": key}, {"value": value})
                for key, value in enumerate(values)])
        return [sw.entry_bytes(table, {"job_index": job_index, "idx": key})
                for key in range(len(values))]


TARGET = Tofino()
