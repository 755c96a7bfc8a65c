"""``thc faults``: the fault matrix. Every row streams real chunks through an aggregator under
one fault and checks every worker's sums bit for bit against a reference computed from the
indices sent (:mod:`thcnet.smoke_worker`); ``make faults`` writes the table to docs/faults.md.

Rows: loss on the worker links (Mininet: iptables or netem), duplication and reordering (the
transport's :class:`host.net.impair.Impairment`, on workers and aggregator), jitter (netem
only), a worker killed mid-round and the run restarted, the aggregator restarted mid-stream,
the controller restarted and a job re-installed while another runs (BMv2 only), and 8 workers
streaming for a minute. A row that cannot run here says why instead of a figure.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from controller.toolchain import BUILD_DIR
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
    parser.add_argument("--only", default="", help="comma-separated row-name prefixes")


# -- running workers --------------------------------------------------------------------------

def _argv(tb, numel: int, rounds: int = 1, deadline: float = 10.0, **impair):
    cfg, agg = str(tb.cluster_path), f"{tb.agg_addr[0]}:{tb.agg_addr[1]}"

    def argv(rank: int) -> list[str]:
        a = ["python", "-m", "thcnet.smoke_worker", "--rank", str(rank), "--config", cfg,
             "--agg", agg, "--numel", str(numel), "--seed", str(SEED), "--rounds", str(rounds),
             "--deadline", str(deadline)]
        for k, v in impair.items():
            a += [f"--{k}", str(v)]
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


def _counters(tb) -> dict:
    time.sleep(0.7)  # the aggregator rewrites its stats file every 0.5 s
    return tb.aggregator_counters() or {"drops": {}, "jobs": {}}


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
    return Row(name, tb.kind, sums, done, retx, seconds, drops, note, exact,
               max(r.get("seconds", 0.0) for r in results))


def _progress(tb, before: dict, chunks: int, timeout: float = 60.0) -> None:
    """Wait until ``chunks`` more chunks completed (the stream is mid-flight)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, _ = _delta(before, tb.aggregator_counters() or {})
        if done >= chunks:
            return
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


def row_jitter() -> Row:
    ok, why = netem_available()
    if not ok:
        return Row("jitter", note=f"not run: {why}; jitter needs netem (iptables cannot delay)")
    return Row("jitter", note="not run: netem is present but thcnet.links shapes delay only, "
                              "not jitter")


def row_worker_killed(tb, numel: int) -> Row:
    """Worker 2 is killed mid-stream; the others must fail naming it, in bounded time; then
    the whole run restarts (new run id, seq 0) and must be exact with no manual step."""
    deadline = 3.0
    before = _counters(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(_argv(tb, numel, deadline=deadline))
    _progress(tb, before, 50)
    procs[2].kill()
    killed_at = time.perf_counter()
    failed = _wait(procs, 60)
    noticed = time.perf_counter() - killed_at
    survivors = [r for i, r in enumerate(failed) if i != 2]
    named = all(r.get("missing") == [2] or "error" not in r for r in survivors)
    restart = _stream_row("worker killed", tb, numel)
    done, drops = _delta(before, _counters(tb))
    causes = sorted({r.get("error", "finished") for r in survivors})
    wrong = sum(r.get("mismatches", 0) for r in failed)
    exact = restart.exact if not wrong else False
    note = (f"killed after 50 chunks; survivors: {', '.join(causes)}"
            + (" naming worker 2" if named else " NOT naming worker 2")
            + f"; all exited {noticed:.1f}s after the kill (deadline {deadline:g}s); then all 4 "
              f"restarted as a new run: {restart.sums}")
    return Row("worker killed mid-round, run restarted", tb.kind,
               restart.sums if not wrong else f"WRONG: {wrong} sums differ", done,
               restart.retransmissions, time.perf_counter() - t0, drops, note, exact)


def row_aggregator_restarted(tb, numel: int) -> Row:
    deadline = 3.0
    before = _counters(tb)
    t0 = time.perf_counter()
    procs = tb.start_workers(_argv(tb, numel, deadline=deadline))
    _progress(tb, before, 50)
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
    note = (f"killed (SIGKILL) after 50 chunks and started again: workers "
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


def row_time(target: float) -> str:
    return f"vector count sized from a probe vector for about {target:g} s of streaming"


def row_long_stream(n_workers: int, seconds: float, prefer_mininet: bool) -> Row:
    with open_testbed(n_workers, prefer_mininet=prefer_mininet) as tb:
        tb.start_aggregator()
        numel = tb.job.lanes * 512
        probe = _stream_row("probe", tb, numel)
        rounds = max(1, round(seconds / max(probe.stream_seconds, 0.01)))
        row = _stream_row(f"{n_workers} workers streaming {seconds:g} s", tb, numel,
                          rounds=rounds, timeout=seconds * 4 + 120,
                          note=f"{rounds} vectors of {numel} elements per worker, each "
                               f"checked; {row_time(seconds)}")
    return row


# -- the table ------------------------------------------------------------------------------

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
             "the row.", "",
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
    lines += ["", "Wrong sums: " + (", ".join(wrong) if wrong else "none in any row") + "."]
    return "\n".join(lines) + "\n"


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
        if want("loss"):
            add(row_loss(pct, numel, mininet))
    if want("dup") or want("reorder") or want("worker") or want("aggregator"):
        with open_testbed(N_WORKERS, prefer_mininet=mininet) as tb:
            tb.start_aggregator()
            if want("dup"):
                add(row_impair(tb, "duplication", numel, dup=0.05))
            if want("reorder"):
                add(row_impair(tb, "reordering", numel, reorder=0.05))
            if want("worker"):
                add(row_worker_killed(tb, numel * 8))
            if want("aggregator"):
                add(row_aggregator_restarted(tb, numel * 8))
    if want("jitter"):
        add(row_jitter())
    if want("bmv2"):
        for row in bmv2_rows(numel // 8, mininet):
            add(row)
    if want("stream"):
        add(row_long_stream(8, stream_s, mininet))
    text = render(rows, args.quick, time.perf_counter() - t0)
    if not only:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    return 1 if any(r.exact is False for r in rows) else 0
