"""A barrier through BMv2: returns once the switch has handled every frame sent to it before
the call and every frame it sent because of them has reached the host side.

Each port sends the switch one barrier frame for each port: IPv4/UDP, DSCP 0, to a MAC that
l2_forward sends out of that port. A barrier frame from port A leaving at port X comes after
every frame the switch sent out of X because of a frame sent from A before it, as
simple_switch (behavioral-model 1.15.5, commit 9674187) handles packets:

* one thread reads the ports, each port's frames in order (src/BMI/bmi_port.c, run_select,
  l. 101-173), into one FIFO input buffer (simple_switch.cpp l. 109-186, 262) that one
  ingress thread empties (l. 271, 473-478);
* the ingress thread enqueues a packet's copies, multicast replicas included, before it
  takes the next packet (``enqueue``, ``multicast``: l. 398-420, 454-470, 619, 634);
* an egress thread serves each port (``port % 4``, simple_switch.h l. 140, 157-163). Within
  a port and priority it serves in enqueue order (send time ``max(now, last_sent)``, ties by
  a counter: bm_sim/queueing.h l. 528-546, 711-715, 764-767), and it serves the highest
  priority that holds a packet first (l. 561-598; no rate limits are set). A priority-0 frame
  (DSCP 0: thc_dscp's priority 0, the lowest) thus leaves after every packet enqueued before
  it for its port, whatever their priority;
* egress threads hand packets to one FIFO output buffer emptied by one transmit thread
  (simple_switch.cpp l. 379-390, 762).

A veth delivers its frames in order both ways, and LocalBMv2's receive thread hands a port's
frames on in order, so a barrier frame is seen after the replies sent before it. With one
barrier frame from every port to every port, the barrier holds for frames sent from any
port. The frames change no counter (l2_forward hits, a known DSCP, not THC's UDP port).
"""
from __future__ import annotations

import itertools
import queue
import struct
import time

from thc.controller import forwarding
from thc.controller.frames import udp_frame
from thc.controller.testing.bmv2 import LocalBMv2

IP = "10.254.0.1"
UDP_PORT = 9
SRC_MAC = "02:ba:00:00:01:00"
TOKEN = struct.Struct("!IBB")
"""Barrier frame payload: round, port sent from, port sent to."""

TIMEOUT = 30.0
"""Seconds a barrier waits: a switch this late has failed."""
RESEND = 2.0
"""Seconds after which the barrier frames still missing are sent again (a full pcap ring or
egress queue drops frames, barrier frames too)."""


def mac(port: int) -> str:
    """The MAC that l2_forward sends out of ``port``."""
    return f"02:ba:00:00:00:{port:02x}"


class SwitchBarrier:
    """``wait()``: every frame sent before it handled, every reply to it arrived."""

    def __init__(self, switch: LocalBMv2, timeout: float = TIMEOUT, resend: float = RESEND):
        self.switch = switch
        self.ports = range(switch.n_ports)
        self.timeout, self.resend = timeout, resend
        forwarding.install(switch.sw, {mac(p): p for p in self.ports})
        self.inbox = switch.register(IP, UDP_PORT)
        self._rounds = itertools.count(1)

    def frame(self, rnd: int, src: int, dst: int) -> bytes:
        return udp_frame(SRC_MAC, mac(dst), IP, IP, UDP_PORT, UDP_PORT,
                         TOKEN.pack(rnd, src, dst))

    def wait(self) -> None:
        rnd = next(self._rounds)
        missing = {(a, x) for a in self.ports for x in self.ports}
        end = time.monotonic() + self.timeout
        while True:
            for a, x in sorted(missing):
                self.switch.send(a, self.frame(rnd, a, x))
            again = min(time.monotonic() + self.resend, end)
            while missing and (left := again - time.monotonic()) > 0:
                try:
                    got = TOKEN.unpack(self.inbox.get(timeout=left))
                except queue.Empty:
                    break
                if got[0] == rnd:
                    missing.discard(got[1:])
            if not missing:
                return
            if time.monotonic() >= end:
                raise TimeoutError(self._why(missing))

    def _why(self, missing) -> str:
        proc = self.switch.proc
        if proc is not None and proc.poll() is not None:
            return f"barrier: simple_switch_grpc exited ({proc.returncode})"
        if len(missing) == len(self.ports) ** 2:
            which = "none of the barrier frames"
        else:
            which = "the barrier frames from->to " + ", ".join(f"{a}->{x}" for a, x in
                                                               sorted(missing))
        return (f"barrier: BMv2 forwarded {which} within {self.timeout:.0f}s (resent every "
                f"{self.resend:.0f}s): the switch stalls, or the l2_forward routes of "
                f"{mac(0)}.. are gone")
