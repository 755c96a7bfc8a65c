"""The fault matrix on BMv2: the rows again through the software switch, and what only a
switch has (the controller restarted, a job re-installed while another runs)."""
from __future__ import annotations

import contextlib
import json
import time

from thc.emu.base import bmv2_unavailable_reason
from thc.emu.faultrows import JITTER_S, row_switch_restarted, row_worker_killed
from thc.emu.matrix import (N_WORKERS, check_sums, controller_cmd, halt, launch_seed,
                           p4_build_stale, Row, stream_row, until_dir, wait_workers)
from thc.emu.protorows import row_out_of_step, row_reused_run, row_spoofed, straggler_testbed_row
from thc.emu.testbed import TestbedError, open_testbed

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
    why = bmv2_unavailable_reason() or p4_build_stale()
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
                row = stream_row(f"{pct}% loss (BMv2)", tb, numel, window=BMV2_WINDOW)
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
                rows.append(stream_row(
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



def _bmv2_drops(tb) -> dict:
    try:
        raw = json.loads(controller_cmd(tb, "counters", "--json"))
    except (TestbedError, ValueError):
        return {}
    return {k: v for k, v in raw.get("drops", {}).items() if v}


def bmv2_rows(numel: int, prefer_mininet: bool) -> list[Row]:
    """The controller restarted mid-stream, and one job re-installed while another streams;
    both on BMv2 with two jobs (workers 0-1 and 2-3), sums checked as everywhere."""
    import dataclasses

    names = ("controller restarted mid-stream (BMv2)",
             "job re-installed while another runs (BMv2)")
    why = bmv2_unavailable_reason() or p4_build_stale()
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
        controller_cmd(tb, "install", "--config", str(paths["both"]), "--prune")
        agg = f"{tb.agg_addr[0]}:{tb.agg_addr[1]}"

        def argv(cfg, first, until):
            seed = launch_seed()
            return lambda r: ["python", "-m", "thc.emu.smoke_worker", "--rank", str(r - first),
                              "--config", str(cfg), "--agg", agg, "--numel", str(numel),
                              "--seed", str(seed), "--deadline", "30",
                              "--rounds", str(1 << 30), "--until", str(until)]

        for name, action in ((names[0], ("install", "--config", str(paths["both"]))),
                             (names[1], ("install", "--config", str(paths["b"])))):
            t0 = time.perf_counter()
            # the workers stream until the controller is done, then stop at one round
            until = until_dir(tb)
            procs = tb.start_workers(argv(paths["a"], 0, until), ranks=[0, 1])
            time.sleep(2.0)
            refused = False
            try:
                out = controller_cmd(tb, *action)
                note = f"`thc controller {' '.join(action[:1])}` mid-stream: " + (
                    out.strip().splitlines() or ["ok"])[-1][:200]
            except TestbedError as e:
                note, refused = f"the controller refused: {e}"[:300], True
            streaming = all(p.poll() is None for p in procs)
            halt(until, procs)
            results = wait_workers(procs, 600)
            sums, exact, retx = check_sums(results)
            rounds = sum(r.get("rounds", 0) for r in results[:1])
            row = Row(name, "mininet+bmv2", sums, f"{rounds} vectors", retx,
                      time.perf_counter() - t0, _bmv2_drops(tb),
                      f"job 1 (workers 0-1) streams; {note}", exact)
            if refused:
                row = row.not_fired("the controller refused")
            elif not streaming:
                row = row.not_fired("a worker finished before the controller was done")
            rows.append(row)
    return rows

