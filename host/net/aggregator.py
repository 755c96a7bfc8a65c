"""Software aggregator: THC's parameter server, a UDP shell around the reference model.

The per-packet rules live in :mod:`thc.wire.model` (the executable form of
docs/protocol.md); this module adds what a server needs: a socket, a lock, the clock, a fresh
epoch at every install, and optional impairments of the replies (tests, fault matrix).
:mod:`thc.net.fastagg` runs the same rules with its datapath compiled (reply for reply,
tests/test_fastagg.py and tests/test_model_fuzz.py), and ``thc aggregator`` runs that one
when it is built, saying which datapath runs in its first line.
"""
from __future__ import annotations

import argparse
import math
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from time import monotonic

from thc.argtypes import non_negative_float, seconds
from thc.codec import settings
from thc.net.addresses import (PKTINFO_SPACE, answer_from_destination, destination,
                                parse_hostport, send_from)
from thc.net.impair import Impairment
from thc.net.report import Report
from thc.net.server import DATAGRAM_BYTES, RECEIVE_BUFFER, UDPServer
from thc.wire import protocol as P
from thc.wire.jobs import Cluster, ConfigError, Job
from thc.wire.model import Model, Reply


MAX_PEERS = 1 << 16
"""Peers whose local address a wildcard socket remembers (see ``Aggregator.serve``)."""
DRAIN = 1024
"""Datagrams read between looks at the stop flag: a flood never empties the socket."""
_JOB_ID = P.header_span("job_id")


class Aggregator(UDPServer):
    """The reference model (``handle``) plus an optional UDP server loop around it."""

    def __init__(self, jobs: list[Job] | tuple[Job, ...] = (), impair: Impairment | None = None,
                 nonce: int | None = None, shard: int | None = None,
                 run_idle: float = P.RUN_IDLE_S):
        """``nonce``: the low bits of the epochs of the jobs installed here (1..0xFFFF; the
        high bits are each job's configuration tag: :meth:`Job.new_epoch`), default a
        fresh one per install. ``shard``: this aggregator's index in the shard map of the
        jobs that have one."""
        self.model = Model(shard=shard, run_idle=run_idle)
        self._handle = self.model.handle
        self.shard = shard
        self.impair = impair or Impairment()
        self.send_errors = 0
        self._last_drop: str | None = None
        """The drop reason of the datagram :meth:`handle` took last (None: taken)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last_epoch: dict[int, int] = {}
        """Each job id's last epoch here, kept through a remove: the next install differs."""
        for job in jobs:
            self.install(job, nonce)

    @property
    def drops(self):
        return self.model.drops

    # -- control plane -------------------------------------------------------------
    def install(self, job: Job, nonce: int | None = None) -> None:
        """Install or re-install a job: its slots reset, no run, a new epoch (the job's tag
        and ``nonce`` or a fresh random one), as the controller installs a job on a switch."""
        with self._lock:
            epoch = job.new_epoch(self._last_epoch.get(job.job_id), nonce)
            self.model.install(job, epoch)
            self._last_epoch[job.job_id] = epoch

    def remove(self, job_id: int) -> None:
        with self._lock:
            self.model.remove(job_id)

    def counters(self) -> dict:
        """Counters of packets, completions, retransmissions and drops per reason."""
        with self._lock:
            jobs = self.model.jobs
            return {"drops": dict(self.model.drops),
                    "send_errors": self.send_errors,
                    "queue_overflow": self.queue_overflow(),
                    "epochs": {jid: s.epoch for jid, s in jobs.items()},
                    "jobs": {jid: dict(s.counters) for jid, s in jobs.items()}}

    # -- data plane ----------------------------------------------------------------
    def handle(self, datagram: bytes | memoryview, src: tuple[str, int]) -> list[Reply]:
        """Process one datagram from ``src``; return the datagrams to send and where."""
        with self._lock:
            replies, self._last_drop = self._handle(datagram, src, monotonic())
            return replies

    # -- UDP server ------------------------------------------------------------------
    def _serve(self, duration: float | None) -> None:
        sock = self._sock
        buf = bytearray(DATAGRAM_BYTES)
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        view = memoryview(buf)
        end = None if duration is None else time.monotonic() + duration
        impair = self.impair

        wildcard = answer_from_destination(sock)
        local: dict[tuple[bytes, tuple[str, int]], bytes] = {}
        """On a wildcard socket, per job id and worker address: the address of ours the
        worker last sent a datagram of the job that was taken to (not a drop or refusal: a
        stray or an older run's replay sent elsewhere would move it), which the job's
        RESULTs to it leave from, whichever worker's datagram completed the chunk. A reply
        to a datagram's sender leaves from where it was sent."""

        def sendto(data, dst, source=None) -> None:
            try:
                send_from(sock, data, dst, source)
            except OSError:
                self.send_errors += 1

        while not self._stop.is_set() and (end is None or time.monotonic() < end):
            wait = 0.05
            if impair.jitter:
                release = impair.next_release()
                wait = wait if release is None else min(wait, release)
            ready = poller.poll(math.ceil(wait * 1000))  # ms; any descriptor number
            if impair.jitter:
                impair.release_due()
            if not ready:
                impair.flush()
                continue
            for _ in range(DRAIN):  # then stop, the duration and jitter's releases are due
                try:
                    if wildcard:
                        nbytes, anc, _, src = sock.recvmsg_into([buf], PKTINFO_SPACE,
                                                                socket.MSG_DONTWAIT)
                        to = destination(anc)
                    else:
                        nbytes, src = sock.recvfrom_into(buf, DATAGRAM_BYTES,
                                                              socket.MSG_DONTWAIT)
                        to = None
                except BlockingIOError:
                    break
                replies = self.handle(view[:nbytes], src)
                if to is not None and self._last_drop is None:
                    if len(local) >= MAX_PEERS:
                        local.clear()
                    local[bytes(view[_JOB_ID]), src] = to
                for data, dst in replies:
                    source = ((to if dst == src else local.get((data[_JOB_ID], dst), to))
                              if wildcard else None)
                    if impair.active:
                        impair.send(sendto, data, dst, source)
                    else:
                        sendto(data, dst, source)
        impair.flush(everything=True)

    def _clear_stop(self) -> None:
        self._stop.clear()

    def _set_stop(self) -> None:
        self._stop.set()


# -- `thc aggregator` ---------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default=None, metavar="HOST:PORT",
                        help="UDP address to serve (default: 0.0.0.0 at the cluster file's "
                             "agg_port, where its workers send; with --shard, 0.0.0.0 at the "
                             "port the shard map gives the shard)")
    parser.add_argument("--config", required=True, help="cluster JSON (the controller's format)")
    parser.add_argument("--shard", type=int, default=None, metavar="INDEX",
                        help="run as this shard of the jobs' shard maps (sharded jobs only)")
    parser.add_argument("--stats-interval", type=non_negative_float, default=5.0,
                        help="print counters as a JSON line every N seconds, read every "
                             "0.5 s, and once at the end (0: at the end only; default: "
                             "%(default)s)")
    parser.add_argument("--stats-file", help="rewrite counters as JSON to this file while running")
    parser.add_argument("--duration", type=seconds,
                        help="exit after N seconds (default: serve until interrupted)")
    settings.add_arguments(parser, "aggregator_datapath")
    parser.add_argument("--no-gso", dest="gso", action="store_false",
                        help="compiled datapath: send every reply on its own, never as one UDP "
                             "GSO send per worker (emulated veth links would carry a GSO "
                             "burst as one packet)")
    Impairment.add_arguments(parser, "results")


def choose(datapath: str, jobs, impair: Impairment, gso: bool = True,
           shard: int | None = None):
    """The aggregator to run and how to name it: the compiled datapath unless told otherwise,
    it is not built, impairments are asked for (only the Python loop injects them), or the
    jobs use something it does not implement (:func:`thc.net.fastagg.unsupported`)."""
    from thc.net import fastagg

    if datapath == "python":
        return Aggregator(jobs, impair=impair, shard=shard), "python (as asked)"
    why_not = fastagg.UNAVAILABLE or ("impairment injection (--loss/--dup/--reorder/--jitter) "
                                      "runs in the Python datapath only" if impair.active
                                      else fastagg.unsupported(jobs))
    if why_not is None:
        return (fastagg.FastAggregator(jobs, gso=gso, shard=shard),
                "compiled (C, recvmmsg/sendmmsg" + (", UDP GSO)" if gso else ", no GSO)"))
    if datapath == "compiled":
        raise RuntimeError(f"--datapath compiled: {why_not}")
    return Aggregator(jobs, impair=impair, shard=shard), f"python ({why_not})"


def default_listen(cluster: Cluster, shard: int | None) -> str:
    """Where ``thc aggregator`` serves without ``--listen``: the cluster's ``agg_port`` on
    every address, where its workers send, or a shard's port in its jobs' shard map (a map
    that gives another shard's port on this host would otherwise have it refused at
    start)."""
    for job in cluster.jobs:
        if shard is not None and job.shards and 0 <= shard < job.n_shards:
            return f"0.0.0.0:{job.shards[shard].port}"
    return f"0.0.0.0:{cluster.agg_port}"


def central_address_note(cluster: Cluster, host: str, port: int) -> str | None:
    """What to say where the jobs without a shard map are served elsewhere than the
    cluster's ``agg_ip:agg_port``, where their workers send (None where they are not, or
    where the port is drawn by the system: a test's, told to its workers): a warning, not a
    refusal, as a forwarded port may bring the workers' packets here. A shard serves them
    too, at its own address."""
    central = [job.job_id for job in cluster.jobs if not job.shards]
    if port == 0 or not central:
        return None
    if port == cluster.agg_port and _bound_ip(host, port) in (cluster.agg_ip, "0.0.0.0"):
        return None
    which = "the cluster file's workers" if len(central) == len(cluster.jobs) else \
        f"the workers of jobs {central} (no shard map)"
    return (f"listening on {host}:{port}, but {which} send to {cluster.agg_ip}:"
            f"{cluster.agg_port} (agg_ip, agg_port): unless something forwards their packets "
            f"here, their rounds time out")


def _bound_ip(host: str, port: int) -> str:
    """``host`` as the socket binds it (a name resolved; itself where it resolves to
    nothing: the bind names that error)."""
    try:
        return socket.getaddrinfo(host, port, socket.AF_INET)[0][4][0] if host else "0.0.0.0"
    except OSError:
        return host


def check_shard_address(jobs, shard: int | None, host: str, port: int) -> None:
    """ConfigError unless ``host:port`` is the address every sharded job's map gives shard
    ``shard``: listening at another shard's address, it would refuse every chunk sent
    there as wrong_shard, so no round could complete: better refused at its start. A
    ``shard`` where no job has a shard map is refused too: the workers send every chunk to
    one central aggregator, which this is then, not a shard."""
    if shard is None:
        return
    if not any(job.shards for job in jobs):
        raise ConfigError(f"--shard {shard}: no job of the cluster file has a shard map, so "
                          f"its workers send every chunk to one central aggregator at agg_ip; "
                          f"run it without --shard")
    ip = _bound_ip(host, port)
    for job in jobs:
        if not job.shards or not 0 <= shard < job.n_shards:
            continue
        want = job.shards[shard]
        if port != want.port or ip not in (want.ip, "0.0.0.0"):
            raise ConfigError(f"--shard {shard} listens on {host}:{port}, but job {job.job_id}'s "
                              f"shard map puts shard {shard} at {want.ip}:{want.port}")


def _check_stats_file(path: str | None) -> None:
    """ValueError unless ``path`` (and its temporary neighbour) can be written: found at
    startup, not at the first write, after the aggregator was announced as serving."""
    if not path:
        return
    try:
        if Path(path).is_dir():
            raise IsADirectoryError(21, "is a directory")
        tmp = Path(path + ".tmp")
        tmp.write_text("")
        tmp.unlink()
    except OSError as e:
        raise ValueError(f"--stats-file {path}: cannot write it ({e.strerror})") from None


def _stop_on_signals() -> None:
    """Ctrl-C, SIGTERM and SIGHUP end the serving loop, which prints the final counters:
    Ctrl-C also where the aggregator starts with SIGINT ignored (a background job of a
    shell), SIGHUP only where it is not ignored (nohup: it serves on). The first signal
    stops it; a later one (Ctrl-C and a supervisor's SIGTERM together) does not cut the
    stop short."""
    stopping = []

    def stop(signum, frame):
        if not stopping:
            stopping.append(signum)
            raise KeyboardInterrupt
    hangup = [] if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else [signal.SIGHUP]
    for sig in (signal.SIGINT, signal.SIGTERM, *hangup):
        signal.signal(sig, stop)


def run(args: argparse.Namespace) -> int:
    try:
        cluster = Cluster.load(args.config)
        if not cluster.jobs:     # it would serve, dropping every packet as an unknown job's
            raise ConfigError(f"{args.config} holds no job to aggregate (its \"jobs\" list "
                              f"is empty or missing)")
        listen = args.listen or default_listen(cluster, args.shard)
        host, port = parse_hostport(listen)
    except (ConfigError, ValueError, OSError) as e:
        print(f"thc aggregator: {e}", file=sys.stderr)
        return 2
    try:
        impair = Impairment.from_args(args)
    except ValueError as e:
        print(f"thc aggregator: {e}", file=sys.stderr)
        return 2
    try:
        chosen = settings.from_args(args)   # ValueError: a bad flag or THC_* variable
        agg, datapath = choose(chosen.aggregator_datapath, cluster.jobs, impair, args.gso,
                               args.shard)
    except (ValueError, RuntimeError) as e:
        print(f"thc aggregator: {e}", file=sys.stderr)
        return 2
    try:
        check_shard_address(cluster.jobs, args.shard, host, port)
        _check_stats_file(args.stats_file)
    except ValueError as e:
        print(f"thc aggregator: {e}", file=sys.stderr)
        return 2
    _stop_on_signals()   # before the datapath serves: from then on a signal prints its counters
    try:
        addr = agg.start(host, port)
    except OSError as e:
        print(f"thc aggregator: cannot listen on {listen}: {e}", file=sys.stderr)
        return 2
    try:
        return _serve(args, agg, addr, datapath, chosen, cluster, host, port)
    finally:
        agg.stop()


def _serve(args, agg, addr, datapath: str, chosen, cluster, host: str, port: int) -> int:
    """Serve until the duration ends or a signal comes, then print the final counters."""
    report = Report(args.stats_file)
    end = None if args.duration is None else time.monotonic() + args.duration
    try:
        _announce(report, agg, addr, datapath, chosen, cluster, host, port, args.shard)
        last_print = time.monotonic()
        while end is None or time.monotonic() < end:
            time.sleep(0.5)
            if agg.error is not None:
                report.note(f"the datapath stopped: {type(agg.error).__name__}: {agg.error}")
                report.end()
                return 1
            stats = agg.counters()
            report.file(stats)
            if args.stats_interval and time.monotonic() - last_print >= args.stats_interval:
                last_print = time.monotonic()
                report.line(stats)
    except KeyboardInterrupt:
        pass
    finally:
        agg.stop()
    report.final(agg.counters())
    return 0


def _announce(report: Report, agg, addr, datapath: str, chosen, cluster, host: str, port: int,
              shard: int | None) -> None:
    """The startup lines: where it listens, for which jobs and epochs (the first line, on
    standard output), its settings and notes (standard error, as the report's notes)."""
    role = "" if shard is None else f" as shard {shard}"
    epochs = " ".join(f"{jid}:{e:#010x}" for jid, e in agg.counters()["epochs"].items())
    try:
        report.announce(f"thc aggregator listening on {addr[0]}:{addr[1]}{role} with jobs "
                        f"{[j.job_id for j in cluster.jobs]}, epochs {epochs}, datapath "
                        f"{datapath}")
    finally:   # an interrupt while the first line waits for its reader: the notes still go
        _notes(report, agg, chosen, cluster, host, port)


def _notes(report: Report, agg, chosen, cluster, host: str, port: int) -> None:
    report.note(chosen.describe())
    if note := central_address_note(cluster, host, port):
        report.note(note)
    if agg.receive_buffer < RECEIVE_BUFFER:
        report.note(f"the kernel granted {agg.receive_buffer >> 10} KiB of receive queue of "
                    f"the {RECEIVE_BUFFER >> 10} KiB asked (sysctl net.core.rmem_max): bursts "
                    f"beyond it are dropped, counted as queue_overflow")
