"""``thc bench install``: how long the controller takes to install, re-install and remove a job
on BMv2, and what writing its lookup entries costs as serialized entities (the controller's
path, controller/p4rt.py) against protobuf messages (the baseline), in the same run.

A job holds thousands of lookup entries, and p4runtime-shell's protobuf pin means the
pure-Python runtime: this benchmark is the evidence for writing them serialized.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from thc.argtypes import positive_int
from thc.controller import job_entries, jobs, toolchain
from thc.controller.bench import bench_job
from thc.controller.switch import SwitchError
from thc.controller.testing.bmv2 import LocalBMv2
from thc.bench import add_common, emit_json
from thc.wire import protocol as P
from thc.wire.jobs import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, quick=False)     # nothing to make smaller: --quick would be ignored
    parser.add_argument("--workers", type=positive_int, default=4,
                        help="workers (= switch ports)")
    parser.add_argument("--pool", type=positive_int, default=256, help="slots of the job")
    parser.add_argument("--repeat", type=positive_int, default=3,
                        help="runs; medians are reported")


def _as_messages(sw, blobs: list[bytes]) -> list[tuple]:
    """(table, match, action, params) by name of serialized entries: what the baseline
    builds as messages inside its timing."""
    from p4.v1 import p4runtime_pb2
    tables = {t.preamble.id: t for t in sw.p4info.tables}
    actions = {a.preamble.id: a for a in sw.p4info.actions}
    out = []
    for blob in blobs:
        te = p4runtime_pb2.Entity.FromString(blob).table_entry
        t, a = tables[te.table_id], actions[te.action.action.action_id]
        fields = {f.id: f.name for f in t.match_fields}
        pnames = {p.id: p.name for p in a.params}
        out.append((t.preamble.name,
                    {fields[m.field_id]: int.from_bytes(m.exact.value, "big") for m in te.match},
                    a.preamble.name,
                    {pnames[p.param_id]: int.from_bytes(p.value, "big")
                     for p in te.action.action.params}))
    return out


def _timed(fn) -> float:
    job_entries.forget_lut_entries()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(args) -> dict:
    runs: dict[str, list[float]] = {k: [] for k in (
        "install", "reinstall", "remove", "lut_serialized", "lut_messages")}
    with LocalBMv2(args.workers, receive=False) as bm:
        sw = bm.sw
        job = bench_job(args.workers, args.pool, sw.lanes)
        specs = _as_messages(sw, job_entries.lut_entries(sw, job, 0))
        keys = job_entries.lut_entries(sw, job, 0, with_action=False)
        for _ in range(args.repeat):
            runs["install"].append(_timed(lambda: jobs.install_job(sw, job)))
            runs["reinstall"].append(_timed(lambda: jobs.install_job(sw, job, force=True)))
            runs["remove"].append(_timed(lambda: jobs.remove_job(sw, job.job_id, force=True)))
            runs["lut_serialized"].append(_timed(
                lambda: sw.write_entries("INSERT", job_entries.build_lut_entries(sw, job, 0))))
            sw.write_entries("DELETE", keys)
            runs["lut_messages"].append(_timed(lambda: sw.write_entries(
                "INSERT", [sw.table_entry(*spec) for spec in specs])))
            sw.write_entries("DELETE", keys)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"bench": "install", "lut_entries": len(specs), "workers": args.workers,
            "pool": args.pool, "repeat": args.repeat, "median_seconds": med, "runs": runs,
            "messages_over_serialized": med["lut_messages"] / med["lut_serialized"]}


def run(args: argparse.Namespace) -> int:
    try:   # a mistake in the flags is told on any machine, before a missing tool
        bench_job(args.workers, args.pool, P.LANES)
    except ConfigError as e:
        print(f"thc bench install: --workers {args.workers} --pool {args.pool}: {e}",
              file=sys.stderr)
        return 2
    reason = toolchain.bmv2_missing("thc")
    if reason:
        print(f"thc bench install: {reason}", file=sys.stderr)
        return 2
    try:
        res = bench(args)
    except (SwitchError, RuntimeError, OSError) as e:
        print(f"thc bench install: {e}", file=sys.stderr)
        return 1
    m = res["median_seconds"]
    print(f"job with {res['lut_entries']} lookup entries, {res['workers']} workers, "
          f"{res['pool']} slots (median of {res['repeat']}):")
    print(f"  install {m['install']:.2f} s, re-install (forced) {m['reinstall']:.2f} s, "
          f"remove {m['remove']:.2f} s")
    print(f"  lookup entries written serialized {m['lut_serialized']:.2f} s, as protobuf "
          f"messages (baseline) {m['lut_messages']:.2f} s: "
          f"{res['messages_over_serialized']:.1f}x")
    emit_json(args, res)
    return 0
