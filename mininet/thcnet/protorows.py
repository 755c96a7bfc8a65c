"""The fault matrix's protocol rows: out-of-step packets, forged replies, a reused run
id, and bounded loss (DLCP) with a straggler."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

from thc.wire import protocol as P
from thc.emu.base import bmv2_unavailable_reason
from thc.emu.matrix import (N_WORKERS, check_sums, controller_cmd, counters_of, delta,
                           live_counters, p4_build_stale, Row, stream_row, testbed_label,
                           wait_workers, worker_argv)
from thc.emu.testbed import TestbedError, open_testbed

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
    before = counters_of(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(worker_argv(tb, numel, per_rank={
        OUT_OF_STEP_RANK: {"out-of-step": OUT_OF_STEP_P}}, **kw))
    results = wait_workers(procs, 300)
    seconds = time.perf_counter() - t0
    done, drops = delta(before, counters_of(tb))
    sums, exact, retx = check_sums(results)
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
    row = Row(name, testbed_label(tb), sums, done, retx, seconds, drops, note, exact,
              max(r.get("seconds", 0.0) for r in results))
    if not injected:
        return row.not_fired("no MAX injected")
    if not all_refused:
        row.sums = f"NOT as expected ({refused} of {injected} MAX refused): {sums}"
        if row.exact:
            row.exact = None
    return row


SPOOF_RATE = {"bmv2": 500.0}
"""Forged datagrams a second: the software switch forwards a few thousand packets a second
in all, so the forger must leave it room; elsewhere DEFAULT_SPOOF_RATE."""
DEFAULT_SPOOF_RATE = 4000.0
SPOOF_CHUNKS = {"bmv2": 1024}
"""Chunks each worker streams in the spoofed row (whole vectors, at least two), so that the
forger, which starts once the counters show the stream, has seconds to aim; elsewhere
DEFAULT_SPOOF_CHUNKS."""
DEFAULT_SPOOF_CHUNKS = 65536
FORGER_LOOPBACK_IP = "127.0.0.2"
"""On loopback the forger sends from another address of 127/8 at the aggregator's port."""


def _job_epoch(tb) -> int:
    """The epoch job 1's replies carry: the software aggregator's stats, or `thc controller
    jobs` on BMv2 (set_job's epoch); 0 if unknown (the forger then guesses)."""
    if tb.aggregator == "bmv2":
        try:
            out = controller_cmd(tb, "jobs")
        except TestbedError:
            return 0
        m = re.search(r"^job 1:.*\bepoch=(\d+)", out, re.M)
        return int(m.group(1)) if m else 0
    c = tb.aggregator_counters() or {}
    return int(c.get("epochs", {}).get("1") or 0)


def _write_progress(tb, before: dict, path: Path) -> None:
    """Chunks completed since ``before`` and when the counters said so (wall clock), for
    the forger to aim at the seqs in flight."""
    done, _ = delta(before, live_counters(tb))
    if done <= 0 and not path.exists():
        return  # the workers have not started streaming yet
    stamp = time.time()
    stats = tb.logdir / "aggregator-stats.json"
    if tb.aggregator != "bmv2" and stats.exists():
        stamp = stats.stat().st_mtime
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{done} {stamp}")
    os.replace(tmp, path)


def forger_address(tb) -> tuple:
    """(node, IP:PORT, where in words) of the forger: the aggregator's UDP port at another
    address (another host; on loopback another address of 127/8), so that a client counts
    what it ignores from there apart (TransportStats.elsewhere)."""
    if tb.kind == "loopback":
        bind = f"{FORGER_LOOPBACK_IP}:{tb.agg_addr[1]}"
        return "agg", bind, f"another loopback address, the aggregator's port ({bind})"
    node = tb.n_workers - 1
    bind = f"{tb.job.worker(node).ip}:{tb.agg_addr[1]}"
    return node, bind, f"host h{node + 1} ({bind}, the aggregator's UDP port on another host)"


def row_spoofed(tb, numel: int, suffix: str = "", **kw) -> Row:
    """A process that is not the aggregator (:func:`forger_address`) sends the workers
    forged RESULTs (and some REFUSED) with plausible fields while they stream: the run they
    were given, the epoch the aggregator answers with, the seqs in flight with their slots,
    versions and offsets. Clients take replies only from the chunk's aggregator: sums stay
    exact, and each worker counts what it ignored from the forger's address."""
    name = "spoofed replies" + suffix
    before = counters_of(tb)
    epoch = _job_epoch(tb)
    run = tb.new_run()
    chunks = -(-numel // tb.job.lanes)
    rounds = max(2, SPOOF_CHUNKS.get(tb.aggregator, DEFAULT_SPOOF_CHUNKS) // chunks)
    tag = time.monotonic_ns()
    progress, stop = tb.logdir / f"spoof-progress-{tag}", tb.logdir / f"spoof-stop-{tag}"
    node, bind, where = forger_address(tb)
    rate = SPOOF_RATE.get(tb.aggregator, DEFAULT_SPOOF_RATE)
    forger = tb.popen(node, ["python", "-m", "thc.emu.spoof", "--config", str(tb.cluster_path),
                             "--bind", bind, "--run-id", str(run), "--epoch", str(epoch),
                             "--chunks", str(chunks), "--rounds", str(rounds),
                             "--progress", str(progress), "--stop", str(stop),
                             "--rate", str(rate)], name=f"forger-{tag}")
    end = time.monotonic() + 30
    while "forging" not in forger.stdout():
        if forger.poll() is not None or time.monotonic() > end:
            forger.kill()
            return Row(name, testbed_label(tb), note=f"not run: the forger did not start: "
                       f"{forger.stderr().strip()[-300:]}")
        time.sleep(0.05)
    t0 = time.perf_counter()
    procs = tb.start_workers(worker_argv(tb, numel, rounds, **kw), env={P.RUN_ENV: str(run)})
    end = time.monotonic() + 300
    # the forger sends while every worker streams: from the first completed chunk until the
    # first worker is done (a forgery to a closed port would count for nobody)
    while all(p.poll() is None for p in procs) and time.monotonic() < end:
        _write_progress(tb, before, progress)
        time.sleep(0.1)
    stop.write_text("stop")
    results = wait_workers(procs, max(1.0, end - time.monotonic()))
    seconds = time.perf_counter() - t0
    try:
        forger.popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        forger.kill()
    lines = [ln for ln in forger.stdout().splitlines() if ln.startswith("{")]
    forged = json.loads(lines[-1]) if lines else {}
    done, drops = delta(before, counters_of(tb))
    sums, exact, retx = check_sums(results)
    ignored = sum(r.get("stats", {}).get("ignored", 0) for r in results)
    elsewhere = sum(r.get("stats", {}).get("elsewhere", 0) for r in results)
    other_run = sum(r.get("stats", {}).get("other_run", 0) for r in results)
    drained = sum(r.get("stats", {}).get("drained", 0) for r in results)
    note = (f"a forger on {where} sent the workers {forged.get('forged', '?')} forged replies "
            f"while they streamed {rounds} vectors ({forged.get('result', '?')} RESULT with "
            f"count 4, full bitmap and possible sums, {forged.get('refused', '?')} REFUSED "
            f"stale_run), aimed at the seqs in flight from the aggregator's counters, with "
            f"the workers' run and the "
            + ("aggregator's epoch" if epoch else "epoch guessed (not readable here)")
            + f"; the clients ignored {ignored} replies (TransportStats.ignored, all workers), "
              f"{elsewhere} of them from the aggregator's port at another address "
              f"(TransportStats.elsewhere: the forgeries that came while they streamed; the "
              f"rest late copies of the aggregator's own replies to {retx} retransmissions)"
            + (f", {other_run} of another run" if other_run else "")
            + (f"; {drained} more came between rounds and were dropped unread "
               f"(TransportStats.drained)" if drained else ""))
    row = Row(name, testbed_label(tb), sums, done, retx, seconds, drops, note, exact,
              max(r.get("seconds", 0.0) for r in results))
    if not elsewhere:
        return row.not_fired("no forged reply reached a worker")
    return row


def row_reused_run(tb, numel: int, suffix: str = "", **kw) -> Row:
    """The workers run a round under ``--run-id R``; new processes started with the same
    ``--run-id R`` must fail at once (a second incarnation: reused_run), not wait for their deadline
    and never return a sum; then a launch with a new run id is exact."""
    deadline = 10.0
    name = "reused run id" + suffix
    before = counters_of(tb)
    t0 = time.perf_counter()
    run = tb.new_run()
    first = wait_workers(tb.start_workers(worker_argv(tb, numel, deadline=deadline,
                                                      run_id=run, **kw)), 120)
    t1 = time.perf_counter()
    second = wait_workers(tb.start_workers(worker_argv(tb, numel, deadline=deadline,
                                                       run_id=run, **kw)), deadline + 60)
    relaunch_s = time.perf_counter() - t1
    fresh = stream_row(name, tb, numel, deadline=deadline, **kw)
    done, drops = delta(before, counters_of(tb))
    sums1, exact1, _ = check_sums(first)
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
            f"with --run-id {run}: {len(refused)}/{len(second)} AggregationRefused (reused_run)"
            + (f", others: {', '.join(others)}" if others else "")
            + f", each at most {inside * 1e3:.0f} ms after its first chunk, all exited "
              f"{relaunch_s:.1f}s after the launch (process start included; deadline "
              f"{deadline:g}s), no sum returned; then a new run id: {fresh.sums}")
    if wrong:
        return Row(name, testbed_label(tb), "WRONG: sums differ", done, fresh.retransmissions,
                   time.perf_counter() - t0, drops, note, False)
    return Row(name, testbed_label(tb), fresh.sums if ok else f"NOT as expected: {fresh.sums}",
               done, fresh.retransmissions, time.perf_counter() - t0, drops, note,
               True if ok else None)


STRAGGLER_RANK = N_WORKERS - 1
STRAGGLER_DELAY = 0.5
STRAGGLER_LOSS_BOUND = 0.75


def row_straggler(tb, numel: int, suffix: str = "", **kw) -> Row:
    """DLCP's bounded loss with a straggler: a job loss_bound of 0.75 (its cluster config)
    and one worker 0.5 s late to the second of two rounds (in the first, no worker has heard
    the aggregator before, and none closes a chunk short). Every worker must finish, each
    chunk's sums equal to the exact sum over the workers its bitmap names (smoke_worker
    checks it), the same on every worker (a closed chunk is frozen)."""
    deadline = 10.0
    name = "bounded loss with a straggler" + suffix
    before = counters_of(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(worker_argv(tb, numel, rounds=2, deadline=deadline, per_rank={
        STRAGGLER_RANK: {"start-delay": STRAGGLER_DELAY, "late-round": 1}}, **kw))
    results = wait_workers(procs, 300)
    seconds = time.perf_counter() - t0
    after = counters_of(tb)
    done, drops = delta(before, after)
    held = _job_counter(after, "held") - _job_counter(before, "held")
    sums, exact, retx = check_sums(results)
    ok = [r for r in results if "error" not in r]
    same = len({r.get("sha256") for r in ok}) == 1
    chunks = -(-numel // tb.job.lanes)
    short = sorted({r.get("short_last_round", 0) for r in ok})
    flushed = sum(r.get("stats", {}).get("flushed", 0) for r in results)
    by_bitmap = ok[0].get("bitmaps", {}) if ok else {}
    causes = sorted({r["error"] for r in results if "error" in r})
    note = (f"job loss_bound {tb.job.loss_bound:g} (the testbed's cluster config), worker "
            f"{STRAGGLER_RANK} {STRAGGLER_DELAY:g} s late to round 2 of 2, deadline "
            f"{deadline:g} s: "
            f"{len(ok)}/{len(results)} finished"
            + (f" (others: {', '.join(causes)})" if causes else "")
            + f"; each chunk checked against the workers its bitmap names; "
              f"{'/'.join(map(str, short))} of {chunks} chunks of the last round closed short"
            + (f" (chunks by contributors: {_contributors(by_bitmap)})" if by_bitmap else "")
            + f", {'the same on every worker' if same else 'DIFFERENT on the workers'}; "
              f"{flushed} FLUSH sent; {held} packets held (a new slot use waits until every "
              f"worker acknowledged the previous one)")
    if exact and (not same or len(ok) < len(results)):
        exact = None
    row = Row(name, testbed_label(tb), sums, done, retx, seconds, drops, note, exact,
              max(r.get("seconds", 0.0) for r in results))
    return row if max(short, default=0) else row.not_fired("no chunk closed short")


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
        why = bmv2_unavailable_reason() or p4_build_stale()
        if why is None and not prefer_mininet:
            why = "--loopback: BMv2 needs the Mininet testbed"
        if why:
            return Row("bounded loss with a straggler" + suffix, note=f"not run: {why}")
    with open_testbed(N_WORKERS, prefer_mininet=prefer_mininet, aggregator=aggregator,
                      loss_bound=STRAGGLER_LOSS_BOUND) as tb:
        tb.start_aggregator()
        return row_straggler(tb, numel, suffix, **kw)

