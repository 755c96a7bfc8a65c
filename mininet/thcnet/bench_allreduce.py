"""``thc bench allreduce``: THC vs FP32 all-reduce of one gradient over emulated links.

For each link bandwidth, Mininet testbeds of N worker hosts on a Linux bridge, every link
(an aggregator's included) at the same bandwidth, run in the same worker hosts:

- ``fp32``: torch.distributed Gloo ``all_reduce`` (ring) of a ``numel``-element float32 tensor;
- ``fp16``: the same ring on the tensor cast to float16 (``--ring``);
- ``thc-dist``: THC with its integer sums carried by the same Gloo ring, no aggregator
  (``--ring``);
- ``thc-sharded``: THC through software aggregator shards, one co-located on every worker
  host, each owning 1/N of the chunks (THC's parameter-server layout; the default);
- ``thc-central``: THC through one central software aggregator on its own host (its link
  ``--agg-bw-factor`` x the workers', default 1), with ``--aggregator ...,central``;
- ``thc-bmv2``: THC through the BMv2 switch (a testbed whose switch is BMv2), when
  simple_switch_grpc and the compiled program are present, on ``--bmv2-numel`` elements (BMv2
  adds a few thousand packets a second), beside ``fp32`` on the same elements in the same
  testbed; its row says how many elements it measured, and nothing is scaled to ``numel``.

The software aggregators are whatever `thc aggregator` runs.

Each mode: one untimed warm-up round, then ``--repeat`` timed rounds, each started after a
barrier; a round's time is its slowest worker's, the figure is the median round. Bytes on the
wire are read from each worker's interface counters around every timed round and compared with
the computed ideal on the busiest link (rings: 2(p-1)/p x 4 bytes per element each way in
MSS-sized TCP segments, 2 for FP16, 1 or 2 for THC's sums; THC: INDEX_BITS/8 up and sum_bits/8
down per element (8 or 16 bits, from workers x granularity), plus the per-packet
THC/UDP/IP/Ethernet headers; sharded: (p-1)/p of both on every worker link, each way, as a
worker's own chunks to its co-located shard stay on the host; central: p times the sums down the
aggregator's link).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from thc.argtypes import positive_floats, positive_int
from thc.bench import add_common, emit_json, figure, save_figure
from thc.codec import settings
from thc.codec.params import THCParams
from thc.wire import protocol as P
from thc.emu import testbed
from thc.emu.testbed import (
    TestbedError,
    WorkerError,
    bmv2_unavailable_reason,
    mininet_unavailable_reason,
    open_testbed,
)
from thc.emu.wirebytes import annotate

BMV2_WINDOW, BMV2_RTO = 2, 0.25
"""BMv2 runs the 256-lane program at a few hundred packets/s: more chunks in flight only
queue in the switch and, with a short timeout, turn into spurious retransmissions."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, plot="out/allreduce.png")
    parser.add_argument("--numel", type=positive_int, default=None,
                        help="gradient elements (default 25,000,000; --quick: 2,000,000)")
    testbed.add_arguments(parser, timeout=1800.0)
    parser.add_argument("--bw", type=positive_floats, default="100,1000",
                        help="comma-separated link Mbit/s")
    parser.add_argument("--aggregator", default="sharded,bmv2", type=_aggregators,
                        help="THC through which aggregators, comma-separated from "
                             f"{','.join(LAYOUTS)} (default sharded,bmv2: BMv2 when available; "
                             "central: the single software aggregator on its own host)")
    parser.add_argument("--repeat", type=positive_int, default=None,
                        help="timed rounds per mode (default 3; --quick: 1)")
    testbed.add_job_arguments(parser, lanes=0, pool_size=128, window=32)
    parser.add_argument("--error-feedback", action="store_true",
                        help="include THC's error-feedback update in the timed round")
    parser.add_argument("--ring", default="fp16,thc-dist", type=_rings,
                        help="all-reduces through the Gloo ring beside FP32, comma-separated "
                             f"from {','.join(RINGS)} (default both; '' for none)")
    parser.add_argument("--bmv2-numel", type=positive_int, default=1 << 18,
                        help="elements timed through BMv2 and, for its baseline, FP32 in the "
                             "same testbed (BMv2 adds a few thousand packets a second)")


LAYOUTS = {"sharded": "sharded", "central": "software", "bmv2": "bmv2"}
"""--aggregator names and the testbed aggregator each runs on."""


RINGS = ("fp16", "thc-dist")
"""Modes that need no aggregator: they run in the first testbed, after FP32."""


def _rings(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in RINGS]
    if bad:
        raise argparse.ArgumentTypeError(f"ring modes must come from {','.join(RINGS)}, "
                                         f"got {text!r}")
    return names


def _aggregators(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in LAYOUTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"aggregators must come from {','.join(LAYOUTS)}, "
                                         f"got {text!r}")
    return names


# -- running one mode -------------------------------------------------------------------------

def _run_mode(tb, mode: str, args, numel: int, repeat: int, window: int | None = None,
              rto: float | None = None) -> dict:
    master = f"{tb.master_addr[0]}:{tb.master_addr[1]}"
    common = ["--world", str(tb.n_workers), "--rendezvous", master, "--numel", str(numel),
              "--repeat", str(repeat), "--warmup", "1"]
    if mode in ("fp32",) + RINGS:
        extra = ["--mode", mode]
        if mode == "thc-dist" and args.error_feedback:
            extra.append("--error-feedback")
    else:
        extra = ["--mode", "thc", "--config", str(tb.cluster_path),
                 "--window", str(window or args.window)]
        if tb.agg_addr:  # a sharded job's shard map names its aggregators
            extra += ["--agg", f"{tb.agg_addr[0]}:{tb.agg_addr[1]}"]
        if rto:
            extra += ["--rto", str(rto)]
        if args.error_feedback:
            extra.append("--error-feedback")

    def argv(r):
        a = ["python", "-m", "thc.bench.allreduce_worker", "--rank", str(r)] + common + extra
        if tb.kind == "mininet":
            a += ["--intf", tb.worker_intf(r)]
        return a

    agg_link = getattr(tb, "agg_wire_bytes", lambda: None)
    load = os.getloadavg()[0]
    agg_cpu0 = tb.aggregator_cpu_seconds()
    before, agg_before = tb.wire_bytes(), agg_link()
    t0 = time.monotonic()
    results = tb.run_workers(argv, timeout=args.timeout)
    wall = time.monotonic() - t0
    after, agg_after = tb.wire_bytes(), agg_link()
    agg_cpu1 = tb.aggregator_cpu_seconds()
    rows = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    rounds = [max(row["times"][i] for row in rows) for i in range(repeat)]
    out = {"mode": mode, "numel": numel, "seconds": statistics.median(rounds), "rounds": rounds,
           "per_worker_seconds": [statistics.median(row["times"]) for row in rows],
           "identical_results": len({row["sha256"] for row in rows}) == 1,
           "nmse": rows[0]["nmse"], "nmse_of_zeros": rows[0].get("nmse_of_zeros"),
           "wall_seconds": wall,
           "loadavg_1min_before": load, "cores": os.cpu_count()}
    if all(row.get("cpu_seconds") for row in rows):
        # CPU the workers spent inside timed rounds (summed over workers, median round), and
        # the aggregator processes' CPU over the whole run divided by its rounds (warm-up incl.)
        cpu = {"workers": statistics.median(
            sum(row["cpu_seconds"][i] for row in rows) for i in range(repeat))}
        if agg_cpu0 is not None and agg_cpu1 is not None:
            cpu["aggregators"] = (agg_cpu1 - agg_cpu0) / (repeat + 1)
        out["cpu_seconds_per_round"] = cpu
    if all(row["wire"] for row in rows):
        tx = statistics.mean(statistics.mean(w[0] for w in row["wire"]) for row in rows)
        rx = statistics.mean(statistics.mean(w[1] for w in row["wire"]) for row in rows)
        out["host_veth_per_worker"] = {"tx": tx, "rx": rx}
        out["wire_per_worker"] = out["host_veth_per_worker"]
    if before and after:
        # whole run (warm-up + timed rounds + barriers), from the switch ports, per round
        k = repeat + 1
        ports = {r: ((after[r][0] - before[r][0]) / k, (after[r][1] - before[r][1]) / k)
                 for r in after}
        out["switch_port_bytes_per_round"] = ports
        if tb.bw_mbit is not None:
            # the shapers' counts: a host's veth counts a TSO skb or GSO burst with one header
            out["wire_per_worker"] = {"tx": statistics.mean(v[0] for v in ports.values()),
                                      "rx": statistics.mean(v[1] for v in ports.values())}
    if agg_before and agg_after and mode.startswith("thc-") and mode != "thc-dist":
        k = repeat + 1
        out["agg_link_bytes_per_round"] = {"tx": (agg_after[0] - agg_before[0]) / k,
                                           "rx": (agg_after[1] - agg_before[1]) / k}
    if mode.startswith("thc"):
        phases = {}
        for key in rows[0]["phases"][0]:
            phases[key] = statistics.median(
                max(row["phases"][i][key] for row in rows) for i in range(repeat))
        out["phases_slowest_worker"] = phases
        out["transport"] = rows[0].get("transport")
        if rows[0].get("client_datapath"):
            out["client_datapath"] = rows[0]["client_datapath"]
        counters = (tb.aggregator_counters()
                    if tb.aggregator in ("software", "sharded") and mode != "thc-dist" else None)
        if counters:
            out["aggregator_counters"] = counters
    return out


def _fmt_bytes(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e6:,.1f}"


def _software_modes(args, bw: float, layout: str | None, point: dict, result: dict,
                    numel: int, repeat: int, agg_bw_factor: float) -> None:
    """One testbed of ``point``: FP32 and the rings in the first, then THC through the
    software ``layout`` (each layout a testbed of its own)."""
    p = args.workers
    with open_testbed(p, bw_mbit=bw, aggregator=LAYOUTS[layout] if layout else "none",
                      prefer_mininet=not args.loopback, agg_bw_factor=agg_bw_factor,
                      lanes=args.lanes, pool_size=args.pool_size) as tb:
        shaped = f"{bw:g} Mbit/s" if tb.kind != "loopback" else "unshaped"
        print(f"\n[{shaped}] {tb.describe()}", flush=True)
        if "fp32" not in point["modes"]:
            point["testbed"] = tb.kind
            if tb.kind == "loopback":
                point["bw_mbit"] = None
                result["notes"].append("loopback testbed: links not emulated, times are "
                                       "CPU-bound plumbing checks, not bandwidth results")
            for mode in ["fp32"] + args.ring:
                point["modes"][mode] = _run_mode(tb, mode, args, numel, repeat)
                _progress(point["modes"][mode])
        if layout:
            tb.start_aggregator()
            m = _run_mode(tb, f"thc-{layout}", args, numel, repeat)
            m["aggregator_counters"] = tb.stop_aggregator()
            point["modes"][f"thc-{layout}"] = m
            _progress(m)


def _bmv2_modes(args, bw: float, point: dict, numel: int, repeat: int) -> None:
    """THC through BMv2 on at most ``--bmv2-numel`` elements, with FP32 on as many beside it,
    through the same switch: the other modes' FP32 crossed a Linux bridge, far faster than
    BMv2, even where the sizes match."""
    with open_testbed(args.workers, bw_mbit=bw, aggregator="bmv2",
                      pool_size=min(args.pool_size, P.SWITCH_SLOTS)) as tb:
        tb.start_aggregator()   # the switch forwards nothing, FP32's TCP included, before
        small = min(numel, args.bmv2_numel)
        base = _run_mode(tb, "fp32", args, small, repeat)   # its own baseline
        point["modes"]["fp32-bmv2-size"] = base
        _progress(base)
        m = _run_mode(tb, "thc-bmv2", args, small, repeat, window=BMV2_WINDOW, rto=BMV2_RTO)
        m["baseline"] = "fp32-bmv2-size"
        if small < numel:
            print(f"  thc-bmv2 measured on {small:,} elements, not {numel:,} "
                  "(--bmv2-numel); compared with FP32 on the same elements", flush=True)
        try:
            m["switch_counters"] = json.loads(tb.switch.counters())
        except ValueError:
            pass
        point["modes"]["thc-bmv2"] = m
        _progress(m)


def run(args: argparse.Namespace) -> int:

    numel = args.numel if args.numel is not None else 2_000_000 if args.quick else 25_000_000
    repeat = args.repeat if args.repeat is not None else 1 if args.quick else 3
    bws = args.bw
    p = args.workers
    if p < 2:
        print(f"thc bench allreduce: --workers {p}: an all-reduce of one worker exchanges "
              f"nothing (give 2 or more)", file=sys.stderr)
        return 2
    sum_bits = P.sum_bits_for(p, THCParams().granularity)
    if args.lanes == 0:
        args.lanes = P.max_software_lanes(sum_bits)
    try:
        P.check_lanes(args.lanes, sum_bits=sum_bits)
    except ValueError as e:   # before a testbed starts, not in its aggregators
        print(f"thc bench allreduce: --lanes {args.lanes} ({p} workers, {sum_bits}-bit sums): "
              f"{e}", file=sys.stderr)
        return 2
    try:
        settings.current()                  # a bad THC_* variable
    except ValueError as e:
        print(f"thc bench allreduce: {e}", file=sys.stderr)
        return 2
    if why := testbed.agg_bw_conflict(args, central="central" in args.aggregator) or \
            testbed.memory_conflict(p, numel):
        print(f"thc bench allreduce: {why}", file=sys.stderr)
        return 2
    want_bmv2 = "bmv2" in args.aggregator
    soft = [a for a in args.aggregator if a != "bmv2"]
    agg_bw_factor = args.agg_bw_factor or 1.0
    result = {"numel": numel, "workers": p, "repeat": repeat, "lanes_software": args.lanes,
              "lanes_bmv2": P.LANES, "pool_size": args.pool_size, "window": args.window,
              "aggregators": args.aggregator, "agg_bw_factor": agg_bw_factor,
              "error_feedback": args.error_feedback, "rings": args.ring,
              "bmv2_numel": min(numel, args.bmv2_numel), "points": [], "notes": []}

    bmv2_reason = None
    if want_bmv2:
        bmv2_reason = mininet_unavailable_reason("bmv2") if not args.loopback else "--loopback"
        if bmv2_reason is None:
            bmv2_reason = bmv2_unavailable_reason()
        if bmv2_reason:
            note = f"thc-bmv2 skipped: not available: {bmv2_reason}"
            result["notes"].append(note)
            print(note, file=sys.stderr)
            if not soft:   # refused before any work: no report
                return 2

    print(f"all-reduce of {numel:,} float32 elements, {p} workers, "
          f"median of {repeat} round(s) after 1 warm-up")
    try:
        for bw in bws:
            point = {"bw_mbit": bw, "modes": {}}
            if result["points"] and result["points"][-1]["testbed"] == "loopback":
                break  # no link emulation: one point says everything
            for layout in soft or [None]:
                _software_modes(args, bw, layout, point, result, numel, repeat, agg_bw_factor)
            if want_bmv2 and not bmv2_reason:
                _bmv2_modes(args, bw, point, numel, repeat)
            annotate(point, p, args.lanes, agg_bw_factor)
            result["points"].append(point)
    except (TestbedError, WorkerError) as e:
        print(f"thc bench allreduce: {e}", file=sys.stderr)
        emit_json(args, {**result, "complete": False, "error": str(e)})   # the points before
        return 1
    except KeyboardInterrupt:
        print("\nthc bench allreduce: interrupted; testbed torn down", file=sys.stderr)
        return 130

    _print_table(result)
    wrong = failed_checks(result)
    if wrong:
        print(f"thc bench allreduce: {'; '.join(wrong)}", file=sys.stderr)
    emit_json(args, {**result, "complete": False, "error": "; ".join(wrong)} if wrong else
              result)
    if args.plot:
        _plot(result, args.plot)
    return 1 if wrong else 0


def failed_checks(result: dict) -> list[str]:
    """What makes a finished run no measurement: workers that ended with different results,
    or an estimate no closer to the mean than zeros (a timing of wrong sums)."""
    wrong = []
    for point in result["points"]:
        for name, m in point["modes"].items():
            at = (f"{name} at {point['bw_mbit']} Mbit/s" if point["bw_mbit"] else
                  f"{name} on the loopback")
            if not m.get("identical_results", True):
                wrong.append(f"{at}: the workers' results differ")
            zeros, nmse = m.get("nmse_of_zeros"), m.get("nmse")
            if zeros and nmse is not None and not nmse < zeros / 2:
                wrong.append(f"{at}: NMSE {nmse:.3g}, no better than half an all-zero "
                             f"estimate's {zeros:.3g}")
    return wrong


def _progress(m: dict) -> None:
    print(f"  {m['mode']:<13} {m['numel']:>12,} elements {m['seconds']:8.3f} s  (rounds: "
          + ", ".join(f"{t:.3f}" for t in m["rounds"]) + ")", flush=True)


def _print_table(result: dict) -> None:
    print(f"\n{'Mbit/s':>7} {'mode':<15} {'elements':>11} {'seconds':>8} {'speedup':>8} "
          f"{'ideal x':>8} {'wire x':>7} {'tx MB':>8} {'rx MB':>8} {'ideal s':>8}  note")
    for point in result["points"]:
        for name, m in point["modes"].items():
            w = m.get("wire_per_worker", {})
            sp = m.get("speedup_vs_fp32")
            note = ""
            if "phases_slowest_worker" in m:
                ph = m["phases_slowest_worker"]
                note = "phases: " + " ".join(f"{k} {v:.2f}" for k, v in ph.items())
                if m.get("client_datapath"):
                    note += f"  client {m['client_datapath']}"
            if m.get("nmse") is not None and name != "fp32":
                note += f"  nmse {m['nmse']:.4f}"
            if "cpu_seconds_per_round" in m:
                c = m["cpu_seconds_per_round"]
                note += (f"  cpu s/round: workers {c['workers']:.1f}"
                         + (f" aggregators {c['aggregators']:.1f}" if "aggregators" in c else "")
                         + f" ({m['cores']} cores, load {m['loadavg_1min_before']:.1f})")
            if "baseline" in m:
                note += f"  speedup against {m['baseline']} (same elements)"
            if "agg_link_bytes_per_round" in m:
                al = m["agg_link_bytes_per_round"]
                note += (f"  aggregator link tx {_fmt_bytes(al['tx'])} rx "
                         f"{_fmt_bytes(al['rx'])} MB")
            if not m.get("identical_results", True):
                note += "  RESULTS DIFFER ACROSS WORKERS"
            speedup = f"{sp:.2f}x" if sp else "-" if name != "fp32" else "1.00x"
            ideal_x = f"{m['ideal_ratio']:.2f}x" if "ideal_ratio" in m else "-"
            wire_x = f"{m['measured_wire_ratio']:.2f}x" if "measured_wire_ratio" in m else "-"
            bw = f"{point['bw_mbit']:g}" if point["bw_mbit"] else "lo"
            ideal_s = f"{m['ideal_seconds']:.3f}" if m.get("ideal_seconds") else "-"
            print(f"{bw:>7} {name:<15} {m['numel']:>11,} {m['seconds']:>8.3f} {speedup:>8} "
                  f"{ideal_x:>8} {wire_x:>7} {_fmt_bytes(w.get('tx')):>8} "
                  f"{_fmt_bytes(w.get('rx')):>8} {ideal_s:>8}  {note}")
    for n in result["notes"]:
        print(f"note: {n}")


def _plot(result: dict, path: str) -> None:
    if not any(pt["bw_mbit"] for pt in result["points"]):
        print("no emulated bandwidth points to plot (loopback testbed)")
        return
    fig, axes = figure(6, 4)
    ax = axes[0][0]
    modes = sorted({m for pt in result["points"] for m in pt["modes"]})
    for mode in modes:
        pts = [(pt["bw_mbit"], pt["modes"][mode]["seconds"]) for pt in result["points"]
               if mode in pt["modes"] and pt["bw_mbit"]]
        sizes = {pt["modes"][mode]["numel"] for pt in result["points"] if mode in pt["modes"]}
        small = sizes != {result["numel"]}
        if pts:
            ax.plot(*zip(*pts), marker="o", linestyle="--" if small else "-",
                    label=mode + (f" ({min(sizes):,} elements)" if small else ""))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth (Mbit/s)")
    ax.set_ylabel("seconds per all-reduce")
    ax.set_title(f"all-reduce of {result['numel']:,} float32, {result['workers']} workers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save_figure(fig, path, result.get("recorded"))   # a report read back: its own run
    print(f"wrote {path}")
