"""The fault matrix script: a row runs end to end, and a wrong sum fails the matrix."""
from __future__ import annotations

import argparse
import time

import numpy as np
import pytest

from thc.emu import faults, matrix


def test_a_wrong_sum_is_reported_and_fails_the_matrix(monkeypatch, capsys):
    ok = faults.Row("ok", "loopback", "exact (4/4 workers)", 8, 0, 1.0, {}, "", True)
    bad = faults.Row("bad", "loopback", "WRONG: 3 sums differ", 8, 0, 1.0, {"stale": 2}, "",
                     False)
    text = faults.render([ok, bad], quick=True, elapsed=2.0)
    assert "| bad | loopback | WRONG: 3 sums differ | 8 | 0 | 1.0 | stale 2 |" in text
    assert "Wrong sums: bad." in text
    assert f" on {time.strftime('%Y-%m-%d', time.gmtime())} (UTC), " in text   # its date
    # the matrix's exit status: 1 where a row's sums were wrong (the loss rows stand in)
    args = argparse.Namespace(quick=True, out="-", json=None, loopback=True, only="loss-")
    monkeypatch.setattr(faults, "row_loss", lambda pct, numel, mininet: ok)
    assert faults.run(args) == 0
    monkeypatch.setattr(faults, "row_loss", lambda pct, numel, mininet: bad if pct == 5 else ok)
    assert faults.run(args) == 1
    assert "Wrong sums: bad." in capsys.readouterr().out


def test_duplication_and_jitter_rows_on_loopback(tmp_path, capsys):
    args = argparse.Namespace(quick=True, out=str(tmp_path / "f.md"), json=None, loopback=True,
                              only="dup,jitter")
    assert faults.run(args) == 0
    out = capsys.readouterr().out
    assert "duplication: exact (4/4 workers); rounds 512" in out
    assert "jitter: exact (4/4 workers); rounds 512" in out
    assert "transport-level jitter" in out


def test_bmv2_rows_say_why_they_did_not_run_on_loopback(tmp_path, capsys):
    args = argparse.Namespace(quick=True, out=str(tmp_path / "f.md"), json=None, loopback=True,
                              only="bmv2-matrix,bmv2-stream")
    assert faults.run(args) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "(BMv2)" in ln
             and ln.startswith("|")]
    names = [ln.split("|")[1].strip() for ln in lines]
    assert names == ["1% loss (BMv2)", "5% loss (BMv2)", "20% loss (BMv2)",
                     "duplication (BMv2)", "reordering (BMv2)", "jitter (BMv2)",
                     "worker killed mid-round, run restarted (BMv2)",
                     "switch restarted mid-stream (BMv2)", "out-of-step worker (BMv2)",
                     "spoofed replies (BMv2)", "reused run id (BMv2)",
                     "bounded loss with a straggler (BMv2)", "8 workers streaming 10 s (BMv2)"]
    assert all("not run:" in ln for ln in lines)


def test_protocol_rows_on_loopback(tmp_path, capsys, monkeypatch):
    """An out-of-step worker, forged replies, a reused run id and a straggler under bounded
    loss: every row exact, each fault doing what the protocol says, each launch of workers
    (the reused run's relaunch included) with a seed of its own."""
    from thc.emu.base import Testbed
    seeds, start = [], Testbed.start_workers

    def spy(self, argv_for, *a, **k):
        argv = argv_for(0)
        if "--seed" in argv:
            seeds.append(argv[argv.index("--seed") + 1])
        return start(self, argv_for, *a, **k)
    monkeypatch.setattr(Testbed, "start_workers", spy)
    args = argparse.Namespace(quick=True, out=str(tmp_path / "f.md"), json=None, loopback=True,
                              only="out-of-step,spoofed,reused-run,straggler")
    assert faults.run(args) == 0
    assert len(seeds) >= 6 and len(set(seeds)) == len(seeds), seeds
    out = capsys.readouterr().out
    for name in ("out-of-step worker", "spoofed replies", "reused run id",
                 "bounded loss with a straggler"):
        assert f"{name}: exact (4/4 workers)" in out, out
    assert "refused as wrong_use;" in out            # every injected MAX refused
    assert "4/4 AggregationRefused (reused_run)" in out
    assert "4/4 finished" in out and "the same on every worker" in out


def test_the_bitmap_reference_sums_only_the_counted_workers():
    from thc.emu.smoke_worker import bitmap_mismatches, bitmap_reference, indices

    table, lanes, numel = list(range(16)), 4, 10    # 3 chunks, the last one short of lanes
    lut = np.asarray(table)
    bitmaps = np.array([0b11, 0b10, 0], np.uint32)
    ref = bitmap_reference(table, 2, 7, numel, lanes, bitmaps)
    a, b = lut[indices(7, 0, numel)], lut[indices(7, 1, numel)]
    np.testing.assert_array_equal(ref, np.concatenate([a[:4] + b[:4], b[4:8], [0, 0]]))
    assert bitmap_mismatches(ref, ref, [2, 1, 0], bitmaps, lanes) == 0
    assert bitmap_mismatches(ref, ref, [2, 2, 0], bitmaps, lanes) == lanes  # count != bits


def _completions(tb) -> int:
    """Chunks the testbed's aggregator completed, as its stats file last said."""
    counters = tb.aggregator_counters() or {}
    return sum(job.get("completions", 0) for job in counters.get("jobs", {}).values())


def test_halted_workers_wait_at_one_round_however_late_the_stop_is_named(tmp_path):
    """The driver may be descheduled between reading the workers' progress and naming the
    round to stop at (a count taken from progress read while they run was passed before it
    was written, and one worker then waited 30 s for a round its peer never sent): halted
    workers report one count (a worker that sent the next round first waits in it,
    reporting nothing), make no progress while the driver is away, and stop together one
    round later."""
    from thc.emu.testbed import open_testbed

    with open_testbed(2, prefer_mininet=False) as tb:
        tb.start_aggregator()
        until = tmp_path / "until"
        until.mkdir()
        procs = tb.start_workers(matrix.worker_argv(tb, tb.job.lanes * 4, rounds=1 << 30,
                                                    deadline=30.0, until=str(until)))
        end = time.monotonic() + 60   # a loaded machine starts its workers late
        while not _completions(tb) and time.monotonic() < end:
            time.sleep(0.05)
        assert _completions(tb), "the workers completed no chunk in 60 s"
        (until / "halt").touch()
        end = time.monotonic() + 60
        while not any(until.glob("done-*")) and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(1.0)   # the driver, away
        counts = {f.read_text() for f in until.glob("done-*")}
        assert len(counts) == 1, counts
        halted = int(counts.pop())
        (until / "stop").write_text(str(halted + 1))
        results = matrix.wait_workers(procs, 60)
    assert [r.get("error") for r in results] == [None, None], results
    assert [r["rounds"] for r in results] == [halted + 1] * 2 and halted > 0


def test_a_timed_stream_stops_every_worker_after_the_same_round():
    from thc.emu.testbed import open_testbed

    with open_testbed(2, prefer_mininet=False) as tb:
        tb.start_aggregator()
        for seconds in (1.0, 4.0):   # a loaded machine may fit one vector in the first
            row = matrix.stream_for("timed", tb, tb.job.lanes * 4, seconds, "test")
            vectors = int(row.note.split(" vectors")[0])
            if vectors >= 2:
                break
    assert row.exact is True and row.sums == "exact (2/2 workers)"
    assert vectors >= 2 and row.rounds == vectors * 4


def test_a_worker_that_fails_after_a_clean_result_line_counts_as_crashed(tmp_path):
    import json
    import subprocess
    import sys

    from thc.emu.procs import Proc, with_parent

    def launch(argv, stdout, stderr):
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=with_parent())
    line = json.dumps({"rank": 0, "mismatches": 0, "rounds": 1, "stats": {}})
    procs = [Proc.start(f"w{rc}", [sys.executable, "-c",
                                   f"import sys; print({line!r}, flush=True); "
                                   f"sys.stderr.write('torn down'); sys.exit({rc})"],
                        tmp_path, launch) for rc in (0, 134)]
    results = matrix.wait_workers(procs, 30)
    assert "error" not in results[0], results
    assert results[1]["error"] == "crashed" and "exited 134" in results[1]["message"]
    assert "torn down" in results[1]["message"]
    assert matrix.check_sums(results)[0].startswith("exact where returned (1/2 finished")



def _worker_over(tmp_path, monkeypatch, capsys, answer, rounds: int):
    """smoke_worker (rank 0 of a 2-worker job, seed 7) through a client stand-in whose round
    ``k`` returns ``answer(k, right_sums_of_round_k)`` (or raises): (exit code, JSON line)."""
    import json
    import types

    from thc.emu import smoke_worker
    from thc.testing.clusters import free_port_block, local_job
    from thc.wire.jobs import Cluster
    job = local_job(1, 2, free_port_block(2))
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(job,)).save(cfg)
    numel = job.lanes * 2
    right = smoke_worker.reference_sums(job.table, job.n_workers, 7, numel)

    class Client:
        loss_bound, stats, done = 0.0, types.SimpleNamespace(sent=2), 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def reduce(self, packed):
            k, Client.done = Client.done, Client.done + 1
            fresh = np.roll(right, smoke_worker.round_shift(k, numel))
            return types.SimpleNamespace(sums=answer(k, fresh))
    Client.job = job
    monkeypatch.setattr(smoke_worker.worker, "client_from_args", lambda *a, **k: Client())
    rc = smoke_worker.main(["--rank", "0", "--config", str(cfg), "--numel", str(numel),
                            "--seed", "7", "--rounds", str(rounds)])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1]), right


def test_a_worker_that_took_a_wrong_sum_and_then_failed_reports_it(tmp_path, monkeypatch,
                                                                    capsys):
    """Only three kinds of failure printed a line: a worker that took a wrong sum and then
    failed any other way (its loss bound exceeded, say) printed none, and its row read
    "exact where returned"."""
    from thc.net.outcomes import LossBoundExceeded

    def answer(k, fresh):
        if k == 1:
            raise LossBoundExceeded("chunk 1", 1, 2, [1], 0.0, 0, 2)
        return fresh + 1   # every element off by one
    rc, line, right = _worker_over(tmp_path, monkeypatch, capsys, answer, 3)
    assert rc == 3 and line["error"] == "LossBoundExceeded"
    assert line["mismatches"] == right.size and line["rounds"] == 1
    assert matrix.check_sums([line])[:2] == (f"WRONG: {right.size} sums differ (seed 7)", False)


def test_a_result_replayed_from_an_earlier_round_is_a_wrong_sum(tmp_path, monkeypatch, capsys):
    """Every round sent the same vector, so a client that returned round 1's sums again in
    round 2 (exactness case 3) matched the reference: each round now rolls every worker's
    indices by its own shift."""
    results = []

    def answer(k, fresh):
        results.append(fresh if k != 2 else results[1])   # round 2 replays round 1's
        return results[-1]
    rc, line, right = _worker_over(tmp_path, monkeypatch, capsys, answer, 4)
    assert rc == 1 and line["rounds"] == 4 and line["mismatches"] > right.size // 2, line
    from thc.emu import smoke_worker
    assert line["sha256"] == smoke_worker.digest(right)   # the last round, in reference order


def test_each_launch_of_workers_draws_its_own_seed(tmp_path):
    """Every launch used seed 4242, so a result replayed across a restart or to a relaunched
    run matched the new launch's reference: each worker_argv (one launch) now draws a seed
    of its own, and a relaunch under the same run calls it again."""
    import types

    tb = types.SimpleNamespace(cluster_path=tmp_path / "cluster.json", agg_addr=("10.0.0.9", 9))

    def seed_of(argv):
        a = argv(0)
        return int(a[a.index("--seed") + 1])
    seeds = [seed_of(matrix.worker_argv(tb, 256)) for _ in range(3)]
    assert len(set(seeds)) == 3, seeds
    # ranks draw seed + r: no two launches of up to 100 workers share a worker's vector
    assert min(abs(a - b) for a in seeds for b in seeds if a != b) >= 100


def test_a_row_whose_fault_did_not_happen_is_not_exact(capsys):
    """A spoofed row whose forgeries reached no worker, or a straggler row with no chunk
    closed short, read "exact" and passed: the row now says its fault did not happen, is not
    counted exact, and the matrix lists it."""
    row = faults.Row("spoofed replies", "loopback", "exact (4/4 workers)", 8, 0, 1.0, {}, "",
                     True).not_fired("no forged reply reached a worker")
    assert row.exact is None
    assert row.sums == "fault not shown (no forged reply reached a worker): exact (4/4 workers)"
    text = faults.render([row], quick=True, elapsed=1.0)
    assert ("Faults that did not happen (their rows show nothing about them): spoofed replies "
            "(no forged reply reached a worker).") in text
    assert "Wrong sums: none in any row." in text
    wrong = faults.Row("w", "loopback", "WRONG: 1 sums differ", 8, 0, 1.0, {}, "", False)
    assert wrong.not_fired("x").exact is False   # a wrong sum stays one


def test_a_forger_whose_replies_come_from_another_port_shows_nothing(monkeypatch):
    """The spoofed row counts the forgeries a client ignored from the aggregator's port at
    another address (TransportStats.elsewhere): replies ignored for other reasons (late
    copies of the aggregator's own, forgeries from another port) do not make the fault
    happen, and the row then says so instead of reading exact."""
    from thc.emu import protorows
    from thc.emu.testbed import open_testbed

    def other_port(tb):
        bind = f"{tb.agg_addr[0]}:{tb.agg_addr[1] + 1}"
        return "agg", bind, f"the aggregator's host, another port ({bind})"
    monkeypatch.setattr(protorows, "forger_address", other_port)
    monkeypatch.setattr(protorows, "DEFAULT_SPOOF_CHUNKS", 16384)
    with open_testbed(matrix.N_WORKERS, prefer_mininet=False) as tb:
        tb.start_aggregator()
        row = protorows.row_spoofed(tb, 1 << 17)
    assert row.unfired == "no forged reply reached a worker" and row.exact is None, row


@pytest.mark.bmv2
def test_the_bmv2_controller_rows_change_the_switch_while_the_workers_stream():
    """Each worker streamed one vector, and finished before the controller did: the rows
    showed nothing of the install mid-stream. Now they stream until it is done."""
    from thc.emu.bmv2rows import bmv2_rows
    from thc.emu.testbed import bmv2_unavailable_reason, mininet_unavailable_reason

    if why := mininet_unavailable_reason() or bmv2_unavailable_reason():
        pytest.skip(f"Mininet with BMv2 not available: {why}")
    rows = bmv2_rows(1 << 15, prefer_mininet=True)
    assert [(r.unfired, r.exact) for r in rows] == [("", True), ("", True)], rows
    assert all(int(r.rounds.split()[0]) >= 2 for r in rows), rows
