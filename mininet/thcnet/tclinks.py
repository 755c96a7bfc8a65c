"""Mininet's link classes for the testbed: HTB shaping without TCIntf's rate cap, and links
queued by DLCP class. Apart from thc.emu.links so that the commands that read link flags
import without Mininet."""
from __future__ import annotations

from mininet.link import TCIntf, TCLink

from thc.emu import links
from thc.wire import protocol as P


class WideTCIntf(TCIntf):
    """TCIntf without its 1000 Mbit/s cap (the aggregator's link carries n_workers x bw), its
    HTB burst and quantum sized for the rate (which also silences HTB's "quantum is big"
    warnings)."""
    bwParamMax = links.BW_MAX_MBIT
    bwParamMin = links.BW_MIN_MBIT

    def bwCmds(self, bw=None, speedup=0, use_hfsc=False, use_tbf=False, latency_ms=None,
               enable_ecn=False, enable_red=False):
        if bw is None or use_hfsc or use_tbf or enable_ecn or enable_red:
            return super().bwCmds(bw=bw, speedup=speedup, use_hfsc=use_hfsc, use_tbf=use_tbf,
                                  latency_ms=latency_ms, enable_ecn=enable_ecn,
                                  enable_red=enable_red)
        return self.htb_cmds(bw)

    @classmethod
    def htb_cmds(cls, bw: float) -> tuple[list[str], str | None]:
        """bwCmds' (tc commands, parent of the qdisc after them) for a rate of ``bw`` Mbit/s:
        one HTB class, ~1 ms of traffic a burst (at least 15 kB), an MTU-sized quantum."""
        burst = max(15_000, int(bw * 1e6 / 8 / 1000))
        cmds = ["%s qdisc add dev %s root handle 5:0 htb default 1",
                "%s class add dev %s parent 5:0 classid 5:1 htb "
                + f"rate {bw:f}Mbit burst {burst} cburst {burst} quantum 1514"]
        return cmds, " parent 5:1 "


class PriorityTCIntf(WideTCIntf):
    """The link's HTB rate shared by one HTB class per DLCP class plus best effort.

    This kernel has no ``prio`` qdisc (nor netem); HTB's ``prio`` does the same job: each
    band is guaranteed 1% of the rate and may borrow up to all of it, and spare bandwidth goes
    to the lowest ``prio`` first, so a band is served only while every higher one is empty.
    ``u32`` filters on the IPv4 DSCP pick the band; each band queues at most
    ``links.BAND_FIFO_BYTES`` (bfifo), so under congestion the lowest bands drop first."""

    @classmethod
    def htb_cmds(cls, bw: float) -> tuple[list[str], str | None]:
        burst = max(15_000, int(bw * 1e6 / 8 / 1000))
        bands = len(P.PRIORITY_DSCP) + 1
        floor = max(bw / 100, 0.01)
        cmds = [f"%s qdisc add dev %s root handle 5:0 htb default {0x10 + bands - 1:x}",
                "%s class add dev %s parent 5:0 classid 5:1 htb "
                + f"rate {bw:f}Mbit burst {burst} cburst {burst} quantum 1514"]
        for b in range(bands):
            cmds += [f"%s class add dev %s parent 5:1 classid 5:{0x10 + b:x} htb "
                     f"rate {floor:f}Mbit ceil {bw:f}Mbit prio {b} burst {burst} "
                     f"cburst {burst} quantum 1514",
                     f"%s qdisc add dev %s parent 5:{0x10 + b:x} handle {0x20 + b:x}: "
                     f"bfifo limit {links.BAND_FIFO_BYTES}"]
        for dscp, b in links.band_of_dscp().items():
            cmds.append(f"%s filter add dev %s parent 5:0 protocol ip prio 1 u32 match ip "
                        f"dsfield {dscp << 2:#04x} 0xfc flowid 5:{0x10 + b:x}")
        return cmds, None


class ThcLink(TCLink):
    """TCLink with :class:`WideTCIntf` on both ends."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("cls1", WideTCIntf)
        kwargs.setdefault("cls2", WideTCIntf)
        super().__init__(*args, **kwargs)
