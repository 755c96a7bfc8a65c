"""``thc faults``: the fault matrix. Every row streams real chunks through an aggregator under
one fault and checks every worker's sums bit for bit against a reference computed from the
indices sent (:mod:`thcnet.smoke_worker`); ``make faults`` writes the table to docs/faults.md.

Rows, on the software aggregator and again on BMv2: loss on the worker links (Mininet:
iptables/nftables statistic drops, or netem), duplication, reordering and jitter (the
transport's :class:`host.net.impair.Impairment`; on BMv2 the workers' side only), a worker
killed mid-round and the run restarted, the aggregator restarted mid-stream (on BMv2 the
switch crashed, restarted and re-programmed), an out-of-step worker (its process also sends
MAX packets at its DATA chunks' seqs), forged replies from a process that is not the
aggregator, a relaunch under a reused run id, bounded loss (DLCP) with a straggler, and 8
workers streaming for a minute; on BMv2 also the controller restarted and a job re-installed
while another runs. A row that cannot run here says why instead of a figure.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from controller.toolchain import BUILD_DIR
from host.wire import protocol as P
from thcnet.base import REPO_ROOT, bmv2_unavailable_reason
from thcnet.links import netem_available
from thcnet.procs import Proc
from thcnet.testbed import TestbedError, open_testbed

N_WORKERS = 4
SEED = 4242


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="smaller vectors and a 10 s stream instead of 60 s")
    parser.add_argument("--out", default=str(REPO_ROOT / "docs" / "faults.md"))
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--loopback", action="store_true", help="do not use Mininet")
    parser.add_argument("--only", default="",
                        help="comma-separated row keys or their prefixes: loss (loss-1, "
                             "loss-5, loss-20), dup, reorder, jitter, worker, aggregator, "
                             "out-of-step, spoofed, reused-run, straggler, stream, bmv2 "
                             "(bmv2-matrix-loss, ..., bmv2-matrix-out-of-step, "
                             "bmv2-matrix-spoofed, bmv2-matrix-reused-run, "
                             "bmv2-matrix-straggler, bmv2-controller, bmv2-stream); prints "
                             "the table instead of writing --out")


# -- running workers --------------------------------------------------------------------------

MID_STREAM_ROUNDS = 1000
"""Vectors the kill/restart rows stream: the fault must land mid-stream however fast the
client is (the compiled window finishes one quick-mode vector in well under a second)."""


def _argv(tb, numel: int, rounds: int = 1, deadline: float = 10.0,
          per_rank: dict[int, dict] | None = None, **impair):
    """smoke_worker's command line for each rank: ``impair`` options for all (``out_of_step``
    becomes ``--out-of-step``), ``per_rank[rank]`` options for that rank only."""
    cfg, agg = str(tb.cluster_path), f"{tb.agg_addr[0]}:{tb.agg_addr[1]}"

    def argv(rank: int) -> list[str]:
        a = ["python", "-m", "thcnet.smoke_worker", "--rank", str(rank), "--config", cfg,
             "--agg", agg, "--numel", str(numel), "--seed", str(SEED), "--rounds", str(rounds),
             "--deadline", str(deadline)]
        for k, v in {**impair, **(per_rank or {}).get(rank, {})}.items():
            a += [f"--{k.replace('_', '-')}", str(v)]
        return a
    return argv


def _wait(procs: list[Proc], timeout: float) -> list[dict]:
    """Each worker's JSON line (or a crash record); kills what is left after ``timeout``."""
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
        else:
            out.append(json.loads(lines[-1]))
    return out


def _live_counters(tb) -> dict:
    """The aggregator's counters now: the software aggregator's stats file (at most 0.5 s
    old), or the switch's counters read through the controller (`thc controller counters`)."""
    if tb.aggregator == "bmv2":
        try:
            return json.loads(tb.switch.counters())
        except ValueError:
            return {"drops": {}, "jobs": {}}
    return tb.aggregator_counters() or {"drops": {}, "jobs": {}}


def _counters(tb) -> dict:
    """The aggregator's counters including everything that completed before the call."""
    if tb.aggregator != "bmv2":
        return tb.fresh_aggregator_counters() or {"drops": {}, "jobs": {}}
    return _live_counters(tb)


def _delta(before: dict, after: dict) -> tuple[int, dict]:
    job = str(1)
    b, a = before.get("jobs", {}).get(job, {}), after.get("jobs", {}).get(job, {})
    rounds = a.get("completions", 0) - b.get("completions", 0)
    if after.get("epoch") != before.get("epoch"):
        rounds = a.get("completions", 0)
        b = {}
    drops = {k: v - before.get("drops", {}).get(k, 0) for k, v in after.get("drops", {}).items()}
    return rounds, {k: v for k, v in drops.items() if v}


def _check(results: list[dict]) -> tuple[str, bool | None, int]:
    """('exact, 4/4 workers' | ..., exact?, retransmissions) of a finished run."""
    ok = [r for r in results if "error" not in r]
    wrong = sum(r.get("mismatches", 0) for r in results)
    retx = sum(r.get("stats", {}).get("retransmitted", 0) for r in results)
    if wrong:
        return f"WRONG: {wrong} sums differ", False, retx
    if len(ok) == len(results):
        return f"exact ({len(ok)}/{len(results)} workers)", True, retx
    causes = sorted({r["error"] for r in results if "error" in r})
    return (f"exact where returned ({len(ok)}/{len(results)} finished; others: "
            f"{', '.join(causes)})", True if ok else None, retx)


def _stream_row(name: str, tb, numel: int, rounds: int = 1, note: str = "",
                timeout: float = 300.0, **impair) -> Row:
    before = _counters(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(_argv(tb, numel, rounds, **impair))
    results = _wait(procs, timeout)
    seconds = time.perf_counter() - t0
    done, drops = _delta(before, _counters(tb))
    sums, exact, retx = _check(results)
    return Row(name, _label(tb), sums, done, retx, seconds, drops, note, exact,
               max(r.get("seconds", 0.0) for r in results))


def _label(tb) -> str:
    return "mininet+bmv2" if tb.aggregator == "bmv2" else tb.kind


def _progress(tb, before: dict, chunks: int, timeout: float = 60.0) -> int:
    """Wait until ``chunks`` more chunks completed (the stream is mid-flight); returns how
    many the last reading showed (more on BMv2, whose counters take a controller run)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, _ = _delta(before, _live_counters(tb))
        if done >= chunks:
            return done
        time.sleep(0.1)
    raise TestbedError(f"the stream did not reach {chunks} chunks within {timeout:.0f}s")


# -- rows ---------------------------------------------------------------------------------------

def row_loss(pct: float, numel: int, prefer_mininet: bool) -> Row:
    with open_testbed(N_WORKERS, loss_pct=pct, prefer_mininet=prefer_mininet) as tb:
        tb.start_aggregator()
        notes = " ".join(getattr(tb, "link_plan", {}).get("notes", []))
        how = ("iptables statistic drops on each host's ingress (this kernel has no netem), "
               "the same end-to-end loss as on both links" if "iptables" in notes else "netem")
        if tb.kind != "mininet":
            row = _stream_row(f"{pct:g}% loss", tb, numel, loss=pct / 100,
                              note="loopback: loss injected by the transport on sent chunks")
        else:
            row = _stream_row(f"{pct:g}% loss", tb, numel,
                              note=f"{pct:g}% loss on every worker link and the aggregator's: "
                                   f"{how}")
    return row


def row_impair(tb, name: str, numel: int, **impair) -> Row:
    """Duplication or reordering on both directions: workers' chunks and the results."""
    tb.stop_aggregator()
    tb.agg_args = [x for k, v in impair.items() for x in (f"--{k}", str(v))]
    tb.start_aggregator()
    try:
        what = ", ".join(f"{k} {v:.0%}" for k, v in impair.items())
        return _stream_row(name, tb, numel, note=f"{what} of packets, both directions "
                           f"(transport Impairment)", **impair)
    finally:
        tb.stop_aggregator()
        tb.agg_args = []
        tb.start_aggregator()


JITTER_S = 0.005
"""Transport jitter: every packet waits a random 0..5 ms (so packets also overtake each
other), about the RTT of the emulated links' software path."""


def row_jitter(tb, numel: int) -> Row:
    """Transport-level jitter (:class:`host.net.impair.Impairment`), both directions: this
    kernel has no netem, and iptables cannot delay."""
    ok, why = netem_available()
    where = ("netem is present, but this row uses the transport's jitter so that every "
             "testbed runs the same" if ok else why)
    tb.stop_aggregator()
    tb.agg_args = ["--jitter", str(JITTER_S)]
    tb.start_aggregator()
    try:
        return _stream_row("jitter", tb, numel, jitter=JITTER_S,
                           note=f"transport-level jitter: each packet delayed by a random "
                                f"0..{JITTER_S * 1e3:g} ms, both directions (Impairment; "
                                f"{where})")
    finally:
        tb.stop_aggregator()
        tb.agg_args = []
        tb.start_aggregator()


def row_worker_killed(tb, numel: int, restart_numel: int | None = None, suffix: str = "",
                      **kw) -> Row:
    """Worker 2 is killed mid-stream; the others must fail naming it, in bounded time; then
    the whole run restarts (new run id, seq 0) and must be exact with no manual step."""
    deadline = 3.0
    before = _counters(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(_argv(tb, numel, MID_STREAM_ROUNDS, deadline=deadline, **kw))
    seen = _progress(tb, before, 50)
    procs[2].kill()
    killed_at = time.perf_counter()
    failed = _wait(procs, 60)
    noticed = time.perf_counter() - killed_at
    survivors = [r for i, r in enumerate(failed) if i != 2]
    named = all(r.get("missing") == [2] or "error" not in r for r in survivors)
    restart = _stream_row("worker killed", tb, restart_numel or numel, **kw)
    done, drops = _delta(before, _counters(tb))
    causes = sorted({r.get("error", "finished") for r in survivors})
    wrong = sum(r.get("mismatches", 0) for r in failed)
    exact = restart.exact if not wrong else False
    note = (f"killed after {seen} chunks; survivors: {', '.join(causes)}"
            + (" naming worker 2" if named else " NOT naming worker 2")
            + f"; all exited {noticed:.1f}s after the kill (deadline {deadline:g}s); then all 4 "
              f"restarted as a new run: {restart.sums}")
    return Row("worker killed mid-round, run restarted" + suffix, _label(tb),
               restart.sums if not wrong else f"WRONG: {wrong} sums differ", done,
               restart.retransmissions, time.perf_counter() - t0, drops, note, exact)


def row_aggregator_restarted(tb, numel: int) -> Row:
    deadline = 3.0
    before = _counters(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(_argv(tb, numel, MID_STREAM_ROUNDS, deadline=deadline))
    seen = _progress(tb, before, 50)
    agg = tb._agg_proc
    agg.kill(grace=0)
    tb._agg_proc = None
    tb.start_aggregator()
    restarted_at = time.perf_counter()
    failed = _wait(procs, 60)
    noticed = time.perf_counter() - restarted_at
    after_restart = _counters(tb)
    restart = _stream_row("aggregator restarted", tb, numel)
    wrong = sum(r.get("mismatches", 0) for r in failed)
    causes = sorted({r.get("error", "finished") for r in failed})
    note = (f"killed (SIGKILL) after {seen} chunks and started again: workers "
            f"{', '.join(causes)}, all exited {noticed:.1f}s after the restart "
            f"(deadline {deadline:g}s); then a new run: {restart.sums}")
    done = restart.rounds
    drops = {k: v for k, v in _delta({"drops": {}}, after_restart)[1].items()}
    for k, v in restart.drops.items():
        drops[k] = drops.get(k, 0) + v
    return Row("aggregator restarted mid-stream", tb.kind,
               restart.sums if not wrong else f"WRONG: {wrong} sums differ", done,
               restart.retransmissions, time.perf_counter() - t0, drops, note,
               restart.exact if not wrong else False)


def row_switch_restarted(tb, numel: int, restart_numel: int, **kw) -> Row:
    """simple_switch_grpc crashes mid-stream and comes back; the controller pushes the
    program and installs the job again (a new epoch). The workers must resynchronise or
    fail naming the cause, in bounded time, never with a wrong sum; the next run is exact."""
    deadline = 30.0
    before = _live_counters(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(_argv(tb, numel, MID_STREAM_ROUNDS, deadline=deadline, **kw))
    seen = _progress(tb, before, 50)
    gone = tb.restart_switch()
    back_at = time.perf_counter()
    failed = _wait(procs, deadline + 30)
    noticed = time.perf_counter() - back_at
    restart = _stream_row("switch restarted", tb, restart_numel, **kw)
    wrong = sum(r.get("mismatches", 0) for r in failed)
    causes = sorted({r.get("error", "finished") for r in failed})
    cleared = all(r.get("error") in ("AggregatorRestarted", "AggregationTimeout") or
                  r.get("rounds") == 1 for r in failed)
    note = (f"simple_switch_grpc killed (SIGKILL) after {seen} chunks, started again, program "
            f"pushed and job re-installed (new epoch) by `thc controller install --push` in "
            f"{gone:.1f}s; workers: {', '.join(causes)}"
            + ("" if cleared else " (UNCLEAR failure)")
            + f", all exited {gone + noticed:.1f}s after the kill, {noticed:.1f}s after the "
              f"switch was back (deadline {deadline:g}s); then a new run: {restart.sums}; counters restart with the "
              f"switch, so rounds and drops are the new run's")
    exact = (restart.exact if cleared else None) if not wrong else False
    return Row("switch restarted mid-stream (BMv2)", _label(tb),
               restart.sums if not wrong else f"WRONG: {wrong} sums differ", restart.rounds,
               restart.retransmissions, time.perf_counter() - t0, restart.drops, note, exact)


# -- protocol rows: out-of-step packets, forged replies, reused run ids, a straggler ---------

OUT_OF_STEP_RANK = 1
OUT_OF_STEP_P = 0.1
"""Worker 1's process sends a MAX after about one in ten of its DATA chunks."""


def _job_counter(counters: dict, name: str) -> int:
    return counters.get("jobs", {}).get("1", {}).get(name, 0)


def row_out_of_step(tb, numel: int, suffix: str = "", **kw) -> Row:
    """One worker's process also sends packets of another kind at the seqs of its chunks in
    flight: a MAX at a DATA chunk's seq, from the worker's address, with its run and
    incarnation. The aggregator must refuse each (wrong_use) without touching the sum."""
    name = "out-of-step worker" + suffix
    before = _counters(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(_argv(tb, numel, per_rank={
        OUT_OF_STEP_RANK: {"out-of-step": OUT_OF_STEP_P}}, **kw))
    results = _wait(procs, 300)
    seconds = time.perf_counter() - t0
    done, drops = _delta(before, _counters(tb))
    sums, exact, retx = _check(results)
    odd = results[OUT_OF_STEP_RANK]
    injected = odd.get("out_of_step", 0)
    refused = drops.get("wrong_use", 0)
    ignored = odd.get("stats", {}).get("ignored", 0)
    all_refused = injected > 0 and refused == injected
    note = (f"worker {OUT_OF_STEP_RANK}'s process also sent {injected} MAX packets through "
            f"its socket, each right after one of its DATA chunks (p {OUT_OF_STEP_P:g}), at that "
            f"chunk's seq, slot and version, with the worker's run and incarnation and the "
            f"offset a MAX round gives that index (its client on the Python datapath): "
            f"{refused} refused as wrong_use"
            + ("" if all_refused else f" (NOT every one: {injected} sent)")
            + f"; that worker's client ignored {ignored} replies (TransportStats.ignored), the "
              f"REFUSED among them: they name the MAX's offset, no DATA chunk's")
    return Row(name, _label(tb), sums, done, retx, seconds, drops, note, exact,
               max(r.get("seconds", 0.0) for r in results))


SPOOF_RATE = {"bmv2": 500.0}
"""Forged datagrams a second: the software switch forwards a few thousand packets a second
in all, so the forger must leave it room; elsewhere DEFAULT_SPOOF_RATE."""
DEFAULT_SPOOF_RATE = 4000.0
SPOOF_CHUNKS = {"bmv2": 1024}
"""Chunks each worker streams in the spoofed row (whole vectors, at least two), so that the
forger, which starts once the counters show the stream, has seconds to aim; elsewhere
DEFAULT_SPOOF_CHUNKS."""
DEFAULT_SPOOF_CHUNKS = 16384


def _job_epoch(tb) -> int:
    """The epoch job 1's replies carry: the software aggregator's stats, or `thc controller
    jobs` on BMv2 (set_job's epoch); 0 if unknown (the forger then guesses)."""
    if tb.aggregator == "bmv2":
        try:
            out = _controller(tb, "jobs")
        except TestbedError:
            return 0
        m = re.search(r"^job 1:.*\bepoch=(\d+)", out, re.M)
        return int(m.group(1)) if m else 0
    c = tb.aggregator_counters() or {}
    return int(c.get("epochs", {}).get("1") or c.get("epoch") or 0)


def _write_progress(tb, before: dict, path: Path) -> None:
    """Chunks completed since ``before`` and when the counters said so (wall clock), for
    the forger to aim at the seqs in flight."""
    done, _ = _delta(before, _live_counters(tb))
    if done <= 0 and not path.exists():
        return  # the workers have not started streaming yet
    stamp = time.time()
    stats = tb.logdir / "aggregator-stats.json"
    if tb.aggregator != "bmv2" and stats.exists():
        stamp = stats.stat().st_mtime
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{done} {stamp}")
    os.replace(tmp, path)


def row_spoofed(tb, numel: int, suffix: str = "", **kw) -> Row:
    """A process that is not the aggregator (another port on its host; with BMv2, whose
    aggregator is the switch, another host) sends the workers forged RESULTs (and some
    REFUSED) with plausible fields while they stream: the run they were given, the epoch the
    aggregator answers with, the seqs in flight with their slots, versions and offsets.
    Clients take replies only from the chunk's aggregator: sums stay exact, and each worker
    counts what it ignored."""
    name = "spoofed replies" + suffix
    before = _counters(tb)
    epoch = _job_epoch(tb)
    run = tb.new_run()
    chunks = -(-numel // tb.job.lanes)
    rounds = max(2, SPOOF_CHUNKS.get(tb.aggregator, DEFAULT_SPOOF_CHUNKS) // chunks)
    tag = time.monotonic_ns()
    progress, stop = tb.logdir / f"spoof-progress-{tag}", tb.logdir / f"spoof-stop-{tag}"
    if tb.aggregator == "bmv2":
        node = tb.n_workers - 1
        bind = f"{tb.job.worker(node).ip}:{P.UDP_PORT}"
        where = f"host h{node + 1} ({bind}, the aggregator's UDP port on another host)"
    else:
        node = "agg"
        bind = f"{tb.agg_addr[0]}:{tb.agg_addr[1] + 1}"
        where = f"the aggregator's host, another port ({bind})"
    rate = SPOOF_RATE.get(tb.aggregator, DEFAULT_SPOOF_RATE)
    forger = tb.popen(node, ["python", "-m", "thcnet.spoof", "--config", str(tb.cluster_path),
                             "--bind", bind, "--run", str(run), "--epoch", str(epoch),
                             "--chunks", str(chunks), "--rounds", str(rounds),
                             "--progress", str(progress), "--stop", str(stop),
                             "--rate", str(rate)], name=f"forger-{tag}")
    end = time.monotonic() + 30
    while "forging" not in forger.stdout():
        if forger.poll() is not None or time.monotonic() > end:
            forger.kill()
            return Row(name, _label(tb), note=f"not run: the forger did not start: "
                       f"{forger.stderr().strip()[-300:]}")
        time.sleep(0.05)
    t0 = time.perf_counter()
    procs = tb.start_workers(_argv(tb, numel, rounds, **kw), env={P.RUN_ENV: str(run)})
    end = time.monotonic() + 300
    # the forger sends while every worker streams: from the first completed chunk until the
    # first worker is done (a forgery to a closed port would count for nobody)
    while all(p.poll() is None for p in procs) and time.monotonic() < end:
        _write_progress(tb, before, progress)
        time.sleep(0.1)
    stop.write_text("stop")
    results = _wait(procs, max(1.0, end - time.monotonic()))
    seconds = time.perf_counter() - t0
    try:
        forger.popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        forger.kill()
    lines = [ln for ln in forger.stdout().splitlines() if ln.startswith("{")]
    forged = json.loads(lines[-1]) if lines else {}
    done, drops = _delta(before, _counters(tb))
    sums, exact, retx = _check(results)
    ignored = sum(r.get("stats", {}).get("ignored", 0) for r in results)
    other_run = sum(r.get("stats", {}).get("other_run", 0) for r in results)
    note = (f"a forger on {where} sent the workers {forged.get('forged', '?')} forged replies "
            f"while they streamed {rounds} vectors ({forged.get('result', '?')} RESULT with "
            f"count 4, full bitmap and possible sums, {forged.get('refused', '?')} REFUSED "
            f"stale_run), aimed at the seqs in flight from the aggregator's counters, with "
            f"the workers' run and the "
            + ("aggregator's epoch" if epoch else "epoch guessed (not readable here)")
            + f"; the clients ignored {ignored} replies (TransportStats.ignored, all workers: "
              f"the forgeries that came while they streamed, and late copies of the "
              f"aggregator's own replies to {retx} retransmissions)"
            + (f", {other_run} of another run" if other_run else ""))
    return Row(name, _label(tb), sums, done, retx, seconds, drops, note, exact,
               max(r.get("seconds", 0.0) for r in results))


def row_reused_run(tb, numel: int, suffix: str = "", **kw) -> Row:
    """The workers run a round under ``--run R``; new processes started with the same ``--run
    R`` must fail at once (a second incarnation: reused_run), not wait for their deadline
    and never return a sum; then a launch with a new run id is exact."""
    deadline = 10.0
    name = "reused run id" + suffix
    before = _counters(tb)
    t0 = time.perf_counter()
    run = tb.new_run()
    argv = _argv(tb, numel, deadline=deadline, run=run, **kw)
    first = _wait(tb.start_workers(argv), 120)
    t1 = time.perf_counter()
    second = _wait(tb.start_workers(argv), deadline + 60)
    relaunch_s = time.perf_counter() - t1
    fresh = _stream_row(name, tb, numel, deadline=deadline, **kw)
    done, drops = _delta(before, _counters(tb))
    sums1, exact1, _ = _check(first)
    refused = [r for r in second if r.get("error") == "AggregationRefused"
               and r.get("reason") == "reused_run"]
    others = sorted({r.get("reason") or r.get("error", "finished") for r in second
                     if r not in refused})
    inside = max((r.get("seconds", 0.0) for r in second), default=0.0)
    wrong = sum(r.get("mismatches", 0) for r in first + second) + (
        0 if fresh.exact is not False else 1)
    fast = relaunch_s < deadline / 2
    ok = exact1 is True and len(refused) == len(second) and fast and fresh.exact is True
    note = (f"run {run}: {sums1}; the same {len(second)} workers relaunched as new processes "
            f"with --run {run}: {len(refused)}/{len(second)} AggregationRefused (reused_run)"
            + (f", others: {', '.join(others)}" if others else "")
            + f", each at most {inside * 1e3:.0f} ms after its first chunk, all exited "
              f"{relaunch_s:.1f}s after the launch (process start included; deadline "
              f"{deadline:g}s), no sum returned; then a new run id: {fresh.sums}")
    if wrong:
        return Row(name, _label(tb), "WRONG: sums differ", done, fresh.retransmissions,
                   time.perf_counter() - t0, drops, note, False)
    return Row(name, _label(tb), fresh.sums if ok else f"NOT as expected: {fresh.sums}",
               done, fresh.retransmissions, time.perf_counter() - t0, drops, note,
               True if ok else None)


STRAGGLER_RANK = N_WORKERS - 1
STRAGGLER_DELAY = 0.5
STRAGGLER_LOSS_BOUND = 0.75


def row_straggler(tb, numel: int, suffix: str = "", **kw) -> Row:
    """DLCP's bounded loss with a straggler: a job loss_bound of 0.75 (its cluster config)
    and one worker 0.5 s late. Every worker must finish, each chunk's sums equal to the exact
    sum over the workers its bitmap names (smoke_worker checks it), the same on every worker
    (a closed chunk is frozen)."""
    deadline = 10.0
    name = "bounded loss with a straggler" + suffix
    before = _counters(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(_argv(tb, numel, deadline=deadline, per_rank={
        STRAGGLER_RANK: {"start-delay": STRAGGLER_DELAY}}, **kw))
    results = _wait(procs, 300)
    seconds = time.perf_counter() - t0
    after = _counters(tb)
    done, drops = _delta(before, after)
    held = _job_counter(after, "held") - _job_counter(before, "held")
    sums, exact, retx = _check(results)
    ok = [r for r in results if "error" not in r]
    same = len({r.get("sha256") for r in ok}) == 1
    chunks = -(-numel // tb.job.lanes)
    short = sorted({r.get("short_last_round", 0) for r in ok})
    flushed = sum(r.get("stats", {}).get("flushed", 0) for r in results)
    by_bitmap = ok[0].get("bitmaps", {}) if ok else {}
    causes = sorted({r["error"] for r in results if "error" in r})
    note = (f"job loss_bound {tb.job.loss_bound:g} (the testbed's cluster config), worker "
            f"{STRAGGLER_RANK} started {STRAGGLER_DELAY:g} s late, deadline {deadline:g} s: "
            f"{len(ok)}/{len(results)} finished"
            + (f" (others: {', '.join(causes)})" if causes else "")
            + f"; each chunk checked against the workers its bitmap names; "
              f"{'/'.join(map(str, short))} of {chunks} chunks closed short"
            + (f" (chunks by contributors: {_contributors(by_bitmap)})" if by_bitmap else "")
            + f", {'the same on every worker' if same else 'DIFFERENT on the workers'}; "
              f"{flushed} FLUSH sent; {held} packets held (a new slot use waits until every "
              f"worker acknowledged the previous one)")
    if exact and (not same or len(ok) < len(results)):
        exact = None
    return Row(name, _label(tb), sums, done, retx, seconds, drops, note, exact,
               max(r.get("seconds", 0.0) for r in results))


def _contributors(by_bitmap: dict) -> str:
    """``{"0x7": 128, "0x8": 31}`` -> "workers 0,1,2: 128; worker 3: 31", most first."""
    parts = []
    for bitmap, n in sorted(by_bitmap.items(), key=lambda kv: (-kv[1], kv[0])):
        who = [str(w) for w in range(32) if int(bitmap, 0) >> w & 1]
        label = ("none" if not who else f"worker {who[0]}" if len(who) == 1
                 else f"workers {','.join(who)}")
        parts.append(f"{label}: {n}")
    return "; ".join(parts)


def straggler_testbed_row(numel: int, prefer_mininet: bool, aggregator: str = "software",
                          **kw) -> Row:
    """The straggler row on its own testbed: the loss bound is part of its job."""
    suffix = " (BMv2)" if aggregator == "bmv2" else ""
    if aggregator == "bmv2":
        why = bmv2_unavailable_reason() or _p4_build_stale()
        if why is None and not prefer_mininet:
            why = "--loopback: BMv2 needs the Mininet testbed"
        if why:
            return Row("bounded loss with a straggler" + suffix, note=f"not run: {why}")
    with open_testbed(N_WORKERS, prefer_mininet=prefer_mininet, aggregator=aggregator,
                      loss_bound=STRAGGLER_LOSS_BOUND) as tb:
        tb.start_aggregator()
        return row_straggler(tb, numel, suffix, **kw)


BMV2_WINDOW = 16
"""Chunks in flight per worker on BMv2. Probed with 4 workers and 64 Ki elements: a window
of 32 overflows the software switch's queues (3868 retransmissions, 4.1 s), 16 took 1.2 s
(731), 8 took 1.9 s, 4 took 2.7 s."""


BMV2_MATRIX_KEYS = ("bmv2-matrix-loss", "bmv2-matrix-dup", "bmv2-matrix-reorder",
                    "bmv2-matrix-jitter", "bmv2-matrix-worker", "bmv2-matrix-switch",
                    "bmv2-matrix-out-of-step", "bmv2-matrix-spoofed",
                    "bmv2-matrix-reused-run", "bmv2-matrix-straggler")
"""``--only`` prefixes of the BMv2 matrix rows (``--only bmv2`` runs every BMv2 row)."""


def bmv2_matrix(numel: int, prefer_mininet: bool, want) -> list[Row]:
    """Loss, duplication, reordering, jitter, a worker killed, the switch restarted, an
    out-of-step worker, forged replies, a reused run id and a straggler under bounded loss,
    on BMv2 (4 workers, one job): the P4 program is the aggregator."""
    names = [f"{p}% loss (BMv2)" for p in (1, 5, 20)] + [
        "duplication (BMv2)", "reordering (BMv2)", "jitter (BMv2)",
        "worker killed mid-round, run restarted (BMv2)", "switch restarted mid-stream (BMv2)",
        "out-of-step worker (BMv2)", "spoofed replies (BMv2)", "reused run id (BMv2)",
        "bounded loss with a straggler (BMv2)"]
    why = bmv2_unavailable_reason() or _p4_build_stale()
    if why is None and not prefer_mininet:
        why = "--loopback: BMv2 needs the Mininet testbed"
    if why:
        return [Row(n, note=f"not run: {why}") for n in names]
    size = (f"{numel} elements per worker ({numel // 256} chunks), 1/4 of the software rows' "
            f"(BMv2 is slower); window {BMV2_WINDOW}")
    rows: list[Row] = []
    shared = [k for k in BMV2_MATRIX_KEYS if k != "bmv2-matrix-straggler"]
    with (open_testbed(N_WORKERS, aggregator="bmv2") if any(want(k) for k in shared)
          else contextlib.nullcontext()) as tb:
        if tb is not None:
            tb.start_aggregator()
        for pct in (1, 5, 20):
            if not want("bmv2-matrix-loss"):
                break
            try:
                tb.set_worker_loss(pct)
            except TestbedError as e:
                rows.append(Row(f"{pct}% loss (BMv2)", note=f"not run: {e}"))
                continue
            try:
                row = _stream_row(f"{pct}% loss (BMv2)", tb, numel, window=BMV2_WINDOW)
                row.note = (f"{pct}% loss in each direction of every worker link: nftables "
                            f"netdev egress drops (worker to switch) and iptables statistic "
                            f"drops (switch to worker) in each worker's namespace (no netem), "
                            f"{tb.worker_link_drops()} packets dropped on the links; {size}")
                rows.append(row)
            finally:
                tb.set_worker_loss(0)
        for key, name, kw, what in (
                ("dup", "duplication", {"dup": 0.05}, "dup 5%"),
                ("reorder", "reordering", {"reorder": 0.05}, "reorder 5%"),
                ("jitter", "jitter", {"jitter": JITTER_S},
                                f"transport-level jitter: a random 0..{JITTER_S * 1e3:g} ms "
                                f"delay on each")):
            if want(f"bmv2-matrix-{key}"):
                rows.append(_stream_row(
                    f"{name} (BMv2)", tb, numel, window=BMV2_WINDOW,
                    note=f"{what} of the workers' packets (transport Impairment; the switch's "
                         f"replies cannot be impaired); {size}", **kw))
        if want("bmv2-matrix-worker"):
            rows.append(row_worker_killed(tb, numel * 8, restart_numel=numel, suffix=" (BMv2)",
                                          window=BMV2_WINDOW))
        if want("bmv2-matrix-switch"):
            rows.append(row_switch_restarted(tb, numel * 8, numel, window=BMV2_WINDOW))
        for key, row_fn in (("out-of-step", row_out_of_step), ("spoofed", row_spoofed),
                            ("reused-run", row_reused_run)):
            if want(f"bmv2-matrix-{key}"):
                row = row_fn(tb, numel, " (BMv2)", window=BMV2_WINDOW)
                row.note += f"; {size}"
                rows.append(row)
    if want("bmv2-matrix-straggler"):
        row = straggler_testbed_row(numel, prefer_mininet, "bmv2", window=BMV2_WINDOW)
        if row.exact is not None or row.sums != "-":
            row.note += f"; {size}"
        rows.append(row)
    return rows


def _p4_build_stale() -> str | None:
    r = subprocess.run([sys.executable, str(REPO_ROOT / "p4src" / "gen_p4.py"), "--check"],
                       capture_output=True, text=True, cwd=str(REPO_ROOT))
    if r.returncode:
        return ("the committed P4 build does not match protocol.json (p4src/gen_p4.py "
                "--check fails; `make p4` rebuilds it)")
    return None


def _controller(tb, *args: str) -> str:
    """One run of `thc controller` against the testbed's switch: a fresh controller process."""
    argv = [sys.executable, "-m", "host.app.cli", "controller", "--grpc-addr",
            tb.switch.grpc_addr, "--device-id", "0", "--build-dir", str(BUILD_DIR), *args]
    r = subprocess.run(argv, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise TestbedError(f"thc controller {' '.join(args)} failed: "
                           f"{(r.stderr or r.stdout).strip()[-1000:]}")
    return r.stdout


def _bmv2_drops(tb) -> dict:
    try:
        raw = json.loads(_controller(tb, "counters", "--json"))
    except (TestbedError, ValueError):
        return {}
    return {k: v for k, v in raw.get("drops", {}).items() if v}


def bmv2_rows(numel: int, prefer_mininet: bool) -> list[Row]:
    """The controller restarted mid-stream, and one job re-installed while another streams;
    both on BMv2 with two jobs (workers 0-1 and 2-3), sums checked as everywhere."""
    import dataclasses

    names = ("controller restarted mid-stream (BMv2)",
             "job re-installed while another runs (BMv2)")
    why = bmv2_unavailable_reason() or _p4_build_stale()
    if why is None and not prefer_mininet:
        why = "--loopback: BMv2 needs the Mininet testbed"
    if why:
        return [Row(n, note=f"not run: {why}") for n in names]
    rows = []
    with open_testbed(N_WORKERS, aggregator="bmv2") as tb:
        tb.start_aggregator()
        w = sorted(tb.job.workers, key=lambda x: x.id)
        a = dataclasses.replace(tb.job, job_id=1, mcast_grp=1, workers=tuple(w[:2]))
        b = dataclasses.replace(tb.job, job_id=2, mcast_grp=2,
                                pool_base=a.pool_base + a.pool_size, workers=tuple(
            dataclasses.replace(x, id=i) for i, x in enumerate(w[2:])))
        paths = {}
        changed_b = dataclasses.replace(b, pool_size=b.pool_size // 2)
        for name, jobs in (("both", (a, b)), ("a", (a,)), ("b", (changed_b,))):
            paths[name] = tb.logdir / f"cluster-{name}.json"
            dataclasses.replace(tb.cluster, jobs=jobs).save(paths[name])
        _controller(tb, "install", "--config", str(paths["both"]), "--prune")
        agg = f"{tb.agg_addr[0]}:{tb.agg_addr[1]}"

        def argv(cfg, first):
            return lambda r: ["python", "-m", "thcnet.smoke_worker", "--rank", str(r - first),
                              "--config", str(cfg), "--agg", agg, "--numel", str(numel),
                              "--seed", str(SEED), "--deadline", "30"]

        for name, action in ((names[0], ("install", "--config", str(paths["both"]))),
                             (names[1], ("install", "--config", str(paths["b"])))):
            t0 = time.perf_counter()
            procs = tb.start_workers(argv(paths["a"], 0), ranks=[0, 1])
            time.sleep(2.0)
            try:
                out = _controller(tb, *action)
                note = f"`thc controller {' '.join(action[:1])}` mid-stream: " + (
                    out.strip().splitlines() or ["ok"])[-1][:200]
            except TestbedError as e:
                note = f"the controller refused: {e}"[:300]
            results = _wait(procs, 600)
            sums, exact, retx = _check(results)
            rounds = sum(r.get("rounds", 0) for r in results[:1])
            rows.append(Row(name, "mininet+bmv2", sums, f"{rounds} vectors", retx,
                            time.perf_counter() - t0, _bmv2_drops(tb),
                            f"job 1 (workers 0-1) streams; {note}", exact))
    return rows


def _stream_for(name: str, tb, numel: int, seconds: float, note: str, **kw) -> Row:
    """Workers aggregate the vector round after round for about ``seconds``; then the
    driver names a round count none has reached (``smoke_worker --until``) and all stop
    there, each having checked every round."""
    until = tb.logdir / f"until-{time.monotonic_ns()}"
    until.mkdir()
    before = _counters(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(_argv(tb, numel, rounds=1 << 30, deadline=30.0,
                                   until=str(until), **kw))
    while time.perf_counter() - t0 < seconds and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    done = [int(f.read_text() or 0) for f in until.glob("done-*")]
    stop = max(done, default=0) + 2
    (until / "stop.tmp").write_text(str(stop))
    (until / "stop.tmp").rename(until / "stop")
    results = _wait(procs, 300)
    elapsed = time.perf_counter() - t0
    rounds, drops = _delta(before, _counters(tb))
    sums, exact, retx = _check(results)
    vectors = sorted({r.get("rounds", 0) for r in results})
    return Row(name, _label(tb), sums, rounds, retx, elapsed, drops,
               f"{'/'.join(map(str, vectors))} vectors of {numel} elements per worker, each "
               f"checked; {note}", exact)


def row_long_stream(n_workers: int, seconds: float, prefer_mininet: bool,
                    aggregator: str = "software", numel_chunks: int = 512, **kw) -> Row:
    name = f"{n_workers} workers streaming {seconds:g} s"
    if aggregator == "bmv2":
        name += " (BMv2)"
        why = bmv2_unavailable_reason() or _p4_build_stale()
        if why is None and not prefer_mininet:
            why = "--loopback: BMv2 needs the Mininet testbed"
        if why:
            return Row(name, note=f"not run: {why}")
    with open_testbed(n_workers, prefer_mininet=prefer_mininet, aggregator=aggregator) as tb:
        tb.start_aggregator()
        extra = "".join(f", {k} {v}" for k, v in kw.items())
        row = _stream_for(name, tb, tb.job.lanes * numel_chunks, seconds,
                          f"every worker stops after the same round once {seconds:g} s have "
                          f"passed{extra}", **kw)
    return row


# -- the table ------------------------------------------------------------------------------

EXACTNESS_CASES = """\
## The exactness cases

Eight ways a client accepted a wrong sum or waited without an error before the protocol's
rules of docs/protocol.md (a slot use's op and offset, slot and version checked against seq,
acknowledgements, REFUSED replies, run jumps and idle runs, an epoch per install, one
incarnation per run, the client's acceptance checks). Each is a test that runs on every
aggregator (Python, compiled, both sharded, BMv2 where present) and, where a client is
involved, both client windows; the matrix rows above run four of them with real processes.

| case | before | now | tests, rows |
|---|---|---|---|
| 1. a MAX at a sum's seq, a DATA at a MAX's, a FLUSH at a MAX use | the MAX set its bit and the count and added nothing; a DATA added onto the previous use's leftovers (254 + 127 wrapped to 125); a FLUSH at a MAX use multicast an impossible RESULT | refused (`wrong_use`), nothing added; results are built from the use | `tests/conformance/test_exactness.py` (max_at_a_sums_seq, data_after_a_max_use, offset_differs); row *out-of-step worker* |
| 2. a RESULT from a stranger with the real epoch | accepted by both client windows (sums 99 where 30 is possible) | ignored: only the chunk's aggregator, every field matching, sums <= count x granularity | `tests/test_runs.py` (a_strangers_result), `tests/test_client_datapath.py` (hostile replies); row *spoofed replies* |
| 3. `client.run = <the same id>`, or restarted workers under the same run id | round 2 (true sum 6) returned round 1's sums (2) | the setter refuses an id that is not newer; the aggregator refuses a second incarnation (`reused_run`) | `tests/test_exactness_clients.py` (run_id_that_is_not_newer, same_run_id_cannot_repeat, restarted_worker_under_the_same_run_id), `test_exactness.py` (second_incarnation); row *reused run id* |
| 4. a slot or version that is not the seq's; a packet at seq cur + 2^31 - 1 | overwrote another chunk's partial use; dead-ended a slot version for the run | `wrong_slot` refused; a far newer seq is held until every worker moved past the previous use | `test_exactness.py` (slot_or_version_that_is_not_the_seqs, far_newer_seq_waits) |
| 5. bounded loss (0.75) with a worker 0.5 s late; a lost RESULT and two FLUSHes | all three workers raised AggregationTimeout | a new use waits until every worker acknowledged the previous one; a held chunk is never closed empty | `test_exactness_clients.py` (bounded_loss_with_a_straggler, chunk_held_for_a_gone_worker), `test_exactness.py` (new_use_waits); row *bounded loss with a straggler* |
| 6. a software re-install within a run | the epoch stayed: a worker's retransmission started a fresh use and hung; a re-install with another table gave 26 instead of 4 | every install draws a new epoch: the run fails with AggregatorRestarted | `test_exactness.py` (each_install_answers_with_a_new_epoch), `test_exactness_clients.py` (reinstall_within_a_run) |
| 7. one packet with a far-future run id | locked the job out until a re-install (every later clock run timed out) | refused while the job's run is live (jump bound 2^24); any run takes a job idle for 60 s; a refused client fails at once naming the job's run | `test_exactness.py` (far_future_run), `test_exactness_clients.py` (far_future_run) |
| 8. `AggregationClient(window=-1)` | the Python window looped forever, past its deadline | refused at construction | `test_exactness_clients.py` (window_that_cannot_hold_a_chunk) |

`tests/model_fuzz.py` checks every engine against the reference model over random
interleavings of all these packets (`make fuzz`: a million steps), with an oracle that knows
every worker's payload.
"""


def render(rows: list[Row], quick: bool, elapsed: float) -> str:
    lines = ["# Fault matrix", "",
             "Generated by `make faults` (`thc faults`"
             + (" --quick" if quick else "") + f") in {elapsed:.0f} s on "
             f"{platform.node() or 'this machine'} ({platform.machine()}, Linux "
             f"{platform.release()}). Each row streams real chunks (4-bit indices, "
             f"{N_WORKERS} workers unless said) through the software aggregator (`thc "
             "aggregator`) unless marked BMv2, and every worker checks its sums bit for bit "
             "against a reference computed from the indices all workers sent "
             "(`thcnet.smoke_worker`).", "",
             "Columns: *sums*: the check; *rounds*: chunks completed by the aggregator (all "
             "workers' contributions summed); *retx*: retransmissions by the workers; *time*: "
             "wall seconds of the row; *drops*: the aggregator's drop counters by reason during "
             "the row (on BMv2 the switch's counters, read through the controller; packets "
             "the emulated links drop are not the aggregator's and are given in the notes).",
             "",
             "This kernel has no netem: loss is iptables/nftables statistic drops, and jitter "
             "is transport-level (`host.net.impair.Impairment` delays each packet by a random "
             "time on the sender), as the notes say. BMv2 rows use smaller vectors than the "
             "software rows: the software switch forwards a few thousand packets a second.",
             "",
             "| fault | testbed | sums | rounds | retx | time (s) | drops | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        drops = ", ".join(f"{k} {v}" for k, v in sorted(r.drops.items())) or "none"
        secs = f"{r.seconds:.1f}" if r.seconds is not None else "-"
        if r.exact is None and r.sums == "-":
            drops = "-"
        lines.append(f"| {r.name} | {r.testbed} | {r.sums} | {r.rounds} | "
                     f"{r.retransmissions} | {secs} | {drops} | {r.note} |")
    wrong = [r.name for r in rows if r.exact is False]
    lines += ["", "Wrong sums: " + (", ".join(wrong) if wrong else "none in any row") + ".", "",
              EXACTNESS_CASES]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    numel = (1 << 17) if args.quick else (1 << 19)
    stream_s = 10.0 if args.quick else 60.0
    mininet = not args.loopback
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    want = lambda key: not only or any(key.startswith(p) for p in only)  # noqa: E731
    rows: list[Row] = []
    t0 = time.perf_counter()

    def add(row: Row) -> None:
        rows.append(row)
        print(f"{row.name}: {row.sums}; rounds {row.rounds}; retx {row.retransmissions}; "
              f"drops {row.drops}; {row.note}", flush=True)

    for pct in (1, 5, 20):
        if want(f"loss-{pct}"):
            add(row_loss(pct, numel, mininet))
    if any(want(k) for k in ("dup", "reorder", "jitter", "worker", "aggregator", "out-of-step",
                             "spoofed", "reused-run")):
        with open_testbed(N_WORKERS, prefer_mininet=mininet) as tb:
            tb.start_aggregator()
            if want("dup"):
                add(row_impair(tb, "duplication", numel, dup=0.05))
            if want("reorder"):
                add(row_impair(tb, "reordering", numel, reorder=0.05))
            if want("jitter"):
                add(row_jitter(tb, numel))
            if want("worker"):
                add(row_worker_killed(tb, numel * 8))
            if want("aggregator"):
                add(row_aggregator_restarted(tb, numel * 8))
            if want("out-of-step"):
                add(row_out_of_step(tb, numel))
            if want("spoofed"):
                add(row_spoofed(tb, numel))
            if want("reused-run"):
                add(row_reused_run(tb, numel))
    if want("straggler"):
        add(straggler_testbed_row(numel, mininet))
    if want("stream"):
        add(row_long_stream(8, stream_s, mininet))
    if any(want(k) for k in BMV2_MATRIX_KEYS):
        for row in bmv2_matrix(numel // 4, mininet, want):
            add(row)
    if want("bmv2-controller"):
        for row in bmv2_rows(numel // 8, mininet):
            add(row)
    if want("bmv2-stream"):
        add(row_long_stream(8, stream_s, mininet, aggregator="bmv2", numel_chunks=128,
                            window=BMV2_WINDOW // 2))
    text = render(rows, args.quick, time.perf_counter() - t0)
    if not only:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    return 1 if any(r.exact is False for r in rows) else 0
