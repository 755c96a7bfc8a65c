"""A row of the fault matrix and how a row runs: workers streaming real chunks
(:mod:`thc.emu.smoke_worker`), their results checked bit for bit, the aggregator's counters
before and after; and the helpers the rows share (the controller, the P4 build's state)."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from thc.controller.toolchain import BUILD_DIR
from thc.emu.base import REPO_ROOT
from thc.emu.procs import Proc
from thc.emu.testbed import TestbedError


N_WORKERS = 4
SEED = 4242
_launches = itertools.count()


def launch_seed() -> int:
    """A seed of its own for each launch of workers (SEED, SEED + 100, ...; worker r draws
    from seed + r): a result replayed from an earlier launch, after a restart or to a
    relaunched run, does not match this launch's reference."""
    return SEED + 100 * next(_launches)


@dataclass
class Row:
    name: str
    testbed: str = "-"
    sums: str = "-"
    rounds: int | str = "-"
    retransmissions: int | str = "-"
    seconds: float | None = None
    drops: dict = field(default_factory=dict)
    note: str = ""
    exact: bool | None = None
    """True: every sum checked was exact; False: a wrong sum (the matrix then fails)."""
    stream_seconds: float = 0.0
    """The slowest worker's time inside aggregate() (no process start, no reference)."""
    unfired: str = ""
    """Why the row's fault did not happen (its sums then show nothing about the fault)."""

    def not_fired(self, why: str) -> "Row":
        """The row ran but its fault did not happen as planned: exact sums prove nothing
        about it, so the row is not counted as exact."""
        self.unfired = why
        self.sums = f"fault not shown ({why}): {self.sums}"
        if self.exact:
            self.exact = None
        return self


# -- running workers --------------------------------------------------------------------------

MID_STREAM_ROUNDS = 1000
"""Vectors the kill/restart rows stream: the fault must land mid-stream however fast the
client is (the compiled window finishes one quick-mode vector in well under a second)."""


def worker_argv(tb, numel: int, rounds: int = 1, deadline: float = 10.0,
          per_rank: dict[int, dict] | None = None, **impair):
    """smoke_worker's command line for each rank of one launch (its own seed:
    :func:`launch_seed`): ``impair`` options for all (``out_of_step`` becomes
    ``--out-of-step``), ``per_rank[rank]`` options for that rank only."""
    cfg, agg = str(tb.cluster_path), f"{tb.agg_addr[0]}:{tb.agg_addr[1]}"
    seed = launch_seed()

    def argv(rank: int) -> list[str]:
        a = ["python", "-m", "thc.emu.smoke_worker", "--rank", str(rank), "--config", cfg,
             "--agg", agg, "--numel", str(numel), "--seed", str(seed), "--rounds", str(rounds),
             "--deadline", str(deadline)]
        for k, v in {**impair, **(per_rank or {}).get(rank, {})}.items():
            a += [f"--{k.replace('_', '-')}", str(v)]
        return a
    return argv


def wait_workers(procs: list[Proc], timeout: float) -> list[dict]:
    """Each worker's JSON line (or a crash record); kills what is left after ``timeout``.
    A worker whose line says it succeeded but which exited with an error counts as crashed:
    what failed after the line may have been part of its result."""
    end = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(0.1)
    out = []
    for rank, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
            out.append({"rank": rank, "error": "hung", "message": f"still running after "
                        f"{timeout:.0f}s", "stats": {}})
            continue
        lines = [ln for ln in p.stdout().splitlines() if ln.startswith("{")]
        if not lines:
            out.append({"rank": rank, "error": "crashed", "message": p.stderr()[-400:],
                        "stats": {}})
            continue
        line = json.loads(lines[-1])
        if p.poll() and "error" not in line and not line.get("mismatches"):
            line = {**line, "error": "crashed", "message": f"exited {p.poll()} after its "
                    f"result line: {p.stderr()[-300:]}"}
        out.append(line)
    return out


def live_counters(tb) -> dict:
    """The aggregator's counters now: the software aggregator's stats file (at most 0.5 s
    old), or the switch's counters read through the controller (`thc controller counters`)."""
    if tb.aggregator == "bmv2":
        try:
            return json.loads(tb.switch.counters())
        except ValueError:
            return {"drops": {}, "jobs": {}}
    return tb.aggregator_counters() or {"drops": {}, "jobs": {}}


def counters_of(tb) -> dict:
    """The aggregator's counters including everything that completed before the call."""
    if tb.aggregator != "bmv2":
        return tb.fresh_aggregator_counters() or {"drops": {}, "jobs": {}}
    return live_counters(tb)


def delta(before: dict, after: dict) -> tuple[int, dict]:
    job = str(1)
    b, a = before.get("jobs", {}).get(job, {}), after.get("jobs", {}).get(job, {})
    rounds = a.get("completions", 0) - b.get("completions", 0)
    if after.get("epochs", {}).get(job) != before.get("epochs", {}).get(job):
        rounds = a.get("completions", 0)
        b = {}
    drops = {k: v - before.get("drops", {}).get(k, 0) for k, v in after.get("drops", {}).items()}
    return rounds, {k: v for k, v in drops.items() if v}


def check_sums(results: list[dict]) -> tuple[str, bool | None, int]:
    """('exact, 4/4 workers' | ..., exact?, retransmissions) of a finished run."""
    ok = [r for r in results if "error" not in r]
    wrong = sum(r.get("mismatches", 0) for r in results)
    retx = sum(r.get("stats", {}).get("retransmitted", 0) for r in results)
    if wrong:
        seeds = sorted({r["seed"] for r in results if "seed" in r})
        return (f"WRONG: {wrong} sums differ (seed {', '.join(map(str, seeds))})", False,
                retx)
    if len(ok) == len(results):
        return f"exact ({len(ok)}/{len(results)} workers)", True, retx
    causes = sorted({r["error"] for r in results if "error" in r})
    return (f"exact where returned ({len(ok)}/{len(results)} finished; others: "
            f"{', '.join(causes)})", True if ok else None, retx)


def stream_row(name: str, tb, numel: int, rounds: int = 1, note: str = "",
                timeout: float = 300.0, **impair) -> Row:
    before = counters_of(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(worker_argv(tb, numel, rounds, **impair))
    results = wait_workers(procs, timeout)
    seconds = time.perf_counter() - t0
    done, drops = delta(before, counters_of(tb))
    sums, exact, retx = check_sums(results)
    return Row(name, testbed_label(tb), sums, done, retx, seconds, drops, note, exact,
               max(r.get("seconds", 0.0) for r in results))


def testbed_label(tb) -> str:
    return "mininet+bmv2" if tb.aggregator == "bmv2" else tb.kind


def progress(tb, before: dict, chunks: int, timeout: float = 60.0) -> int:
    """Wait until ``chunks`` more chunks completed (the stream is mid-flight); returns how
    many the last reading showed (more on BMv2, whose counters take a controller run)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, _ = delta(before, live_counters(tb))
        if done >= chunks:
            return done
        time.sleep(0.1)
    raise TestbedError(f"the stream did not reach {chunks} chunks within {timeout:.0f}s")


def stream_for(name: str, tb, numel: int, seconds: float, note: str, **kw) -> Row:
    """Workers aggregate the vector round after round for about ``seconds``; then the
    driver halts them, names the round count after the one they halted at (``smoke_worker
    --until``) and all stop there, each having checked every round."""
    until = until_dir(tb)
    before = counters_of(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(worker_argv(tb, numel, rounds=1 << 30, deadline=30.0,
                                   until=str(until), **kw))
    while time.perf_counter() - t0 < seconds and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    halt(until, procs)
    results = wait_workers(procs, 300)
    elapsed = time.perf_counter() - t0
    rounds, drops = delta(before, counters_of(tb))
    sums, exact, retx = check_sums(results)
    vectors = sorted({r.get("rounds", 0) for r in results})
    return Row(name, testbed_label(tb), sums, rounds, retx, elapsed, drops,
               f"{'/'.join(map(str, vectors))} vectors of {numel} elements per worker, each "
               f"checked; {note}", exact)


def until_dir(tb) -> Path:
    """A fresh folder for ``smoke_worker --until`` (:func:`halt`)."""
    until = tb.logdir / f"until-{time.monotonic_ns()}"
    until.mkdir()
    return until


def halt(until: Path, procs) -> None:
    """Stop workers streaming with ``smoke_worker --until until``: ask them to halt, then
    name the round count after the one the first halted at; all stop there."""
    (until / "halt").touch()
    end = time.monotonic() + 60
    while not any(until.glob("done-*")) and any(p.poll() is None for p in procs):
        if time.monotonic() > end:
            raise TestbedError("no worker halted within 60 s of the request")
        time.sleep(0.01)
    done = [int(f.read_text() or 0) for f in until.glob("done-*")]
    stop = max(done, default=0) + 1
    (until / "stop.tmp").write_text(str(stop))
    (until / "stop.tmp").rename(until / "stop")


def p4_build_stale() -> str | None:
    r = subprocess.run([sys.executable, str(REPO_ROOT / "p4src" / "gen_p4.py"), "--check"],
                       capture_output=True, text=True, cwd=str(REPO_ROOT))
    if r.returncode:
        return ("the committed P4 build does not match protocol.json (p4src/gen_p4.py "
                "--check fails; `make p4` rebuilds it)")
    return None


def controller_cmd(tb, *args: str) -> str:
    """One run of `thc controller` against the testbed's switch: a fresh controller process."""
    argv = [sys.executable, "-m", "thc.cli", "controller", "--grpc-addr",
            tb.switch.grpc_addr, "--device-id", "0", "--build-dir", str(BUILD_DIR), *args]
    r = subprocess.run(argv, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise TestbedError(f"thc controller {' '.join(args)} failed: "
                           f"{(r.stderr or r.stdout).strip()[-1000:]}")
    return r.stdout

