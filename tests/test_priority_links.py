"""Mininet's class-queued links (tclinks.PriorityTCIntf): DSCP picks the HTB band, for real.

The link's tc commands run in a throw-away network namespace (no Mininet needed); UDP
packets marked with each class leave through it and the band counters say where they went.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap

import pytest

from thc.wire import protocol as P

pytest.importorskip("mininet")   # the one module whose absence skips: a project module's fails
from thc.emu import links, tclinks  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("tc"),
    reason="needs root, unshare and tc")


def _through_the_link(tc: str, py: str, show: str) -> str:
    """In a throw-away namespace: veth va (10.9.0.1, with the link's ``tc`` commands) to a
    static neighbour 10.9.0.2, the Python ``py`` sending, then ``tc -s <show> show dev va``."""
    script = ("set -e; sysctl -qw net.ipv6.conf.all.disable_ipv6=1 "
              "net.ipv6.conf.default.disable_ipv6=1; ip link add va type veth peer name vb; "
              "ip addr add 10.9.0.1/24 dev va; "
              "ip link set va up; ip link set vb up; ip neigh add 10.9.0.2 lladdr "
              f"02:00:00:00:00:02 dev va\n{tc}\npython3 -c '{py}'\ntc -s {show} show dev va")
    r = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_each_dscp_class_is_queued_in_its_band_and_others_go_best_effort():
    cmds, _ = tclinks.PriorityTCIntf.htb_cmds(10.0)
    tc = "\n".join(c % ("tc", "va") for c in cmds)
    sends = {dscp: 3 + k for k, dscp in enumerate(P.PRIORITY_DSCP)}
    sends.update({0: 2, 5: 1})                          # best effort and an unknown DSCP
    py = textwrap.dedent(f"""
        import socket
        for dscp, n in {sends!r}.items():
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
            for _ in range(n):
                s.sendto(b"x" * 100, ("10.9.0.2", 9))
    """)
    sent = {}
    for block in _through_the_link(tc, py, "class").split("class htb ")[1:]:
        classid = block.split()[0]
        sent[classid] = int(block.split(" Sent ")[1].split()[2])
    bands = links.band_of_dscp()
    best = len(P.PRIORITY_DSCP)
    want = {f"5:{0x10 + b:x}": 0 for b in range(best + 1)}
    for dscp, n in sends.items():
        want[f"5:{0x10 + bands.get(dscp, best):x}"] += n
    assert {k: sent[k] for k in want} == want
    assert bands[P.PRIORITY_DSCP[-1]] == 0, "the top class is served first"


def test_a_band_holds_bytes_not_packets():
    """A band's queue counted packets (100): a burst of small datagrams lost all but 100 of
    them where a switch's buffer of the same bytes holds them all, and a UDP GSO burst of up
    to 64 datagrams took one place. 1000 datagrams of 142 bytes on the wire, sent at once
    into a 0.1 Mbit/s link, fit its 100 full frames' bytes."""
    cmds, _ = tclinks.PriorityTCIntf.htb_cmds(0.1)
    tc = "\n".join(c % ("tc", "va") for c in cmds)
    py = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
          "[s.sendto(b\"x\" * 100, (\"10.9.0.2\", 9)) for _ in range(1000)]")
    best = f"{0x20 + len(P.PRIORITY_DSCP):x}:"
    block = re.search(rf"qdisc \w+ {best}(.*?)(?=qdisc |\Z)", _through_the_link(tc, py, "qdisc"),
                      re.S).group(1)
    assert "(dropped 0," in block, block
    queued = int(block.split("backlog ")[1].split("b ")[1].split("p")[0])
    assert int(block.split(" Sent ")[1].split()[2]) + queued == 1000 and queued > 100, block
