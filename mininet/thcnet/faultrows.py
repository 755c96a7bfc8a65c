"""The fault matrix's rows of faults in the network and in the processes: loss,
duplication, reordering and jitter, a worker killed, the aggregator or the switch restarted
mid-stream, and a long stream of many workers."""
from __future__ import annotations

import time

from thc.emu.base import bmv2_unavailable_reason
from thc.emu.links import netem_available
from thc.emu.matrix import (MID_STREAM_ROUNDS, N_WORKERS, counters_of, delta, live_counters,
                           p4_build_stale, progress, Row, stream_for, stream_row, testbed_label,
                           wait_workers, worker_argv)
from thc.emu.testbed import open_testbed

def row_loss(pct: float, numel: int, prefer_mininet: bool) -> Row:
    with open_testbed(N_WORKERS, loss_pct=pct, prefer_mininet=prefer_mininet) as tb:
        tb.start_aggregator()
        notes = " ".join(getattr(tb, "link_plan", {}).get("notes", []))
        how = ("iptables statistic drops on each host's ingress (this kernel has no netem), "
               "the same end-to-end loss as on both links" if "iptables" in notes else "netem")
        if tb.kind != "mininet":
            row = stream_row(f"{pct:g}% loss", tb, numel, loss=pct / 100,
                              note="loopback: loss injected by the transport on sent chunks")
        else:
            row = stream_row(f"{pct:g}% loss", tb, numel,
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
        return stream_row(name, tb, numel, note=f"{what} of packets, both directions "
                           f"(transport Impairment)", **impair)
    finally:
        tb.stop_aggregator()
        tb.agg_args = []
        tb.start_aggregator()


JITTER_S = 0.005
"""Transport jitter: every packet waits a random 0..5 ms (so packets also overtake each
other), about the RTT of the emulated links' software path."""


def row_jitter(tb, numel: int) -> Row:
    """Transport-level jitter (:class:`thc.net.impair.Impairment`), both directions: this
    kernel has no netem, and iptables cannot delay."""
    ok, why = netem_available()
    where = ("netem is present, but this row uses the transport's jitter so that every "
             "testbed runs the same" if ok else why)
    tb.stop_aggregator()
    tb.agg_args = ["--jitter", str(JITTER_S)]
    tb.start_aggregator()
    try:
        return stream_row("jitter", tb, numel, jitter=JITTER_S,
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
    before = counters_of(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(worker_argv(tb, numel, MID_STREAM_ROUNDS, deadline=deadline, **kw))
    seen = progress(tb, before, 50)
    procs[2].kill()
    killed_at = time.perf_counter()
    failed = wait_workers(procs, 60)
    noticed = time.perf_counter() - killed_at
    survivors = [r for i, r in enumerate(failed) if i != 2]
    named = all(r.get("missing") == [2] or "error" not in r for r in survivors)
    restart = stream_row("worker killed", tb, restart_numel or numel, **kw)
    done, drops = delta(before, counters_of(tb))
    causes = sorted({r.get("error", "finished") for r in survivors})
    wrong = sum(r.get("mismatches", 0) for r in failed)
    exact = restart.exact if not wrong else False
    note = (f"killed after {seen} chunks; survivors: {', '.join(causes)}"
            + (" naming worker 2" if named else " NOT naming worker 2")
            + f"; all exited {noticed:.1f}s after the kill (deadline {deadline:g}s); then all 4 "
              f"restarted as a new run: {restart.sums}")
    return Row("worker killed mid-round, run restarted" + suffix, testbed_label(tb),
               restart.sums if not wrong else f"WRONG: {wrong} sums differ", done,
               restart.retransmissions, time.perf_counter() - t0, drops, note, exact)


def row_aggregator_restarted(tb, numel: int) -> Row:
    deadline = 3.0
    before = counters_of(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(worker_argv(tb, numel, MID_STREAM_ROUNDS, deadline=deadline))
    seen = progress(tb, before, 50)
    agg = tb.agg_proc
    agg.kill(grace=0)
    tb.agg_proc = None
    tb.start_aggregator()
    restarted_at = time.perf_counter()
    failed = wait_workers(procs, 60)
    noticed = time.perf_counter() - restarted_at
    after_restart = counters_of(tb)
    restart = stream_row("aggregator restarted", tb, numel)
    wrong = sum(r.get("mismatches", 0) for r in failed)
    causes = sorted({r.get("error", "finished") for r in failed})
    note = (f"killed (SIGKILL) after {seen} chunks and started again: workers "
            f"{', '.join(causes)}, all exited {noticed:.1f}s after the restart "
            f"(deadline {deadline:g}s); then a new run: {restart.sums}")
    done = restart.rounds
    drops = {k: v for k, v in delta({"drops": {}}, after_restart)[1].items()}
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
    before = live_counters(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(worker_argv(tb, numel, MID_STREAM_ROUNDS, deadline=deadline, **kw))
    seen = progress(tb, before, 50)
    gone = tb.restart_switch()
    back_at = time.perf_counter()
    failed = wait_workers(procs, deadline + 30)
    noticed = time.perf_counter() - back_at
    restart = stream_row("switch restarted", tb, restart_numel, **kw)
    wrong = sum(r.get("mismatches", 0) for r in failed)
    causes = sorted({r.get("error", "finished") for r in failed})
    cleared = all(r.get("error") in ("AggregatorRestarted", "AggregationTimeout") or
                  r.get("rounds") == 1 for r in failed)
    note = (f"simple_switch_grpc killed (SIGKILL) after {seen} chunks, started again, program "
            f"pushed and job re-installed (new epoch) by `thc controller install --push` in "
            f"{gone:.1f}s; workers: {', '.join(causes)}"
            + ("" if cleared else " (UNCLEAR failure)")
            + f", all exited {gone + noticed:.1f}s after the kill, {noticed:.1f}s after the "
              f"switch was back (deadline {deadline:g}s); then a new run: {restart.sums}; "
              f"counters restart with the switch, so rounds and drops are the new run's")
    exact = (restart.exact if cleared else None) if not wrong else False
    return Row("switch restarted mid-stream (BMv2)", testbed_label(tb),
               restart.sums if not wrong else f"WRONG: {wrong} sums differ", restart.rounds,
               restart.retransmissions, time.perf_counter() - t0, restart.drops, note, exact)


def row_long_stream(n_workers: int, seconds: float, prefer_mininet: bool,
                    aggregator: str = "software", numel_chunks: int = 512, **kw) -> Row:
    name = f"{n_workers} workers streaming {seconds:g} s"
    if aggregator == "bmv2":
        name += " (BMv2)"
        why = bmv2_unavailable_reason() or p4_build_stale()
        if why is None and not prefer_mininet:
            why = "--loopback: BMv2 needs the Mininet testbed"
        if why:
            return Row(name, note=f"not run: {why}")
    with open_testbed(n_workers, prefer_mininet=prefer_mininet, aggregator=aggregator) as tb:
        tb.start_aggregator()
        extra = "".join(f", {k} {v}" for k, v in kw.items())
        row = stream_for(name, tb, tb.job.lanes * numel_chunks, seconds,
                          f"every worker stops after the same round once {seconds:g} s have "
                          f"passed{extra}", **kw)
    return row

