"""What every testbed shares: addresses, the job a testbed runs, errors, probes, and the
:class:`Testbed` interface that thc.emu.testbed (loopback) and thc.emu.emulation (Mininet)
implement.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from thc.controller import toolchain
from thc.codec.params import THCParams
from thc.wire import protocol as P
from thc.wire.jobs import Cluster, ConfigError, Job, Shard, Worker
from thc.emu.aggprocs import AggregatorProcesses
from thc.lifetime import signals_raise
from thc.emu.errors import TestbedError
from thc.emu.procs import Proc, WorkerError, WorkerResult, merged_env, pythonize, wait_all

REPO_ROOT = Path(__file__).resolve().parents[2]
AGGREGATORS = ("sharded", "software", "bmv2", "none")
"""``sharded``: one `thc aggregator` shard on every worker host, each owning 1/N of the chunks
(THC's parameter-server layout); ``software``: one central `thc aggregator` on its own host;
``bmv2``: the switch aggregates; ``none``: no aggregator (Gloo modes)."""
THC_BASE_PORT = 50000
"""Worker r's THC UDP port (Mininet): 50000 + r."""
MASTER_PORT = 29500
SUBNET = "10.0.0.0/24"
MAX_TESTBED_WORKERS = min(P.MAX_WORKERS, 250)
"""Workers a testbed hosts: a job's bitmap, and the hosts of SUBNET beside the aggregator's."""
AGG_IP, AGG_MAC = "10.0.0.100", "02:00:00:00:00:64"
"""The software aggregator's host."""


def worker_ip(rank: int) -> str:
    return f"10.0.0.{rank + 1}"


def worker_mac(rank: int) -> str:
    return f"02:00:00:00:00:{rank + 1:02x}"


def make_job(workers: list[Worker], params: THCParams, lanes: int, pool_size: int,
             job_id: int = 1, shards: tuple[Shard, ...] = (), loss_bound: float = 0.0) -> Job:
    try:
        return Job(job_id=job_id, workers=tuple(workers),
                   table=tuple(int(t) for t in params.table), granularity=params.granularity,
                   pool_size=pool_size, lanes=lanes, shards=tuple(shards),
                   loss_bound=loss_bound).validate()
    except ConfigError as e:
        raise TestbedError(str(e)) from None


_said: set[str] = set()


def say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        print(f"thcnet: {msg}", file=sys.stderr, flush=True)


def mininet_unavailable_reason(aggregator: str = "software") -> str | None:
    """Why the Mininet testbed cannot run here, or None if it can."""
    if os.geteuid() != 0:
        return "not running as root (Mininet needs root)"
    try:
        import mininet.net  # noqa: F401
    except ImportError as e:
        return (f"the mininet Python module is missing ({e}); `make system-deps setup` installs "
                f"Debian's Mininet and links it into the venv")
    for tool in ("mnexec", "ip", "tc"):
        if not shutil.which(tool):
            return f"'{tool}' is not on PATH (install Mininet and iproute2)"
    if aggregator != "bmv2" and not shutil.which("brctl"):
        return "'brctl' is not on PATH (apt-get install bridge-utils)"
    return None


def bmv2_unavailable_reason() -> str | None:
    """Why the testbed cannot run BMv2 as its switch, or None (toolchain, then ethtool)."""
    why = toolchain.bmv2_missing()
    if why:
        return why
    if not shutil.which("ethtool"):
        return ("ethtool is missing (apt-get install ethtool): a software switch needs "
                "checksum offload off on its veths, or TCP through it fails")
    return None


class Testbed(AggregatorProcesses):
    """The interface both testbeds implement (see the module docstring)."""

    __test__ = False  # not a pytest test class
    kind = "abstract"
    agg_link_args: tuple[str, ...] = ()
    """Options the testbed's links need from ``thc aggregator``."""

    def __init__(self, n_workers: int, aggregator: str, params: THCParams | None,
                 lanes: int | None, pool_size: int | None, loss_bound: float = 0.0):
        if aggregator not in AGGREGATORS:
            raise TestbedError(f"aggregator must be one of {AGGREGATORS}, got {aggregator!r}")
        if not 1 <= n_workers <= MAX_TESTBED_WORKERS:
            raise TestbedError(f"n_workers must lie in 1..{MAX_TESTBED_WORKERS}, "
                               f"got {n_workers}")
        self.n_workers = n_workers
        self.aggregator = aggregator
        self.params = params or THCParams()
        # 0: the most lanes whose RESULT fits one MTU at the job's sum width
        sum_bits = P.sum_bits_for(n_workers, self.params.granularity)
        if lanes == 0:
            lanes = P.max_software_lanes(sum_bits)
        try:
            self.lanes = P.check_lanes(lanes or P.LANES, sum_bits=sum_bits)
        except ValueError as e:
            raise TestbedError(f"{n_workers} workers ({sum_bits}-bit sums): {e}") from None
        self.pool_size = pool_size or 64
        self.loss_bound = loss_bound
        """The job's DLCP loss bound (``Job.loss_bound``, in its cluster config): the fraction
        of a round's chunks a worker may close short."""
        self.python = sys.executable
        self.logdir = Path(tempfile.mkdtemp(prefix=f"thcnet-{self.kind}-"))
        self.master_addr: tuple[str, int] = ("127.0.0.1", MASTER_PORT)
        self.agg_addr: tuple[str, int] | None = None
        self.cluster: Cluster | None = None
        self.notes: list[str] = []
        self._procs: list[Proc] = []
        self.agg_proc: Proc | None = None
        """The software aggregator's process, where the testbed runs one (a fault row kills it)."""
        self._agg_final: dict | None = None
        self._shard_procs: list[Proc] = []
        self._last_run = 0
        self.agg_args: list[str] = []
        """Extra `thc aggregator` options (e.g. --dup 0.05) for the next start."""
        self._closed = False

    # -- to implement ------------------------------------------------------------------
    def _launch(self, node: str, argv: list[str], env: dict, stdout, stderr):
        raise NotImplementedError

    def worker_intf(self, rank: int) -> str:
        raise NotImplementedError

    def wire_bytes(self) -> dict[int, tuple[int, int]]:
        """Per worker (tx_bytes, rx_bytes) of its link, from interface counters ({} if none)."""
        return {}

    # -- shared --------------------------------------------------------------------------
    @property
    def cluster_path(self) -> Path:
        """The cluster config as JSON (for `thc aggregator --config`, the controller, workers)."""
        path = self.logdir / "cluster.json"
        if not path.exists():
            self.cluster.save(path)
        return path

    @property
    def job(self) -> Job:
        return self.cluster.jobs[0]

    def use_vote_job(self) -> Job:
        """Make the testbed's job a vote job (Marsit's signs counted by the aggregator): same
        id, workers and pool, lanes rounded down to whole sign bytes. Call before the
        aggregator starts (it reads the cluster then)."""
        import dataclasses
        if (self.logdir / "cluster.json").exists():
            raise TestbedError("use_vote_job: the cluster was already written")
        job = self.job
        try:
            vote = Job.vote(job.job_id, job.workers, pool_size=job.pool_size,
                            pool_base=job.pool_base, lanes=job.lanes // 8 * 8,
                            mcast_grp=job.mcast_grp).validate()
        except ConfigError as e:
            raise TestbedError(str(e)) from None
        self.cluster = dataclasses.replace(self.cluster, jobs=(vote,))
        return vote

    def node_of(self, rank_or_name) -> str:
        if isinstance(rank_or_name, int):
            if not 0 <= rank_or_name < self.n_workers:
                raise TestbedError(f"no worker {rank_or_name} (n_workers={self.n_workers})")
            return f"h{rank_or_name + 1}"
        return str(rank_or_name)

    def env_for(self, node: str, env: dict | None = None) -> dict:
        base = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        full = merged_env(env, {})
        for k, v in base.items():
            if not (env and k in env):
                full[k] = v
        path = [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
        if env and env.get("PYTHONPATH"):
            path = [str(REPO_ROOT)] + env["PYTHONPATH"].split(":")
        full["PYTHONPATH"] = ":".join(dict.fromkeys(path))
        own_ifname = env and "GLOO_SOCKET_IFNAME" in env
        if node.startswith("h") and node[1:].isdigit() and not own_ifname:
            full["GLOO_SOCKET_IFNAME"] = self.worker_intf(int(node[1:]) - 1)
        return full

    def popen(self, node, argv: list[str], env: dict | None = None,
              name: str | None = None) -> Proc:
        """Start ``argv`` on ``node`` (a worker rank, ``"h3"`` or ``"agg"``); it is killed at
        close."""
        self._check_open()
        node = self.node_of(node)
        argv = pythonize(argv, self.python)
        full_env = self.env_for(node, env)
        proc = Proc.start(name or f"{node}-{len(self._procs)}", argv, self.logdir,
                          lambda a, stdout, stderr: self._launch(node, a, full_env, stdout,
                                                                 stderr))
        self._procs.append(proc)
        self._registered(proc)
        return proc

    def _registered(self, proc: Proc) -> None:
        pass

    def run(self, node, argv: list[str], env: dict | None = None,
            timeout: float | None = 60.0) -> WorkerResult:
        """Run one command on ``node`` and wait for it; raises WorkerError if it fails."""
        proc = self.popen(node, argv, env)
        return wait_all([proc], timeout, what="command")[0]

    def new_run(self) -> int:
        """A run id newer than every one this testbed gave before (the clock's, or one more)."""
        run = P.run_from_clock()
        if self._last_run and not P.seq_newer(run, self._last_run):
            run = (self._last_run + 1) % P.SEQ_MOD or 1
        self._last_run = run
        return run

    def start_workers(self, argv_for: Callable[[int], list[str]], env: dict | None = None,
                      ranks=None) -> list[Proc]:
        """Start ``argv_for(rank)`` on the worker hosts as one run: they share a fresh
        ``THC_RUN`` (unless ``env`` gives one), so nothing of an earlier run counts in this one."""
        self._check_forwarding()
        env = dict(env or {})
        env.setdefault(P.RUN_ENV, str(self.new_run()))
        ranks = range(self.n_workers) if ranks is None else ranks
        return [self.popen(r, argv_for(r), env, name=f"worker{r}-{len(self._procs)}")
                for r in ranks]

    def _check_forwarding(self) -> None:
        """TestbedError where the hosts cannot reach each other yet (a testbed whose links
        are always up has nothing to check)."""

    def run_workers(self, argv_for: Callable[[int], list[str]], env: dict | None = None,
                    timeout: float | None = None, on_line=None) -> list[WorkerResult]:
        """Run ``argv_for(rank)`` on every worker host at once (one run) and wait for all.

        Raises :class:`WorkerError` (with each failing worker's stderr tail) if any worker
        exits non-zero, an aggregator process exits or the timeout passes; the others are
        then killed.
        """
        procs = self.start_workers(argv_for, env)
        watch = self._watched_procs()
        try:
            return wait_all(procs, timeout, what="worker", on_line=on_line, watch=watch)
        except WorkerError as e:
            for name, proc in watch:
                if proc.poll() is not None and f"--- {name} exited" not in str(e):
                    raise WorkerError(f"{e}\n--- {name} exited with code "
                                      f"{proc.popen.returncode}; stderr tail:\n"
                                      f"{proc.stderr()[-2000:]}", e.results,
                                      e.timed_out, e.states) from None
            raise

    def _watched_procs(self) -> list:
        """(name, process) of what the workers need besides each other: its exit ends
        their run, named."""
        return self._aggregator_procs()

    def _hold_signals(self) -> None:
        """SIGTERM and SIGHUP unwind to :meth:`close` from here on (the workers and
        aggregators run in sessions of their own, which the terminal's signals do not
        reach), and so does the interpreter's exit."""
        self._signals = signals_raise()
        self._signals.__enter__()
        atexit.register(self.close)

    def _release_signals(self) -> None:
        self._signals.__exit__(None, None, None)
        atexit.unregister(self.close)

    def _check_open(self) -> None:
        if self._closed:
            raise TestbedError("the testbed is closed")

    def _kill_procs(self) -> None:
        for proc in reversed(self._procs):
            try:
                proc.kill(grace=0.5)
            except Exception:  # noqa: BLE001 - keep tearing down
                pass

    def close(self) -> None:
        raise NotImplementedError

    def _remove_logdir(self) -> None:
        if os.environ.get("THCNET_KEEP_LOGS", "") not in ("", "0"):
            say_once(f"logs kept in {self.logdir}")
        else:
            shutil.rmtree(self.logdir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def describe(self) -> str:
        agg = f"{self.agg_addr[0]}:{self.agg_addr[1]}" if self.agg_addr else "none"
        if self.aggregator == "sharded":
            agg = ", ".join(f"{s.ip}:{s.port}" for s in self.job.shards)
        return (f"{self.kind} testbed: {self.n_workers} workers, aggregator {self.aggregator} "
                f"at {agg}, master {self.master_addr[0]}:{self.master_addr[1]}")
