"""``thc controller --dry-run``: the writes an install would make, printed, without a switch.

:class:`DryRunSwitch` is a ``Switch`` that knows only a target's P4Info and stands for a
switch that holds no jobs: reads find nothing, and each write is printed as one line instead
of sent (table entries with their match, action and parameters; counter cells; multicast
groups; the RESET packet-outs of a job summarized in one line). The install therefore runs
its own code path, checks included, as it would against a freshly started switch. The RESET
counter reports every packet-out as applied, so the install does not wait for a data plane.
"""
from __future__ import annotations

import ipaddress
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

from thc.controller.frames import mac_str, parse_udp_frame
from thc.controller.program import RESETS, short_name
from thc.controller.switch import Switch, load_p4info
from thc.controller.targets import Target
from thc.wire import protocol as P

HEX = {"idx", "value", "full_bitmap", "worker_bit", "epoch"}
"""Fields and parameters that are bit patterns, printed in hex."""


def show(name: str, width: int, value: bytes) -> str:
    """A P4Runtime value as its field would be written: MAC, IPv4, hex or decimal."""
    n = int.from_bytes(value, "big")
    if width == 48:
        return mac_str(n.to_bytes(6, "big"))
    if width == 32 and name.endswith("ip"):
        return str(ipaddress.IPv4Address(n))
    if name in HEX:
        return f"0x{n:0{(width + 3) // 4}x}"
    return str(n)


class DryRunSwitch(Switch):
    """A switch holding nothing, whose writes are printed (module doc)."""

    def __init__(self, target: Target, build_dir: Path | str | None = None,
                 out: Callable[[str], None] | None = None):
        super().__init__(grpc_addr="dry-run")
        build_dir = Path(build_dir) if build_dir is not None else target.build_dir
        self._load_p4info(load_p4info(build_dir / f"{target.program}.p4info.txt"))
        self.out = out or (lambda line: print(line, file=sys.stdout))
        self.writes = 0
        self._packet_outs = 0
        self._by_id: dict[tuple[str, int], object] = {}
        for kind, objs in (("table", self.p4info.tables), ("action", self.p4info.actions),
                           ("counter", self.p4info.counters)):
            for o in objs:
                self._by_id[(kind, o.preamble.id)] = o

    def _require(self):
        return self

    def _emit(self, line: str) -> None:
        self.writes += 1
        self.out(line)

    # -- what the switch holds: nothing ---------------------------------------------------
    def read(self, entity) -> Iterator:
        return iter(())

    def multicast_groups(self) -> dict[int, set[tuple[int, int]]]:
        return {}

    def read_counter(self, name: str) -> dict[int, int]:
        counter = self.counters.get(name, "counter")
        applied = self._packet_outs if short_name(counter.preamble.name) == RESETS else 0
        return {i: applied for i in range(counter.size)}

    # -- writes, printed ----------------------------------------------------------------
    def write_entries(self, op: str, entities: Iterable, ignore: Iterable[str] = ()) -> list:
        from p4.v1 import p4runtime_pb2
        for e in entities:
            if isinstance(e, bytes):
                e = p4runtime_pb2.Entity.FromString(e)
            elif isinstance(e, p4runtime_pb2.TableEntry):
                e = p4runtime_pb2.Entity(table_entry=e)
            self._emit(f"{op} {self.describe(e)}")
        return []

    def reset_counter(self, name: str, indices: Iterable[int]) -> bool:
        self.write_entries("MODIFY", self.counter_zeros(name, indices))
        return True

    def set_multicast_group(self, group: int, replicas: Iterable[tuple[int, int]]) -> None:
        """One line: the empty insert and delete that :meth:`Switch.set_multicast_group`
        puts before a new group's insert on BMv2 change nothing on a fresh switch."""
        shown = " ".join(f"(port {p}, instance {i})" for p, i in sorted(replicas))
        self._emit(f"INSERT multicast group {group}: {shown}")

    def delete_multicast_group(self, group: int) -> bool:
        self._emit(f"DELETE multicast group {group}")
        return True

    def packet_out(self, payloads: Iterable[bytes]) -> int:
        frames = list(payloads)
        self._packet_outs += len(frames)
        resets: dict[int, set[tuple[int, int]]] = {}
        other = 0
        for frame in frames:
            parsed = parse_udp_frame(frame)
            body = parsed[6] if parsed and parsed[5] == P.UDP_PORT else b""
            if len(body) >= P.HEADER_BYTES and body[0] == P.PktType.RESET:
                hdr = P.Header.unpack(body)
                resets.setdefault(hdr.job_id, set()).add((hdr.slot, hdr.version))
            else:
                other += 1
        for job_id, cells in sorted(resets.items()):
            slots = sorted({s for s, _ in cells})
            versions = sorted({v for _, v in cells})
            self._emit(f"PACKET_OUT {len(cells)} RESET frames to the CPU port: job {job_id}, "
                       f"slots {slots[0]}..{slots[-1]}, versions {versions}")
        if other:
            self._emit(f"PACKET_OUT {other} other frames")
        return len(frames)

    # -- one line per entity ------------------------------------------------------------
    def describe(self, entity) -> str:
        kind = entity.WhichOneof("entity")
        if kind == "counter_entry":
            c = entity.counter_entry
            name = self._by_id[("counter", c.counter_id)].preamble.name
            return f"counter {name}[{c.index.index}] packets={c.data.packet_count} " \
                   f"bytes={c.data.byte_count}"
        te = entity.table_entry
        table = self._by_id[("table", te.table_id)]
        fields = {f.id: f for f in table.match_fields}
        match = " ".join(_assign(fields[m.field_id], m.exact.value) for m in te.match)
        line = f"{table.preamble.name} {match}"
        if te.HasField("action"):
            act = te.action.action
            action = self._by_id[("action", act.action_id)]
            params = {p.id: p for p in action.params}
            args = ", ".join(_assign(params[p.param_id], p.value) for p in act.params)
            line += f" -> {action.preamble.name}({args})"
        return line


def _assign(spec, value: bytes) -> str:
    """``name=value`` of a match field or action parameter (a P4Info spec)."""
    return f"{spec.name}={show(spec.name, spec.bitwidth, value)}"
