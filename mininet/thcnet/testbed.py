"""A testbed: N worker hosts, an aggregator, and a way to run processes on them.

Two implementations behind one interface, chosen by :func:`open_testbed`:

- ``MininetTestbed`` (``tb.kind == "mininet"``): worker hosts h1..hN (10.0.0.1..N), one switch
  (a Linux bridge, or BMv2 running p4src/build/thc.json); with ``aggregator="sharded"`` one
  aggregator shard on every worker host, with ``"software"`` the central aggregator on host
  ``agg`` (10.0.0.100) whose link is ``agg_bw_factor`` (default 1: equal links) times a
  worker's; links shaped with TCLink; static ARP.
- ``LoopbackTestbed`` (``tb.kind == "loopback"``): every "host" is 127.0.0.1 with its own
  ports, no link emulation. Used when not root, when Mininet is missing, or on request; it
  says so once, with the reason.

::

    with open_testbed(4, bw_mbit=100) as tb:
        tb.start_aggregator()
        results = tb.run_workers(lambda r: ["python", "-m", "my.worker", "--rank", str(r)])
        print(tb.wire_bytes())

Worker processes get the testbed's interpreter (``python`` in argv means ``sys.executable``),
PYTHONPATH with the repository root, one OpenMP/BLAS thread each (N workers share the
machine's cores), and ``GLOO_SOCKET_IFNAME`` naming their own interface so torch.distributed
binds the emulated link.
"""
from __future__ import annotations

import argparse
import shutil

from thc.argtypes import (loss_percent, memory_refusal, non_negative_float, non_negative_int,
                          positive_float, positive_int, seconds)
from thc.codec.params import THCParams
from thc.testing.clusters import free_port_block
from thc.wire.jobs import Cluster, Shard, Worker
from thc.emu.base import (
    AGGREGATORS,
    MAX_TESTBED_WORKERS,
    REPO_ROOT,
    Testbed,
    bmv2_unavailable_reason,
    make_job,
    mininet_unavailable_reason,
    say_once,
)
from thc.emu.errors import TestbedError, Unavailable
from thc.emu.procs import WorkerError, WorkerResult
from thc.lifetime import signals_deferred, with_parent

__all__ = ["open_testbed", "add_arguments", "add_link_arguments", "add_job_arguments",
           "loopback_conflict",
           "Testbed", "LoopbackTestbed", "WorkerResult", "WorkerError", "TestbedError",
           "Unavailable", "mininet_unavailable_reason", "bmv2_unavailable_reason",
           "AGGREGATORS"]


# -- loopback -------------------------------------------------------------------------------

class LoopbackTestbed(Testbed):
    """Every host is 127.0.0.1; ports keep them apart. No link emulation."""

    kind = "loopback"

    def __init__(self, n_workers: int, aggregator: str = "software",
                 params: THCParams | None = None, lanes: int | None = None,
                 pool_size: int | None = None, loss_bound: float = 0.0):
        if aggregator == "bmv2":
            raise TestbedError("the bmv2 aggregator needs the Mininet testbed (root and Mininet)")
        super().__init__(n_workers, aggregator, params, lanes, pool_size, loss_bound)
        try:
            self._plan(n_workers, aggregator)
        except BaseException:
            shutil.rmtree(self.logdir, ignore_errors=True)   # nothing else was started
            raise
        self._hold_signals()   # last, once nothing here can fail

    def _plan(self, n_workers: int, aggregator: str) -> None:
        """Ports and the cluster: a job the settings cannot make raises here."""
        base = free_port_block(2 * n_workers + 2, tcp=True)
        workers = [Worker(id=r, ip="127.0.0.1", port=base + r) for r in range(n_workers)]
        self.master_addr = ("127.0.0.1", base + n_workers)
        agg_port = base + n_workers + 1
        if aggregator == "software":
            self.agg_addr = ("127.0.0.1", agg_port)
        shards = ()
        if aggregator == "sharded":
            shards = tuple(Shard("127.0.0.1", agg_port + 1 + r) for r in range(n_workers))
        self.cluster = Cluster(jobs=(make_job(workers, self.params, self.lanes, self.pool_size,
                                              shards=shards, loss_bound=self.loss_bound),),
                               agg_ip="127.0.0.1", agg_port=agg_port)

    def worker_intf(self, rank: int) -> str:
        return "lo"

    def _launch(self, node, argv, env, stdout, stderr):
        import subprocess
        return subprocess.Popen(argv, env=env, cwd=str(REPO_ROOT), stdout=stdout, stderr=stderr,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=with_parent())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with signals_deferred():   # a second Ctrl-C left the log folder behind
                self._kill_procs()
                self._remove_logdir()
        finally:
            self._release_signals()


# -- factory --------------------------------------------------------------------------------

def open_testbed(n_workers: int, bw_mbit: float | None = None, delay_ms: float = 0.0,
                 loss_pct: float = 0.0, aggregator: str = "software", prefer_mininet: bool = True,
                 agg_bw_factor: float | None = None, params: THCParams | None = None,
                 lanes: int | None = None, pool_size: int | None = None,
                 quiet: bool = True, priorities: bool = False,
                 loss_bound: float = 0.0) -> Testbed:
    """Bring up a testbed (use it as a context manager: it always tears itself down).

    ``bw_mbit``/``delay_ms``/``loss_pct`` shape every worker link (both directions; the
    central aggregator's link gets ``agg_bw_factor`` x ``bw_mbit``, default 1: equal links);
    ``aggregator`` is ``"sharded"`` (a `thc aggregator` shard on every worker host),
    ``"software"`` (one central `thc aggregator` on host agg), ``"bmv2"`` (the switch itself)
    or ``"none"``; ``params``/``lanes``/``pool_size``/``loss_bound`` (DLCP's, the
    fraction of a round's chunks a worker may close short) shape the job in ``tb.cluster``;
    ``priorities`` queues every link by DLCP class (Mininet only). Falls back to the loopback
    testbed (printing why, once) when Mininet cannot run here or ``prefer_mininet`` is False;
    link parameters are then not emulated.
    """
    if aggregator not in AGGREGATORS:
        raise TestbedError(f"aggregator must be one of {AGGREGATORS}, got {aggregator!r}")
    reason = mininet_unavailable_reason(aggregator) if prefer_mininet else "asked for: --loopback"
    if reason is None:
        from thc.emu.emulation import MininetTestbed
        return MininetTestbed(n_workers, bw_mbit=bw_mbit, delay_ms=delay_ms, loss_pct=loss_pct,
                              aggregator=aggregator, agg_bw_factor=agg_bw_factor, params=params,
                              lanes=lanes, pool_size=pool_size, quiet=quiet,
                              priorities=priorities, loss_bound=loss_bound)
    if aggregator == "bmv2":
        raise TestbedError(f"the bmv2 aggregator needs Mininet, which is not available: {reason}")
    shaped = bw_mbit is not None or delay_ms or loss_pct
    say_once(f"using the loopback testbed ({reason})"
             + ("; bandwidth/delay/loss are NOT emulated" if shaped else ""))
    return LoopbackTestbed(n_workers, aggregator=aggregator, params=params, lanes=lanes,
                           pool_size=pool_size, loss_bound=loss_bound)


# -- flags ----------------------------------------------------------------------------------

def workers_arg(text: str) -> int:
    """A testbed's worker count, refused as the flag's (a count beyond the testbed's reached
    it only after the command's checks, as a traceback)."""
    n = positive_int(text)
    if n > MAX_TESTBED_WORKERS:
        raise argparse.ArgumentTypeError(f"a testbed hosts at most {MAX_TESTBED_WORKERS} "
                                         f"workers, not {n}")
    return n


def add_arguments(parser: argparse.ArgumentParser, *, timeout: float, loopback: bool = True,
                  timeout_help: str = "limit per mode, seconds") -> None:
    """The flags of a command that runs on a testbed: its workers, the limit per mode, and
    (``loopback``, where the command can run without Mininet) the loopback testbed's."""
    group = parser.add_argument_group("testbed")
    group.add_argument("--workers", type=workers_arg, default=4, help="worker hosts")
    group.add_argument("--timeout", type=seconds, default=timeout, help=timeout_help)
    if loopback:
        group.add_argument("--loopback", action="store_true",
                           help="do not use Mininet even where it is available: processes on "
                                "loopback, no link emulation")


def add_link_arguments(parser: argparse.ArgumentParser, *, bw: float | None) -> None:
    """Every worker link's bandwidth (``bw``: its default, Mbit/s; None: unshaped), delay and
    loss, as :func:`open_testbed` takes them."""
    group = parser.add_argument_group("links")
    group.add_argument("--bw", type=positive_float, default=bw, metavar="MBIT",
                       help="worker link bandwidth, Mbit/s (default: "
                            + ("unshaped)" if bw is None else f"{bw:g})"))
    group.add_argument("--delay", type=non_negative_float, default=0.0, metavar="MS",
                       help="per-link delay, ms (needs netem in the kernel)")
    group.add_argument("--loss", type=loss_percent, default=0.0, metavar="PCT",
                       help="per-link loss, percent")


def loopback_conflict(args: argparse.Namespace, unavailable: str | None = None, *,
                      bw_default: float | None = None) -> str | None:
    """Why the loopback cannot run with the links asked for (None: it can): it emulates no
    bandwidth, delay or loss, and a run that asked for them would measure none. The run goes
    to the loopback with ``--loopback``, or where Mininet cannot run it (``unavailable``:
    why). A ``--bw`` other than the command's default (``bw_default``) counts as asked."""
    bw = getattr(args, "bw", None)
    asked = ([f"--bw {bw:g}"] if bw is not None and bw != bw_default else []) + [
        f"--{name} {getattr(args, name):g}" for name in ("delay", "loss")
        if getattr(args, name, 0)]
    if not asked:
        return None
    need = f"{' and '.join(asked)} need emulated links (Mininet)"
    if getattr(args, "loopback", False):
        return f"{need}: not with --loopback"
    if unavailable:
        return f"{need}, which cannot run here ({unavailable})"
    return None


def agg_bw_conflict(args: argparse.Namespace, central: bool) -> str | None:
    """Why ``--agg-bw-factor`` would shape nothing (None: it shapes the central aggregator's
    link): no central aggregator runs (``central`` false), or no link is shaped."""
    if getattr(args, "agg_bw_factor", None) is None:
        return None
    if not central:
        return "--agg-bw-factor shapes the central aggregator's link, and none runs here"
    if getattr(args, "loopback", False) or not getattr(args, "bw", None):
        return "--agg-bw-factor scales --bw on emulated links: give --bw, without --loopback"
    return None


WORKER_BYTES_PER_ELEMENT = 16
"""Memory a worker takes per gradient element, an estimate: its float32 vector, encoding,
sum and decoding."""


def memory_conflict(workers: int, numel: int) -> str | None:
    """Why ``workers`` workers of ``numel`` elements each would not fit this machine, where
    every worker runs (None: they fit)."""
    return memory_refusal(workers * numel * WORKER_BYTES_PER_ELEMENT,
                          f"--workers {workers} of --numel {numel}")


def add_job_arguments(parser: argparse.ArgumentParser, *, lanes: int | None,
                      pool_size: int | None, window: int | None) -> None:
    """The testbed job's shape and the workers' window (each argument: the flag's default;
    None leaves it to the testbed or the client), and the central aggregator's link."""
    group = parser.add_argument_group("job")
    group.add_argument("--lanes", type=non_negative_int, default=lanes,
                       help="lanes per packet of the software aggregators (0: the most that "
                            "fit one MTU at the job's sum width; BMv2 runs its compiled lanes)")
    group.add_argument("--pool-size", type=positive_int, default=pool_size,
                       help="slots of the job (a --window beyond it is cut to it; default "
                            + ("64)" if pool_size is None else f"{pool_size})"))
    group.add_argument("--window", type=positive_int, default=window,
                       help="chunks in flight per worker: more only queue in the aggregator "
                            "and invite spurious retransmissions")
    group.add_argument("--agg-bw-factor", type=positive_float, default=None,
                       help="the central aggregator's link = factor x a worker's (default 1: "
                            "equal links)")
