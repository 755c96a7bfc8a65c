"""The Mininet testbed: a star of worker hosts around one switch, plus the aggregator.

Topology (N workers)::

    h1 10.0.0.1 ──┐
    h2 10.0.0.2 ──┤
      ...         ├── switch thc<tag>s ── agg 10.0.0.100   (central software aggregator
    hN 10.0.0.N ──┘   (Linux bridge,                        only, link = agg_bw_factor x bw,
                       or BMv2 = aggregator 10.0.0.254)     default 1: equal links)

Worker r: interface h<r+1>-eth0, MAC 02:00:00:00:00:<r+1>, THC port 50000 + r, switch port
r + 1. Sharded (the default software layout): shard r of the job's shard map runs on worker
host h<r+1> at 10.0.0.<r+1>:48879 and shares that host's link. The aggregator host (port
N + 1) exists only for the central software aggregator; with BMv2 the switch answers for the
virtual aggregator address, which every worker has a static ARP entry for. All host pairs get
static ARP entries; IPv6 is off so no stray packets count.

Everything created in the root namespace is named after the testbed's tag and recorded by
:mod:`thc.emu.cleanup`, which tears it down at close and after a crash.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

from thc.codec.params import THCParams
from thc.net.client import GSO_ENV
from thc.wire import protocol as P
from thc.wire.jobs import SWITCH_AGG_IP, SWITCH_AGG_MAC, Cluster, Shard, Worker
from thc.emu import links, tclinks
from thc.emu.base import (
    AGG_IP,
    AGG_MAC,
    MASTER_PORT,
    REPO_ROOT,
    THC_BASE_PORT,
    Testbed,
    bmv2_unavailable_reason,
    make_job,
    say_once,
    worker_ip,
    worker_mac,
)
from thc.emu.errors import TestbedError
from thc.emu.nodeshell import node_run
from thc.emu.procs import Proc
from thc.emu.shellwatch import shell_exited, shell_stopped, watched
from thc.emu.cleanup import Registry, switch_name, undo
from thc.lifetime import signals_deferred, with_parent

BUILD_S = 180.0
"""How long building the testbed may take (seconds on a 2-core VM, a BMv2 switch's start
included) before its nodes' shells are killed and the build fails."""
STOP_S = 60.0
"""How long Mininet's stop may take (a few seconds on a 2-core VM) before its nodes' shells
are killed: the teardown holds Ctrl-C, so a wait there could not be ended."""


class MininetTestbed(Testbed):
    kind = "mininet"
    @property
    def gso(self) -> bool:
        """Whether hosts batch datagrams by UDP GSO/GRO, as TCP batches its segments (the FP32
        baselines' Gloo rings): only towards the software aggregator, and only on links
        without loss or class queues (a veth and its qdisc carry a burst as one skb, so a
        loss rule, or a band's tail drop under congestion, would drop the whole burst, where
        a network loses packets one by one: a full band would then refuse every burst,
        retransmissions included), and shaped (the shaper's counters count a burst's packets
        and headers; a veth's count one header)."""
        return (self.aggregator in ("software", "sharded") and not self.loss_pct
                and not self.priorities and self.bw_mbit is not None)

    @property
    def agg_link_args(self) -> tuple[str, ...]:
        return () if self.gso else ("--no-gso",)

    def env_for(self, node: str, env: dict | None = None) -> dict:
        full = super().env_for(node, env)
        if not (env and GSO_ENV in env):
            full[GSO_ENV] = "1" if self.gso else "0"
        return full

    def __init__(self, n_workers: int, bw_mbit: float | None = None, delay_ms: float = 0.0,
                 loss_pct: float = 0.0, aggregator: str = "software",
                 agg_bw_factor: float | None = None, params: THCParams | None = None,
                 lanes: int | None = None, pool_size: int | None = None, quiet: bool = True,
                 priorities: bool = False, loss_bound: float = 0.0):
        """``priorities``: every shaped link queues by DLCP class (tclinks.PriorityTCIntf)."""
        try:
            plan = links.plan(bw_mbit, delay_ms, loss_pct)
            factor = float(agg_bw_factor or 1.0)
            if aggregator == "software" and bw_mbit is not None:
                links.check_bw(bw_mbit * factor,
                               f"the aggregator's link ({bw_mbit:g} Mbit/s x {factor:g})")
        except links.LinkError as e:
            raise TestbedError(str(e)) from None
        if why := links.refusal(plan, bw_mbit, aggregator, priorities):
            raise TestbedError(why)
        if aggregator == "bmv2":
            why = bmv2_unavailable_reason()
            if why:
                raise TestbedError(f"the bmv2 aggregator is not available: {why}")
            if lanes not in (None, P.LANES):
                raise TestbedError(f"the BMv2 program aggregates {P.LANES} lanes per packet; "
                                   f"lanes={lanes} works with the software aggregator only")
            if pool_size and pool_size > P.SWITCH_SLOTS:
                raise TestbedError(f"pool_size {pool_size} exceeds the switch's "
                                   f"{P.SWITCH_SLOTS} slots")
        super().__init__(n_workers, aggregator, params, lanes, pool_size, loss_bound)
        self.bw_mbit = bw_mbit
        self.delay_ms = delay_ms
        self.loss_pct = loss_pct
        self.agg_bw_factor = factor
        self.link_plan = plan
        self.priorities = priorities
        self.notes = list(plan["notes"])
        for note in self.notes:
            say_once(note)
        self.net = None
        self.switch = None
        self.registry: Registry | None = None
        self._hold_signals()
        try:
            self.registry = Registry.allocate()
            self.registry.add_path(self.logdir)
            self.switch_name = switch_name(self.registry.tag)
            with watched(self._nodes, "building the Mininet testbed", BUILD_S):
                self._build(quiet)
        except BaseException:
            self.close()
            raise

    # -- bring-up ------------------------------------------------------------------------
    def _build(self, quiet: bool) -> None:
        from mininet.log import setLogLevel
        from mininet.net import Mininet
        from mininet.node import Host

        setLogLevel("error" if quiet else "info")
        n = self.n_workers
        reg = self.registry
        if self.aggregator == "bmv2":
            from thc.emu import bmv2
            switch_cls = bmv2.switch_class(self.logdir, reg)
        else:
            from mininet.nodelib import LinuxBridge
            switch_cls = LinuxBridge
        net = Mininet(controller=None, switch=switch_cls, link=tclinks.ThcLink, host=Host,
                      build=False, autoSetMacs=False, autoStaticArp=False,
                      waitConnected=False)
        self.net = net
        hosts = []
        for r in range(n):
            h = net.addHost(f"h{r + 1}", ip=f"{worker_ip(r)}/24", mac=worker_mac(r))
            reg.add_pid(h.pid)
            hosts.append(h)
        agg = None
        if self.aggregator == "software":
            agg = net.addHost("agg", ip=f"{AGG_IP}/24", mac=AGG_MAC)
            reg.add_pid(agg.pid)
        sw = net.addSwitch(self.switch_name, dpid=f"{reg.tag + 1:016x}")
        reg.add_pid(sw.pid)
        self.switch = sw
        link_kw = dict(self.link_plan["link"])
        if self.priorities:
            link_kw.update(cls1=tclinks.PriorityTCIntf, cls2=tclinks.PriorityTCIntf)
        if self.aggregator == "bmv2":
            # A software switch reading raw frames needs real checksums (Mininet's TCULink).
            link_kw.update(txo=False, rxo=False)
        for r, h in enumerate(hosts):
            net.addLink(h, sw, port1=0, port2=r + 1, **link_kw)
        if agg is not None:
            agg_kw = dict(link_kw)
            if self.bw_mbit is not None:
                agg_kw["bw"] = self.bw_mbit * self.agg_bw_factor
            net.addLink(agg, sw, port1=0, port2=n + 1, **agg_kw)
        reg.add_intfs([self.switch_name] + self.switch_ports())
        net.build()
        for node in hosts + ([agg] if agg else []):
            node.cmd("sysctl -qw net.ipv6.conf.all.disable_ipv6=1 "
                     "net.ipv6.conf.default.disable_ipv6=1")
        for name in self.switch_ports():
            _write(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6", "1")
        try:
            net.start()
        except RuntimeError as e:  # BMv2 failing to start
            raise TestbedError(str(e)) from None
        _write(f"/proc/sys/net/ipv6/conf/{self.switch_name}/disable_ipv6", "1")
        net.staticArp()
        if self.aggregator == "bmv2":
            for h in hosts:
                h.setARP(SWITCH_AGG_IP, SWITCH_AGG_MAC)
        q = self.link_plan["iptables_loss"]
        if q and self.aggregator == "bmv2":
            # a worker's path to the switch crosses its own link alone: that link loses
            # loss_pct each way, as netem on it would
            self.set_worker_loss(self.loss_pct)
        elif q:
            for node in hosts + ([agg] if agg else []):
                links.add_ingress_loss(node, node.defaultIntf().name, q)

        workers = [Worker(id=r, ip=worker_ip(r), port=THC_BASE_PORT + r, mac=worker_mac(r),
                          switch_port=r + 1) for r in range(n)]
        shards = ()
        if self.aggregator == "sharded":
            shards = tuple(Shard(worker_ip(r), P.UDP_PORT) for r in range(n))
        job = make_job(workers, self.params, self.lanes, self.pool_size, shards=shards,
                       loss_bound=self.loss_bound)
        if self.aggregator == "bmv2":
            self.cluster = Cluster(jobs=(job,), agg_ip=SWITCH_AGG_IP, agg_port=P.UDP_PORT,
                                   agg_mac=SWITCH_AGG_MAC)
            self.agg_addr = (SWITCH_AGG_IP, P.UDP_PORT)
        else:
            self.cluster = Cluster(jobs=(job,), agg_ip=AGG_IP, agg_port=P.UDP_PORT,
                                   agg_mac=AGG_MAC)
            if self.aggregator == "software":
                self.agg_addr = (AGG_IP, P.UDP_PORT)
        self.master_addr = (worker_ip(0), MASTER_PORT)

    def switch_ports(self) -> list[str]:
        return [i.name for i in self.switch.intfList() if i.name.startswith(self.switch_name)]

    # -- Testbed interface -----------------------------------------------------------------
    def worker_intf(self, rank: int) -> str:
        return f"h{rank + 1}-eth0"

    def host(self, node):
        """The Mininet host object of a worker rank or node name (``"agg"``)."""
        return self.net.get(self.node_of(node))

    def _launch(self, node, argv, env, stdout, stderr):
        try:
            host = self.net.get(node)
        except KeyError:
            raise TestbedError(f"no host {node!r} in this testbed") from None
        # killed (SIGKILL), the testbed leaves nothing serving: with_parent
        return host.popen(argv, env=env, cwd=str(REPO_ROOT), stdout=stdout, stderr=stderr,
                          stdin=subprocess.DEVNULL, preexec_fn=with_parent())

    def _registered(self, proc) -> None:
        self.registry.add_pid(proc.pid, group=True)

    def _start_other_aggregator(self) -> None:
        if self.aggregator == "bmv2":
            if not getattr(self, "_programmed", False):
                try:
                    self.switch.program(self.cluster_path)
                except RuntimeError as e:
                    raise TestbedError(str(e)) from None
                self._programmed = True
        else:
            raise TestbedError("this testbed has no aggregator (aggregator='none')")

    def restart_switch(self) -> float:
        """BMv2 only: crash the switch, start it again and let the controller push the
        program and install the cluster anew (new epoch). Returns the seconds it was gone."""
        if self.aggregator != "bmv2":
            raise TestbedError("only the bmv2 testbed has a switch to restart")
        import time
        t0 = time.perf_counter()
        self.switch.crash_and_restart()
        try:
            self.switch.program(self.cluster_path)
        except RuntimeError as e:
            raise TestbedError(str(e)) from None
        return time.perf_counter() - t0

    def set_worker_loss(self, loss_pct: float) -> None:
        """``loss_pct`` loss in both directions of every worker link, on the running testbed
        (0 removes it); see :func:`thc.emu.links.set_link_loss`."""
        if loss_pct and self.gso:
            raise TestbedError("this testbed's hosts send UDP GSO bursts, which a loss rule "
                               "drops whole: open it with loss_pct for per-packet loss")
        try:
            for r in range(self.n_workers):
                links.set_link_loss(self.host(r), self.worker_intf(r), loss_pct)
        except links.LinkError as e:
            raise TestbedError(str(e)) from None

    def worker_link_drops(self) -> int:
        """Packets the loss rules of :meth:`set_worker_loss` dropped so far, all links."""
        return sum(links.link_drops(self.host(r)) for r in range(self.n_workers))

    def switch_port_counters(self, port: int) -> tuple[int, int]:
        """(rx_bytes, tx_bytes) of switch port ``port``: what the two ends' shapers sent
        where links are shaped, else the port's own counters. A veth counts a TCP TSO skb
        or a UDP GSO burst with one header (100 MB over TCP: 100.10 MB there, 104.56 MB at
        the shaper), so only the shapers count what a wire would carry."""
        name = f"{self.switch_name}-eth{port}"
        if self.bw_mbit is not None:
            intf = self.switch.nameToIntf[name]
            link = intf.link
            peer = link.intf1 if link.intf2 is intf else link.intf2
            return _shaper_sent(peer.node, peer.name), _shaper_sent(intf.node, name)
        base = f"/sys/class/net/{name}/statistics"
        return int(_read(f"{base}/rx_bytes")), int(_read(f"{base}/tx_bytes"))

    def wire_bytes(self) -> dict[int, tuple[int, int]]:
        """Per worker (tx, rx) bytes on its link, as :meth:`switch_port_counters` reads them
        at the switch's port (the worker's transmit is the port's receive): the shapers'
        counts on shaped links, else the port's veth counters."""
        out = {}
        for r in range(self.n_workers):
            rx, tx = self.switch_port_counters(r + 1)
            out[r] = (rx, tx)
        return out

    def agg_wire_bytes(self) -> tuple[int, int] | None:
        """(tx, rx) of the software aggregator's link."""
        if self.aggregator != "software":
            return None
        rx, tx = self.switch_port_counters(self.n_workers + 1)
        return rx, tx

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with signals_deferred():
                self._kill_procs()
                lost = self._lost_shells()
                if lost:
                    say_once(f"the shell of Mininet node(s) {', '.join(lost)} exited (killed, "
                             f"or `mn -c` run on this machine); removing the testbed by hand "
                             f"(Mininet's stop would wait on that shell for good)")
                elif self.net is not None:
                    try:
                        self._stop_net()
                    except Exception as e:  # noqa: BLE001 - the registry undo still runs
                        say_once(f"Mininet stop failed ({type(e).__name__}: {e}); removing "
                                 f"leftovers by hand")
                if self.registry is not None:
                    state = self.registry.to_dict()
                    state["paths"] = []  # the log directory is _remove_logdir's call
                    undo(state)
                    self.registry.release()
                self._remove_logdir()
        finally:
            self._release_signals()

    def _check_forwarding(self) -> None:
        """A BMv2 switch forwards nothing, TCP between the hosts included, until its
        program is pushed: workers started before that would wait for their rendezvous
        until their timeout."""
        if self.aggregator == "bmv2" and not getattr(self, "_programmed", False):
            raise TestbedError("the BMv2 switch has no program yet, so it forwards nothing "
                               "between the hosts: start_aggregator() pushes it and "
                               "installs the job")

    def _watched_procs(self) -> list:
        """The aggregators, and a BMv2 switch: it runs outside every host."""
        watch = self._aggregator_procs()
        popen = getattr(self.switch, "proc", None) if self.aggregator == "bmv2" else None
        if popen is not None:
            known = getattr(self, "_switch_watch", None)
            if known is None or known.popen is not popen:   # a fault restarts the switch
                log = self.switch.log_path
                self._switch_watch = Proc("bmv2", popen, log, log, group=True)
            watch.append(("the BMv2 switch (simple_switch_grpc)", self._switch_watch))
        return watch

    def _stop_net(self) -> None:
        """Mininet's stop, which runs commands through every node's shell and reads their
        output with no deadline, while the teardown holds Ctrl-C: stopped shells are
        continued first, and past STOP_S the shells are killed and the read is interrupted
        (SIGUSR2 to the main thread, whose handler raises), so that the registry's undo
        removes the rest. Off the main thread no handler can be set: no deadline."""
        for n in self.net.values():
            if st := shell_stopped(n):
                say_once(f"the shell of Mininet node {n.name} was {st}: continued for the "
                         f"teardown")
                with contextlib.suppress(OSError):
                    os.kill(n.shell.pid, signal.SIGCONT)
        with watched(self._nodes, "Mininet's stop", STOP_S, shells_matter=False):
            self.net.stop()

    def _nodes(self) -> list:
        return [] if self.net is None else list(self.net.values())

    def _lost_shells(self) -> list[str]:
        """The Mininet nodes whose shell has exited."""
        return [n.name for n in self._nodes() if shell_exited(n)]


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError:
        pass


def _shaper_sent(node, intf: str) -> int:
    """Bytes the root qdisc of ``intf`` on ``node`` sent: it counts a GSO burst as its
    packets, each with its headers (the kernel's qdisc_pkt_len)."""
    out = node_run(node, f"tc -s -j qdisc show dev {intf}")
    try:
        roots = [q for q in json.loads(out) if q.get("root")]
        return int(roots[0]["bytes"])
    except (ValueError, LookupError, TypeError):
        raise TestbedError(f"no shaper statistics on {intf}: {out.strip()[:200]}") from None


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "0"


__all__ = ["MininetTestbed"]
