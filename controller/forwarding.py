"""Table ``l2_forward``: Ethernet destination MAC -> egress port, for non-THC traffic.

The same table exists in p4src/thc.p4 and p4src/l2.p4. The job installer adds one entry per
worker MAC (the worker's ``switch_port``); anything else can be added by hand.
"""
from __future__ import annotations

from thc.controller.frames import mac_str
from thc.controller.program import L2_SET_PORT, L2_TABLE
from thc.controller.switch import Switch
from thc.wire import jobs

UNROUTABLE = {"00:00:00:00:00:00", "ff:ff:ff:ff:ff:ff"}
"""MACs never installed (the default worker MAC and broadcast)."""


def is_group(mac: str) -> bool:
    """A multicast (group) MAC: no one host's, so neither a worker's nor the switch's (a NIC
    that has not joined the group drops frames to it, and no frame comes from it)."""
    return bool(int(mac[:2], 16) & 1)


def check_mac(mac, where: str = "l2_forward") -> str:
    """``mac`` as six lower-case hex pairs; a ConfigError (a ValueError) naming ``where`` for
    anything else, as a job's MACs. The switch API also reads integers and bare hex, in
    which the all-zero and broadcast MACs would pass for hosts'."""
    jobs.check_mac(where, mac)
    return mac.lower()


def entry(sw: Switch, mac: str, port: int | None = None):
    if port is None:
        return sw.table_entry(L2_TABLE, {"dst_mac": mac})
    return sw.table_entry(L2_TABLE, {"dst_mac": mac}, L2_SET_PORT, {"port": port})


def install(sw: Switch, routes: dict[str, int]) -> None:
    """Add or update MAC -> port entries (idempotent)."""
    entries = [entry(sw, mac, port) for mac, port in
               ((check_mac(m), port) for m, port in routes.items()) if mac not in UNROUTABLE]
    existing = sw.write_entries("INSERT", entries, ignore=["ALREADY_EXISTS"])
    if existing:
        sw.write_entries("MODIFY", existing)


def remove(sw: Switch, macs) -> int:
    """Delete entries; returns how many existed."""
    macs = [m for m in map(check_mac, macs) if m not in UNROUTABLE]
    missing = sw.write_entries("DELETE", [entry(sw, m) for m in macs], ignore=["NOT_FOUND"])
    return len(macs) - len(missing)


def routes(sw: Switch) -> dict[str, int]:
    """Installed MAC -> port entries."""
    fid = sw.field_id(L2_TABLE, "dst_mac")
    out = {}
    for e in sw.read_table(L2_TABLE):
        mac = sw.match_values(e)[fid]
        out[mac_str(mac.to_bytes(6, "big"))] = sw.param_values(e).get("port", -1)
    return out
