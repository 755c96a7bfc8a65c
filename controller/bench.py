"""``thc bench switch``: THC aggregation through BMv2 vs BMv2 forwarding the same frames with l2.p4.

Both programs run in the same simple_switch_grpc process, one after the other, in the same
run: the THC program (p4src/build/thc.json) aggregates DATA packets of one job whose workers
sit on ``--workers`` veth ports; then l2.p4 forwards frames of the same size from one port to
another. Frames are offered at a paced rate slightly above what the switch sustains (found
by a short probe), so the sender does not starve the switch of CPU; the switch's own rate is
read from its counters (THC: the job's ``packets`` counter) or from the kernel's receive
count of the egress veth (L2).

Reported: ``pps`` (DATA packets the switch aggregated per second), ``coords_per_s`` (pps x
lanes / workers: coordinates of the job's vector summed a second, as ``thc bench
aggregator`` counts them), ``completion_ratio`` (completions x workers / packets over the
whole measurement of a sum width, the probe at an offered rate far above the switch's and the
search included: 1.0 when no packet was lost on the way into the switch), the RESULT bytes
per packet of the job's sum width, and the ratio of the THC rate to the L2 rate, for each
sum width of ``--sum-bits`` (8: four lanes a 32-bit register word, 16: two). The kind of
BMv2 build: whether its libraries still carry the per-packet log messages (a build without
--disable-logging-macros formats them for every table, about 3x slower on the per-lane
program: docs/switch.md), beside the measured l2.p4 rate.

With ``--lanes-sweep 16,64`` (needs p4c), variants of the program with fewer lanes are
generated and compiled into a temporary directory and measured too: the slope gives the cost
of one lane (its lookup table and register action) in BMv2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from thc.argtypes import non_negative_float, positive_int, positive_ints, seconds
from thc.controller import counters, forwarding, job_entries, jobs, toolchain
from thc.controller.frames import udp_frame
from thc.controller.switch import BUILD_DIR, SwitchError
from thc.controller.testing.bmv2 import LocalBMv2
from thc.controller.testing.variant import build_variant
from thc.bench import add_common, emit_json
from thc.codec.packing import pack_bits
from thc.wire import protocol as P
from thc.wire.jobs import ConfigError, Job, Worker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--workers", type=positive_int, default=4,
                        help="workers (= switch ports)")
    parser.add_argument("--duration", type=seconds, default=None,
                        help="seconds measured per program (default 5; 1 with --quick)")
    parser.add_argument("--pool", type=positive_int, default=256,
                        help="slots of the benchmark job")
    parser.add_argument("--rate", type=non_negative_float, default=0.0,
                        help="offered packets/s (default: 1.3 x a probe of the switch)")
    parser.add_argument("--sum-bits", type=positive_ints, default="8,16",
                        help="sum widths of the benchmark job, each measured (8 and/or 16)")
    parser.add_argument("--lanes-sweep", type=positive_ints, default=(),
                        help="comma-separated lane counts to compile and measure as well "
                             "(needs p4c), e.g. 16,64")


def bench_job(workers: int, pool: int, lanes: int, sum_bits: int = 0) -> Job:
    """The benchmark's job (``sum_bits`` 0: the narrowest that holds its sums): ConfigError
    where ``--workers``, ``--pool`` or ``--sum-bits`` cannot make one (checked before the
    switch starts, and again with its lanes)."""
    if not 1 <= workers <= P.MAX_WORKERS:   # before a Worker is built for each
        raise ConfigError(f"job 1: {workers} workers; 1..{P.MAX_WORKERS} supported")
    job = Job(job_id=1, workers=tuple(
                  Worker(i, f"10.0.1.{i + 1}", 30000 + i, f"02:00:00:00:01:{i + 1:02x}", i)
                  for i in range(workers)),
              table=tuple(range(0, 31, 2)), granularity=30, pool_size=pool, lanes=lanes,
              sum_bits=sum_bits).validate()
    if pool > P.SWITCH_SLOTS:
        raise ConfigError(f"a pool of {pool} slots does not fit the switch's "
                          f"{P.SWITCH_SLOTS}")
    return job


class Pacer:
    """Send frames from a generator at ``rate`` per second in ~1 ms bursts (own thread)."""

    def __init__(self, send, frames, rate: float):
        import threading
        self.send, self.frames, self.rate = send, frames, rate
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        batch = max(1, int(self.rate / 1000))
        interval = batch / self.rate
        nxt = time.perf_counter()
        frames, send = self.frames, self.send
        while not self._stop.is_set():
            for _ in range(batch):
                port, frame = next(frames)
                send(port, frame)
            self.sent += batch
            nxt += interval
            delay = nxt - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            elif delay < -0.05:
                nxt = time.perf_counter()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU time of each thread of a process, from /proc."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[task.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def measure(read, send, frames, rate: float, duration: float, warmup: float = 0.5,
             pid: int | None = None):
    """Offer ``rate`` pps; return (processed per second, offered per second, switch CPU
    seconds per processed packet, CPU seconds of its busiest thread per processed packet;
    both None without ``pid``). BMv2 runs a program's ingress on one thread, so the
    busiest thread's time per packet bounds the rate the switch can reach."""
    with Pacer(send, frames, rate) as pacer:
        time.sleep(warmup)
        u0 = thread_cpu_seconds(pid) if pid else {}
        c0, s0, t0 = read(), pacer.sent, time.perf_counter()
        time.sleep(duration)
        c1, s1, t1 = read(), pacer.sent, time.perf_counter()
        u1 = thread_cpu_seconds(pid) if pid else {}
    time.sleep(0.3)
    per_packet = busiest = None
    if pid and c1 > c0:
        deltas = [u1[t] - u0.get(t, 0.0) for t in u1]
        per_packet = sum(deltas) / (c1 - c0)
        busiest = max(deltas) / (c1 - c0)
    return (c1 - c0) / (t1 - t0), (s1 - s0) / (t1 - t0), per_packet, busiest


def _rate(read, send, frames, args, pid: int) -> dict:
    """The switch's sustained rate: offer a bit more than it takes (probe, then raise the
    offered rate while the switch forwards more); and its CPU time per packet at half that
    rate, which other load on the machine hardly changes."""
    duration = args.duration
    if args.rate:
        pps, offered, _, _ = measure(read, send, frames, args.rate, duration)
    else:
        probe, _, _, _ = measure(read, send, frames, 200_000, 0.5 if args.quick else 1.0,
                                  0.3)
        target = max(200.0, 1.3 * probe)
        best = None
        # Raise the offered rate while the switch forwards more: one saturated reading
        # does not end the search, since on two cores the Python sender and the switch
        # share the CPU and a single reading moves by a few percent.
        for _ in range(6):
            pps, offered, _, _ = measure(read, send, frames, target, duration)
            if best is not None and pps < 1.03 * best[0]:
                break
            if best is None or pps > best[0]:
                best = (pps, offered)
            target = max(target, pps) * 1.5
        pps, offered = best
    _, _, cpu, busiest = measure(read, send, frames, max(50.0, pps / 2), duration, pid=pid)
    return {"pps": pps, "offered_pps": offered,
            "cpu_us_per_packet": None if cpu is None else cpu * 1e6,
            "busiest_thread_us_per_packet": None if busiest is None else busiest * 1e6}


FAST_BUILD_L2_PPS = 40_000
"""l2.p4 rate of a build without logging macros on a free core of a 2-core x86_64 VM (about 40k
packets/s); less means the CPU is busy or the build is slow."""


def build_kind(l2_pps: float) -> str:
    """What BMv2 build this is: whether its libraries carry the per-packet log messages
    (toolchain.bmv2_logging_macros), and the measured l2.p4 rate."""
    lib = toolchain.bmv2_logging_macros()
    if lib:
        return (f"slow: {lib} carries BMv2's per-packet log messages (configured without "
                f"--disable-logging-macros: a per-lane THC program ran 3x slower; rebuild "
                f"BMv2 with --disable-logging-macros); l2.p4 forwards {l2_pps:.0f} packets/s")
    busy = (f" (below the {FAST_BUILD_L2_PPS} a free core gives: the CPU is busy)"
            if l2_pps < FAST_BUILD_L2_PPS else "")
    return (f"fast: no per-packet log messages in BMv2's libraries (--disable-logging-macros); "
            f"l2.p4 forwards {l2_pps:.0f} packets/s{busy}")


RUN = 1
"""Run id of the benchmark's packets (any nonzero value: one run)."""


def _thc_frames(job, agg, rng, lanes):
    """Endless (port, frame) DATA packets: every worker sends chunk 0, 1, 2, ... in turn,
    with its UDP checksum, as a worker's kernel sends them (the switch verifies it)."""
    import itertools

    import numpy as np

    payloads = [pack_bits(rng.integers(0, 16, lanes).astype(np.uint8), P.INDEX_BITS).tobytes()
                for _ in range(16)]
    pack = P.HEADER_STRUCT.pack
    pool = job.pool_size
    for seq in itertools.count():
        slot, version = seq % pool, (seq // pool) % 2
        for w in job.workers:
            yield w.switch_port, udp_frame(
                w.mac, agg.agg_mac, w.ip, agg.agg_ip, w.port, P.UDP_PORT,
                pack(P.PktType.DATA, w.id, job.job_id, slot, version, 0, seq & 0xFFFFFFFF,
                     (seq * lanes) & 0xFFFFFFFF, job.config_tag, RUN, 0)
                + payloads[(seq + w.id) % 16], ident=seq, checksum=True)


def bench_thc(args, build_dir, label: str, sum_bits: int = 8) -> dict:
    import numpy as np

    agg = job_entries.AggAddress()
    with LocalBMv2(args.workers, program="thc", build_dir=build_dir, receive=False) as bm:
        sw = bm.sw
        lanes = sw.lanes
        job = bench_job(args.workers, args.pool, lanes, sum_bits)
        t0 = time.perf_counter()
        idx = jobs.install_job(sw, job, agg)
        install_s = time.perf_counter() - t0
        frames = _thc_frames(job, agg, np.random.default_rng(0), lanes)

        def read():
            return counters.job_counters(sw, idx)["packets"]

        c0 = counters.job_counters(sw, idx)
        res = _rate(read, bm.send, frames, args, bm.proc.pid)
        c1 = counters.job_counters(sw, idx)
        drops = counters.drops(sw)
        res.update({
            "program": label, "lanes": lanes, "workers": args.workers, "sum_bits": sum_bits,
            "result_payload_bytes": P.payload_bytes(P.PktType.RESULT, lanes, sum_bits),
            "frame_bytes": len(next(frames)[1]),
            "coords_per_s": res["pps"] * lanes / args.workers,
            "completion_ratio": ((c1["completions"] - c0["completions"]) * args.workers
                                 / max(1, c1["packets"] - c0["packets"])),
            "install_seconds": install_s,
            "stale_drops": drops["stale"],
        })
        return res


def bench_l2(args, frame_bytes: int) -> dict:
    import itertools

    with LocalBMv2(2, program="l2", receive=False) as bm:
        dst = "02:00:00:00:02:02"
        forwarding.install(bm.sw, {dst: 1})
        pad = frame_bytes - P.ETH_IP_UDP_BYTES
        frame = udp_frame("02:00:00:00:02:01", dst, "10.0.2.1", "10.0.2.2", 1000, 2000,
                          bytes(pad))
        frames = itertools.repeat((0, frame))
        res = _rate(lambda: bm.rx_packets(1), bm.send, frames, args, bm.proc.pid)
        res.update({"program": "l2.p4", "frame_bytes": len(frame)})
        return res


def _us(v) -> str:
    return "n/a" if v is None else f"{v:.0f} us"


def _free_core_rate(us) -> str:
    """The rate a free core would allow the busiest thread: an estimate, labelled so."""
    return "" if not us else f", about {1e6 / us:.0f} packets/s on a free core (an estimate)"


def _ratio(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _refusal(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot run here: a job they cannot make (a mistake, told on any
    machine), then a missing tool."""
    if any(w not in P.SUM_WIDTHS for w in args.sum_bits):
        return f"--sum-bits takes widths from {list(P.SUM_WIDTHS)}"
    for bits in args.sum_bits:
        try:
            bench_job(args.workers, args.pool, P.LANES, bits)
        except ConfigError as e:
            return f"--workers {args.workers} --pool {args.pool} --sum-bits {bits}: {e}"
    for lanes in args.lanes_sweep:
        try:
            P.check_lanes(lanes, switch=True)
        except ValueError as e:
            return f"--lanes-sweep {lanes}: {e}"
    for program in ("thc", "l2"):
        if reason := toolchain.bmv2_missing(program):
            return reason
    if args.lanes_sweep and (reason := toolchain.p4c_missing()):
        return f"--lanes-sweep needs p4c: {reason}"
    return None


def _show(runs: list[dict], l2: dict, bmv2_build: str) -> None:
    for r in runs:
        print(f"thc.p4 ({r['lanes']} lanes, {r['sum_bits']}-bit sums, {r['workers']} "
              f"workers): {r['pps']:.0f} packets/s = {r['coords_per_s'] / 1e6:.2f} M "
              f"coordinates/s (offered {r['offered_pps']:.0f}/s), RESULT payload "
              f"{r['result_payload_bytes']} bytes; / l2.p4: {r['ratio_to_l2']:.3f}")
        print(f"  switch CPU {_us(r['cpu_us_per_packet'])} per packet; l2.p4's / thc.p4's "
              f"(an estimate of their rate ratio on an idle core, from CPU time per packet): "
              f"{_ratio(r['cpu_ratio_to_l2'])}")
        print(f"  busiest switch thread (BMv2 runs ingress on one): "
              f"{_us(r['busiest_thread_us_per_packet'])} per packet"
              f"{_free_core_rate(r['busiest_thread_us_per_packet'])}")
    print(f"l2.p4, same {l2['frame_bytes']}-byte frames: {l2['pps']:.0f} packets/s "
          f"(offered {l2['offered_pps']:.0f}/s), switch CPU "
          f"{_us(l2['cpu_us_per_packet'])} per packet, busiest thread "
          f"{_us(l2['busiest_thread_us_per_packet'])}")
    print(f"BMv2 build: {bmv2_build}")


def _lanes_sweep(args: argparse.Namespace, thc: dict, l2: dict) -> dict:
    """thc.p4 compiled for each of ``--lanes-sweep``'s lane counts and benched: the cost of a
    lane and of a packet, fitted over them and the default build."""
    import tempfile

    import numpy as np

    points = [(thc["lanes"], thc["pps"])]
    sweep = [{"lanes": thc["lanes"], "pps": thc["pps"], "us_per_packet": 1e6 / thc["pps"]}]
    with tempfile.TemporaryDirectory(prefix="thc-lanes-") as tmp:
        for lanes in args.lanes_sweep:
            build = Path(tmp) / f"lanes{lanes}"
            compile_s = build_variant(build, lanes=lanes)
            r = bench_thc(args, build, f"thc.p4 variant, {lanes} lanes")
            points.append((lanes, r["pps"]))
            sweep.append({"lanes": lanes, "pps": r["pps"], "us_per_packet": 1e6 / r["pps"],
                          "compile_seconds": compile_s})
            print(f"variant {lanes} lanes: {r['pps']:.0f} packets/s "
                  f"({1e6 / r['pps']:.0f} us/packet)")
    x = np.array([p[0] for p in points], float)
    y = np.array([1e6 / p[1] for p in points])
    slope, intercept = np.polyfit(x, y, 1)
    print(f"per lane: {slope:.2f} us, fixed: {intercept:.0f} us per packet "
          f"(l2.p4: {1e6 / l2['pps']:.0f} us per packet)")
    return {"lanes_sweep": sweep, "us_per_lane": float(slope),
            "us_fixed_per_packet": float(intercept), "us_per_packet_l2": 1e6 / l2["pps"]}


def run(args: argparse.Namespace) -> int:
    if reason := _refusal(args):
        print(f"thc bench switch: {reason}", file=sys.stderr)
        return 2
    if args.duration is None:
        args.duration = 1.0 if args.quick else 5.0
    try:
        runs = [bench_thc(args, BUILD_DIR, "thc.p4", bits) for bits in args.sum_bits]
        thc = runs[0]
        l2 = bench_l2(args, thc["frame_bytes"])
        for r in runs:
            r["ratio_to_l2"] = r["pps"] / l2["pps"] if l2["pps"] else None
            r["cpu_ratio_to_l2"] = (l2["cpu_us_per_packet"] / r["cpu_us_per_packet"]
                                    if r["cpu_us_per_packet"] and l2["cpu_us_per_packet"]
                                    else None)
        result = {
            "bench": "switch",
            "target": "BMv2 simple_switch_grpc --log-level off, veth ports, paced offered load",
            "bmv2_build": build_kind(l2["pps"]),
            "thc": thc, "thc_by_sum_bits": {str(r["sum_bits"]): r for r in runs}, "l2": l2,
            "ratio_to_l2": thc["ratio_to_l2"],
        }
        _show(runs, l2, result["bmv2_build"])
        if args.lanes_sweep:
            result.update(_lanes_sweep(args, thc, l2))
    except (SwitchError, RuntimeError, OSError) as e:
        print(f"thc bench switch: {e}", file=sys.stderr)
        return 1
    emit_json(args, result)
    return 0
