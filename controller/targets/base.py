"""What a switch target is to the controller: its compiled program and its lookup tables.

Both THC programs share every table, action and counter name but the lookup tables
(controller/program.py); a target holds what differs: where its P4Info is, how to recognise
its program in a P4Info, how many lanes the program aggregates, which jobs it can run, and
the lookup entries of a job.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from pathlib import Path

from thc.controller.toolchain import BUILD_DIR
from thc.wire import protocol as P


class Target(ABC):
    """One switch target; subclasses fill in the lookup tables."""

    name = ""
    program = ""
    build_dir: Path = BUILD_DIR
    lut_table = ""
    """Full name of a lookup table, formatted with (lane group or word, key byte)."""
    push_refusal: str | None = None
    """Why the controller cannot push this target's program over P4Runtime (None: it can)."""
    cpu_port = P.CPU_PORT
    """The port packet-outs enter by: no worker sits there."""
    max_mcast_group = (1 << 16) - 1
    """The largest multicast group id the target's replication engine takes."""
    keeps_groups_across_push = False
    """Whether the replication engine keeps a multicast group's replicas across a pipeline
    push, where P4Runtime forgets the group (controller/switch.py ``set_multicast_group``)."""

    def front_panel(self, port: int) -> bool:
        """Whether a host can sit at ``port``: a 9-bit port, neither the CPU's nor 511
        (BMv2's drop port)."""
        return 0 <= port < 511 and port != self.cpu_port

    @property
    def front_panel_ports(self) -> str:
        """The ports :meth:`front_panel` takes, in words."""
        return f"0..510, not the CPU port {self.cpu_port}"

    @property
    def p4info_file(self) -> Path:
        return self.build_dir / f"{self.program}.p4info.txt"

    def runs(self, p4info) -> bool:
        """Whether ``p4info`` is this target's program (it has the first lookup table)."""
        first = self.lut_table.format(0, 0)
        return any(t.preamble.name == first for t in p4info.tables)

    def groups(self, p4info) -> int:
        """Lookup groups (BMv2 lane groups, Tofino words): those with a first lookup table."""
        names = {t.preamble.name for t in p4info.tables}
        n = 0
        while self.lut_table.format(n, 0) in names:
            n += 1
        return n

    @abstractmethod
    def lanes(self, p4info) -> int:
        """Lanes of a packet that the program aggregates."""

    def max_jobs(self, p4info) -> int:
        """Jobs the program holds at once: its lookup tables' entries, P.KEY_BYTE_ENTRIES a
        job."""
        size = next(t.size for t in p4info.tables
                    if t.preamble.name == self.lut_table.format(0, 0))
        return min(P.MAX_JOBS, size // P.KEY_BYTE_ENTRIES)

    def check_job(self, job) -> None:
        """ConfigError when the program cannot run ``job`` (host/wire/jobs.py Job); by
        default a target runs every job that validates."""

    @staticmethod
    def wanted(sw, table: str, tables: Collection[str] | None) -> bool:
        """Whether lookup table ``table`` is among ``tables`` (None: all of them)."""
        return tables is None or sw.tables.get(table, "table").preamble.name in tables

    @abstractmethod
    def lut_entries(self, sw, job, job_index: int, with_action: bool = True,
                    tables: Collection[str] | None = None) -> list[bytes]:
        """A job's lookup entries, serialized (controller/switch.py ``Switch.entries_bytes``);
        without action: the keys, to delete them. ``tables``: only those of these lookup
        tables (names as the P4Info gives them), as a comparison reads a few back."""

