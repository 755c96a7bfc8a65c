"""Link emulation: bandwidth with HTB (TCLink), delay and loss with netem when the kernel has it.

Some kernels (e.g. small VM kernels) are built without ``sch_netem``. Then:

- **loss** is emulated with an iptables ``statistic`` rule in every host's own namespace
  (``raw PREROUTING``, so a drop is silent, as on a wire; dropping in OUTPUT would make the
  sender's ``sendto`` fail with EPERM). Every host-to-host path of the star crosses two links,
  so each host drops arriving packets with probability 1 - (1 - loss)^2, the same end-to-end
  loss as netem on both links;
- **delay** cannot be emulated, and asking for it raises :class:`LinkError` rather than
  silently running without it.

Mininet's link classes are in thc.emu.tclinks: this module imports without Mininet (the
loopback testbed's commands read their flags through it).
"""
from __future__ import annotations

import functools
import shutil
import subprocess

from thc.net.window import timeout_for
from thc.wire import protocol as P
from thc.emu.nodeshell import node_run


class LinkError(RuntimeError):
    """A link parameter that this machine cannot emulate."""


BW_MAX_MBIT = 100_000
"""Mbit/s: the most a link is shaped to (:func:`plan` refuses more: tc refused an HTB burst far
beyond it, and the links ran unshaped under a shaped label)."""
BW_MIN_MBIT = 0.1
"""Mbit/s: the least (a rate is written with six decimals, and tc refused 1e-6 Mbit/s as no
rate: the links ran unshaped under a shaped label)."""


IPERF_PORT = 5201
FLOW_PAYLOAD = 1400
"""A competing flow's UDP payload (iperf -l)."""
FLOW_FRAME = FLOW_PAYLOAD + 8 + 20 + 14
"""What a shaper counts of one of its datagrams: with its UDP, IPv4 and Ethernet headers."""


def competing_sink() -> list[str]:
    """The iperf 2 server that takes a competing flow (and answers nothing)."""
    return ["iperf", "-s", "-u", "-p", str(IPERF_PORT)]


def competing_flow(dest: str, wire_mbit: float) -> list[str]:
    """iperf 2 sending UDP to ``dest`` at ``wire_mbit`` Mbit/s as the links' shapers count
    it: iperf paces its payload (-b in bits/s; its "M" is 2^20), so it is asked for the
    payload's share of that rate (at the payload's rate the wire carried 3 % more)."""
    payload_bps = wire_mbit * 1e6 * FLOW_PAYLOAD / FLOW_FRAME
    return ["iperf", "-u", "-c", dest, "-p", str(IPERF_PORT), "-b", f"{payload_bps:.0f}",
            "-l", str(FLOW_PAYLOAD), "-t", "3600"]


BAND_FIFO_BYTES = 100 * 1514
"""Queue of each class band of a priority link (tclinks.PriorityTCIntf; tail drop beyond it),
100 full frames: short enough that a congested link drops instead of queueing for seconds.
In bytes, as a switch's buffer counts: a UDP GSO burst (the compiled client's DATA) is one
packet to a qdisc, and a queue of packets would hold up to 64 of its datagrams a place."""


def band_of_dscp() -> dict[int, int]:
    """DSCP -> band of a priority link: band 0 is served first. Class k (protocol.json's
    ``priority_dscp[k]``, k = 0 lowest) is band ``len - 1 - k``; anything else (DSCP 0,
    unknown DSCPs) the last band, best effort, as the switch's queue priority 0."""
    n = len(P.PRIORITY_DSCP)
    return {d: n - 1 - k for k, d in enumerate(P.PRIORITY_DSCP)}


@functools.lru_cache(maxsize=None)
def netem_available() -> tuple[bool, str]:
    """Can this kernel attach a netem qdisc? Probed in a throw-away network namespace."""
    if not shutil.which("unshare"):
        return False, "unshare (util-linux) is missing, cannot probe for netem"
    script = ("ip link add thcprobe0 type veth peer name thcprobe1 && "
              "tc qdisc add dev thcprobe0 root netem delay 1ms")
    try:
        r = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True,
                           text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"netem probe failed: {e}"
    if r.returncode == 0:
        return True, "netem available"
    return False, ("the kernel has no netem qdisc (sch_netem): "
                   + (r.stderr.strip().splitlines() or ["tc failed"])[-1])


@functools.lru_cache(maxsize=None)
def iptables_statistic_available() -> tuple[bool, str]:
    exe = shutil.which("iptables")
    if not exe:
        return False, "iptables is not installed (Debian: apt-get install iptables)"
    try:
        r = subprocess.run(["unshare", "-n", exe, "-t", "raw", "-A", "PREROUTING", "-m",
                            "statistic", "--mode", "random", "--probability", "0.5", "-j",
                            "DROP"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"iptables probe failed: {e}"
    if r.returncode == 0:
        return True, "iptables statistic match available"
    return False, f"iptables statistic match unavailable: {r.stderr.strip()}"


def path_loss(loss_pct: float) -> float:
    """Per-host ingress drop probability equal to two lossy links in series."""
    p = loss_pct / 100.0
    return 1.0 - (1.0 - p) ** 2


def check_bw(bw_mbit: float | None, link: str = "bandwidth") -> None:
    """Raise LinkError for a rate tc cannot shape (None: unshaped, fine)."""
    if bw_mbit is not None and not BW_MIN_MBIT <= bw_mbit <= BW_MAX_MBIT:
        raise LinkError(f"{link} must lie in [{BW_MIN_MBIT:g}, {BW_MAX_MBIT}] Mbit/s "
                        f"(100 Gbit/s at most), got {bw_mbit:g} Mbit/s")


def plan(bw_mbit: float | None, delay_ms: float, loss_pct: float) -> dict:
    """Decide how to emulate the requested link: TCLink parameters plus the loss fallback.

    Returns {"link": kwargs for TCLink, "iptables_loss": per-host drop probability or 0,
    "notes": [str]}; raises LinkError if something asked for cannot be emulated.
    """
    check_bw(bw_mbit)
    if delay_ms < 0:
        raise LinkError(f"delay must be >= 0, got {delay_ms} ms")
    if not 0 <= loss_pct < 100:
        raise LinkError(f"loss must lie in [0, 100) percent, got {loss_pct}")
    link: dict = {}
    notes: list[str] = []
    if bw_mbit is not None:
        link["bw"] = float(bw_mbit)
    if delay_ms or loss_pct:
        ok, why = netem_available()
        if ok:
            if delay_ms:
                link["delay"] = f"{delay_ms:g}ms"
            if loss_pct:
                link["loss"] = float(loss_pct)
            return {"link": link, "iptables_loss": 0.0, "notes": notes}
        if delay_ms:
            raise LinkError(f"cannot emulate {delay_ms:g} ms of delay: {why}")
        ok2, why2 = iptables_statistic_available()
        if not ok2:
            raise LinkError(f"cannot emulate {loss_pct:g}% loss: {why}; {why2}")
        notes.append(f"{why}; loss emulated with iptables statistic drops on host ingress")
        return {"link": link, "iptables_loss": path_loss(loss_pct), "notes": notes}
    return {"link": link, "iptables_loss": 0.0, "notes": notes}


def refusal(link_plan: dict, bw_mbit: float | None, aggregator: str,
            class_queues: bool) -> str | None:
    """Why links of ``link_plan`` cannot carry a testbed of ``aggregator`` (with links that
    queue by DLCP class: ``class_queues``), or None: said by the testbed, and for every mode
    before a main job trains its first."""
    if aggregator == "bmv2" and link_plan["iptables_loss"] and shutil.which("nft") is None:
        return ("loss through BMv2 without netem needs nftables (`nft`, Debian: nftables): a "
                "worker's path to the switch crosses one link, whose loss each way is set at "
                "the worker's end, its egress by an nftables rule (set_link_loss)")
    if class_queues and (bw_mbit is None or "delay" in link_plan["link"]
                         or "loss" in link_plan["link"]):
        return ("priority queueing needs a bandwidth limit and no netem delay/loss on the "
                "links (it takes the links' queue)")
    return None


def add_ingress_loss(host, intf: str, probability: float) -> None:
    """Drop IPv4 packets arriving on ``intf`` at random, inside ``host``'s namespace."""
    if probability <= 0:
        return
    out = node_run(host, f"iptables -t raw -A PREROUTING -i {intf} -m statistic --mode "
                         f"random --probability {probability:.6f} -j DROP 2>&1")
    if out.strip():
        raise LinkError(f"{host.name}: iptables failed: {out.strip()}")


EGRESS_TABLE = "thcloss"


def set_link_loss(host, intf: str, loss_pct: float) -> None:
    """``loss_pct`` loss in each direction of ``host``'s link, set on a running testbed.

    For a switch with no host at the far end (BMv2): packets leaving ``intf`` are dropped by
    an nftables netdev egress rule (silent to a UDP sender, as on a wire; a ping or TCP
    sender is told of a local drop and sends again at once), packets arriving on it by the
    iptables ingress rule, both with the probability in millionths. Both live in the host's
    namespace, which goes away with the testbed. 0 removes both.
    """
    node_run(host, f"iptables -t raw -F PREROUTING; nft delete table netdev {EGRESS_TABLE} "
                   f"2>/dev/null")
    if loss_pct <= 0:
        return
    if not 0 < loss_pct < 100:
        raise LinkError(f"loss must lie in [0, 100) percent, got {loss_pct}")
    add_ingress_loss(host, intf, loss_pct / 100)
    per_million = round(loss_pct * 10_000)
    out = node_run(
        host,
        f"nft add table netdev {EGRESS_TABLE} && nft add chain netdev {EGRESS_TABLE} eg "
        f"'{{ type filter hook egress device {intf} priority 0; }}' && nft add rule netdev "
        f"{EGRESS_TABLE} eg meta protocol ip numgen random mod 1000000 '<' {per_million} "
        f"counter drop 2>&1")
    if out.strip():
        raise LinkError(f"{host.name}: nft egress loss failed: {out.strip()}")


def link_drops(host) -> int:
    """Packets dropped so far by :func:`set_link_loss`'s rules in ``host``'s namespace."""
    import re
    total = 0
    listed = node_run(host, "iptables -t raw -L PREROUTING -v -x -n 2>/dev/null")
    for line in listed.splitlines():
        f = line.split()
        if len(f) > 2 and f[2] == "DROP" and f[0].isdigit():
            total += int(f[0])
    nft = node_run(host, f"nft list table netdev {EGRESS_TABLE} 2>/dev/null")
    total += sum(int(n) for n in re.findall(r"counter packets (\d+)", nft))
    return total


def client_timeout(delay_ms: float, switch: bool = False) -> float:
    """A THC client's least retransmission timeout (seconds, its ``--rto``) over links of
    ``delay_ms`` each: half the unloaded round trip, which crosses two links each way to an
    aggregator on a host (worker, switch, the aggregator's host), one where the ``switch``
    itself answers."""
    return timeout_for((2 if switch else 4) * delay_ms / 1000)
