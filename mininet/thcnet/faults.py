"""``thc faults``: the fault matrix. Every row streams real chunks through an aggregator under
one fault and checks every worker's sums bit for bit against a reference computed from the
indices sent (:mod:`thc.emu.smoke_worker`); ``make faults`` writes the table to docs/faults.md.

Rows, on the software aggregator and again on BMv2: loss on the worker links (Mininet:
iptables/nftables statistic drops, or netem), duplication, reordering and jitter (the
transport's :class:`thc.net.impair.Impairment`; on BMv2 the workers' side only), a worker
killed mid-round and the run restarted, the aggregator restarted mid-stream (on BMv2 the
switch crashed, restarted and re-programmed), an out-of-step worker (its process also sends
MAX packets at its DATA chunks' seqs), forged replies from a process that is not the
aggregator, a relaunch under a reused run id, bounded loss (DLCP) with a straggler, and 8
workers streaming for a minute; on BMv2 also the controller restarted and a job re-installed
while another runs. A row that cannot run here says why instead of a figure.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from thc.argtypes import writable_path
from thc.codec.settings import Settings
from thc.emu.bmv2rows import BMV2_MATRIX_KEYS, BMV2_WINDOW, bmv2_matrix, bmv2_rows
from thc.lifetime import Terminated, signals_raise, stopped_by
from thc.emu.faultrows import (row_aggregator_restarted, row_impair, row_jitter, row_long_stream,
                              row_loss, row_worker_killed)
from thc.emu.matrix import N_WORKERS, Row
from thc.emu.protorows import row_out_of_step, row_reused_run, row_spoofed, straggler_testbed_row
from thc.emu.testbed import open_testbed

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="smaller vectors and a 10 s stream instead of 60 s")
    parser.add_argument("--out", default="out/faults.md",
                        help="the table's markdown (`make faults`: docs/faults.md)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--loopback", action="store_true", help="do not use Mininet")
    parser.add_argument("--only", default=None,
                        help="comma-separated row keys or their prefixes: loss (loss-1, "
                             "loss-5, loss-20), dup, reorder, jitter, worker, aggregator, "
                             "out-of-step, spoofed, reused-run, straggler, stream, bmv2 "
                             "(bmv2-matrix-loss, ..., bmv2-matrix-out-of-step, "
                             "bmv2-matrix-spoofed, bmv2-matrix-reused-run, "
                             "bmv2-matrix-straggler, bmv2-controller, bmv2-stream); prints "
                             "the table instead of writing --out")


ROW_KEYS = ("loss-1", "loss-5", "loss-20", "dup", "reorder", "jitter", "worker", "aggregator",
            "out-of-step", "spoofed", "reused-run", "straggler", "stream", *BMV2_MATRIX_KEYS,
            "bmv2-controller", "bmv2-stream")
"""Every row's ``--only`` key."""


# -- the table ------------------------------------------------------------------------------

EXACTNESS_CASES = """\
## The exactness cases

Thirteen ways a client would accept a wrong sum or wait without an error, and the rule of
docs/protocol.md that prevents each (a slot use's op and offset, slot and version checked
against seq, acknowledgements, REFUSED replies, run jumps and idle runs, an epoch per
install, one incarnation per run, the job's configuration tag upstream, the client's
acceptance checks). Each is a test that runs
on every aggregator (Python, compiled, both sharded, BMv2 where present) and, where a client
is involved, both client windows, and fails without its rule, except where the case needs
one: case 12's lossy, restarted shard is the Python aggregator; the matrix rows above run
four of them with real processes.

| case | without the rule | the rule | tests, rows |
|---|---|---|---|
| 1. a MAX at a sum's seq, a DATA at a MAX's, a FLUSH at a MAX use | the MAX sets its bit and the count and adds nothing; a DATA adds onto the previous use's leftovers (254 + 127 wraps to 125); a FLUSH at a MAX use multicasts an impossible RESULT | refused (`wrong_use`), nothing added; results are built from the use | `tests/conformance/test_exactness.py` (max_at_a_sums_seq, data_after_a_max_use, offset_differs); row *out-of-step worker* |
| 2. a RESULT from a stranger with the real epoch | taken by a client window (sums 99 where 30 is possible) | ignored: only the chunk's aggregator, every field matching, each lane a sum of table values (the own one included where the bitmap has it) | `tests/test_runs.py` (a_strangers_result), `tests/test_client_datapath.py` (hostile replies); row *spoofed replies* |
| 3. `client.run = <the same id>`, or restarted workers under the same run id | round 2 (true sum 6) returns round 1's sums (2) | the setter refuses an id that is not newer; the aggregator refuses a second incarnation (`reused_run`) | `tests/test_exactness_clients.py` (run_id_that_is_not_newer, same_run_id_cannot_repeat, restarted_worker_under_the_same_run_id), `test_exactness.py` (second_incarnation); row *reused run id* |
| 4. a slot or version that is not the seq's; a packet at seq cur + 2^31 - 1 | overwrites another chunk's partial use; dead-ends a slot version for the run | `wrong_slot` refused; a far newer seq is held until every worker moved past the previous use | `test_exactness.py` (slot_or_version_that_is_not_the_seqs, far_newer_seq_waits) |
| 5. bounded loss (0.75) with a worker 0.5 s late; a lost RESULT and two FLUSHes | all three workers raise AggregationTimeout | a new use waits until every worker acknowledged the previous one; a worker told its chunk is held retransmits it, never flushes it (if that PENDING is lost, its timer flushes the chunk, which may then close empty: a loss counted against the bound) | `test_exactness_clients.py` (bounded_loss_with_a_straggler, chunk_held_for_a_gone_worker), `test_exactness.py` (new_use_waits); row *bounded loss with a straggler* |
| 6. a software re-install within a run | the epoch stays: a worker's retransmission starts a fresh use and hangs; a re-install with another table gives 26 instead of 4 | every install draws a new epoch: the run fails with AggregatorRestarted | `test_exactness.py` (each_install_answers_with_a_new_epoch), `test_exactness_clients.py` (reinstall_within_a_run) |
| 7. one packet with a far-future run id | locks the job out until a re-install (every later clock run times out) | refused while the job's run is live (jump bound 2^24); any run takes a job idle for 60 s; a refused client fails at once naming the job's run | `test_exactness.py` (far_future_run), `test_exactness_clients.py` (far_future_run) |
| 8. `AggregationClient(window=-1)`, or `client.window = 0` later | the Python window loops forever, past its deadline | refused whenever set | `test_exactness_clients.py` (window_that_cannot_hold_a_chunk) |
| 9. an aggregator installed with another table, granularity or sum width | a client window takes its sums (794 of 1024 lanes not the workers' sum) | every epoch carries the job's configuration tag: the first reply raises AggregatorMisconfigured | `test_exactness_clients.py` (installed_with_another_configuration), `test_transport.py` (other_lanes_or_pool) |
| 10. a peer's FLUSHes for a worker whose job has no loss bound | every chunk comes back closed short (count 0) and the round returns | a short RESULT beyond the worker's bound (any, without one) raises LossBoundExceeded; `aggregate()` refuses short chunks | `test_dlcp.py` (short_result_without_a_loss_bound, beyond_n_times_the_bound) |
| 11. a software re-install with the installed nonce, or after a remove | the epoch stays: a client whose run spans it meets slots that forgot its chunk and blames a worker that had sent it (missing worker(s) [0]) | no install repeats the job's last epoch: a given nonce equal to it is refused, a drawn one differs, and the last epoch outlives a remove | `tests/test_fastagg.py` (no_install_repeats_the_jobs_last_epoch) |
| 12. bounded loss over two shards; shard 1's replies to a worker lost until shard 1 restarts, after its peer took the chunk full | the worker's FLUSH opens a closed, empty use at the restarted shard: it takes count 0 where its peer took count 2, and neither raises | a worker closes a chunk short only at a shard it heard in an earlier round of the run: it resends, and its timeout names the restart | `test_exactness_clients.py` (shard_first_heard_in_the_round_closes_no_chunk_short); row *bounded loss with a straggler* (late to the second round) |
| 13. a worker configured with another job whose payload has the job's size (another table; a vote job of 1024 lanes beside a THC job of 256) | the aggregator sums its indices into its peers' chunk: the peer takes sums of 12, 4 of its own and 8 read in the job's table from an index the worker drew from another | every upstream packet carries its job's configuration tag in `bitmap`: refused (`wrong_config`), nothing added; the peer's timeout names the worker missing, the worker raises AggregatorMisconfigured | `test_exactness_clients.py` (configured_with_another_job), `test_exactness.py` (another_configuration) |

`tests/model_fuzz.py` checks every engine against the reference model over random
interleavings of all these packets (`make fuzz`: a million steps), with an oracle that knows
every worker's payload. The Tofino program is checked without a Tofino:
`tests/test_tna_slot_state.py` executes its pass 0 and its adding passes from its text
(`tests/tna/`), replies and sums, against the reference model on the same kinds of
interleavings (`make fuzz` runs 2000 of them, 600 000 packets, after the engines), held uses
(case 5), `wrong_use` (case 1), `wrong_slot` (case 4), `reused_run` (case 3) and the run jump
and idle rules (case 7) included; docs/switch.md ("Held uses") lists where it differs.
"""


def render(rows: list[Row], quick: bool, elapsed: float, only: str = "") -> str:
    flags = " --quick" if quick else ""
    made = f"`thc faults --only {only}{flags}`" if only else f"`make faults` (`thc faults{flags}`)"
    lines = ["# Fault matrix", "",
             f"Generated by {made} in {elapsed:.0f} s on "
             f"{time.strftime('%Y-%m-%d', time.gmtime())} (UTC), "
             f"{platform.node() or 'this machine'} ({platform.machine()}, Linux "
             f"{platform.release()}). Each row streams real chunks (4-bit indices, "
             f"{N_WORKERS} workers unless said) through the software aggregator (`thc "
             "aggregator`) unless marked BMv2, and every worker checks its sums bit for bit "
             "against a reference computed from the indices all workers sent "
             "(`thc.emu.smoke_worker`); each launch draws its own seed and each round rolls "
             "every worker's indices, so a result replayed from another round or launch "
             "differs from the reference.", "",
             "Columns: *sums*: the check; *rounds*: chunks completed by the aggregator (all "
             "workers' contributions summed); *retx*: retransmissions by the workers; *time*: "
             "wall seconds of the row; *drops*: the aggregator's drop counters by reason during "
             "the row (on BMv2 the switch's counters, read through the controller; packets "
             "the emulated links drop are not the aggregator's and are given in the notes).",
             "",
             "This kernel has no netem: loss is iptables/nftables statistic drops, and jitter "
             "is transport-level (`thc.net.impair.Impairment` delays each packet by a random "
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
    unfired = [f"{r.name} ({r.unfired})" for r in rows if r.unfired]
    ran = sum(not not_run(r) for r in rows)
    lines += ["", "Wrong sums: " + (", ".join(wrong) if wrong else
                                    "none in any row" if ran == len(rows) else
                                    f"none in the {ran} row(s) that ran, of {len(rows)}" if ran
                                    else "no row ran, so none was checked") + "."]
    if unfired:
        lines += ["", "Faults that did not happen (their rows show nothing about them): "
                  + ", ".join(unfired) + "."]
    lines += ["", EXACTNESS_CASES]
    return "\n".join(lines)


def not_run(row: Row) -> bool:
    """Whether the row was not run (its testbed or tool unavailable): it checked nothing."""
    return row.note.startswith("not run")


def run(args: argparse.Namespace) -> int:
    numel = (1 << 17) if args.quick else (1 << 19)
    stream_s = 10.0 if args.quick else 60.0
    mininet = not args.loopback
    only = [p.strip() for p in (args.only or "").split(",") if p.strip()]
    if args.only is not None and not only:
        print(f"thc faults: --only {args.only!r} names no row; the rows: {', '.join(ROW_KEYS)}",
              file=sys.stderr)
        return 2
    unknown = [p for p in only if not any(key.startswith(p) for key in ROW_KEYS)]
    if unknown:
        print(f"thc faults: --only {','.join(unknown)} names no row; the rows: "
              f"{', '.join(ROW_KEYS)}", file=sys.stderr)
        return 2
    try:
        Settings.from_env()     # the aggregators and workers it starts read the THC_* ones
    except ValueError as e:
        print(f"thc faults: {e}", file=sys.stderr)
        return 2
    for flag, path in (("--out", None if only else args.out), ("--json", args.json)):
        try:            # found at the end of the matrix, this lost its rows
            path and writable_path(path)
        except argparse.ArgumentTypeError as e:
            print(f"thc faults: {flag}: {e}", file=sys.stderr)
            return 2
    want = lambda key: not only or any(key.startswith(p) for p in only)  # noqa: E731
    rows: list[Row] = []
    t0 = time.perf_counter()

    def add(row: Row) -> None:
        rows.append(row)
        print(f"{row.name}: {row.sums}; rounds {row.rounds}; retx {row.retransmissions}; "
              f"drops {row.drops}; {row.note}", flush=True)

    try:
        with signals_raise():   # SIGTERM, as Ctrl-C, ends the matrix with a line
            _matrix(want, add, numel, stream_s, mininet)
    except (KeyboardInterrupt, Terminated) as e:
        how, code = stopped_by(e)
        print(f"\nthc faults: {how}; {len(rows)} row(s) done, printed above; no report "
              f"written", file=sys.stderr)
        return code
    text = render(rows, args.quick, time.perf_counter() - t0, ",".join(only))
    if not only:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    if any(r.exact is False for r in rows):
        return 1
    if rows and all(not_run(r) for r in rows):
        print("thc faults: no row ran (each row's note says why)", file=sys.stderr)
        return 2
    return 0


def _matrix(want, add, numel: int, stream_s: float, mininet: bool) -> None:
    """The rows ``want`` takes, each handed to ``add`` as it is done."""
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
