"""The main job end to end on the loopback testbed (short: digits, one epoch, two modes)."""
from __future__ import annotations

import argparse
import time
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from thc.emu import mainargs, mainjob, mainreport
from thc.emu.mainreport import step_losses
from tests.procs import gloo_pair


@pytest.mark.slow
def test_main_job_runs_and_reports(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "thc.cli", "run", "--loopback", "--epochs", "1",
         "--data", "digits", "--train-subset", "512", "--batch", "32", "--evals", "2",
         "--workers", "2", "--modes", "fp32,thc", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loopback" in out.stdout + out.stderr, "the fallback must say so"
    report = json.loads((tmp_path / "mainjob.json").read_text())
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == {"fp32", "thc"}
    assert report["recorded"]["command"].endswith(f"--out {tmp_path}")   # and when, where
    for r in runs.values():
        assert len(r["history"]) == 2 and 0.0 <= r["final_accuracy"] <= 1.0
        assert r["wire_bytes"] > 0 and r["dataset"] == "digits" and r["testbed"] == "loopback"
        assert r["stopped"] is None and r["epochs_done"] == 1.0
        assert r["replicas_diverged_at"] is None
        assert all(row["replicas_agree"] is True for row in r["history"])
    # THC moves far fewer bytes than FP32 for the same steps (Marsit's modes: test_marsit).
    assert runs["fp32"]["wire_bytes"] > 4 * runs["thc"]["wire_bytes"]
    # the aggregator client's counters ride along (DDP's ring has none)
    last = runs["thc"]["history"][-1]
    transport = last["transport"]
    assert transport["sent"] > 0 and runs["fp32"]["history"][-1]["transport"] is None
    # the loopback counts rank 0's bytes both ways: THC's sums come back wider than its
    # indices went out, a ring's are as many
    assert last["bytes_received"] - last["bytes_sent"] == \
        transport["bytes_received"] - transport["bytes_sent"] > 0
    assert runs["thc"]["wire_bytes"] == last["bytes_sent"] + last["bytes_received"]
    fp32_last = runs["fp32"]["history"][-1]
    assert fp32_last["bytes_received"] == fp32_last["bytes_sent"] > 0
    # unimpaired, unbounded and unmarked, every round runs on the compiled window where it
    # is built and asked for (test_extensions_built: built wherever a compiler is)
    from thc.net.fastclient import CLIENT_UNAVAILABLE
    compiled = CLIENT_UNAVAILABLE is None and os.environ.get("THC_CLIENT_DATAPATH",
                                                             "auto") != "python"
    assert transport["rounds"] > 0, transport
    assert transport["compiled_rounds"] == (transport["rounds"] if compiled else 0), transport
    assert (f"rounds on the compiled client window, the rest on Python's (rank 0): thc "
            f"{transport['compiled_rounds']} of {transport['rounds']}") in out.stdout
    summary = report["summary"]
    if runs["fp32"]["final_accuracy"] >= 0.2:
        assert summary["target_fp32_minus_1pt"] == runs["fp32"]["final_accuracy"] - 0.01
    else:   # 8 steps may leave it near chance: then no target, and it says why
        assert summary["target_fp32_minus_1pt"] is None
        assert summary["verdict"].startswith("FP32 ended at"), summary["verdict"]
    assert {row["mode"] for row in summary["rows"]} == set(runs)
    assert summary["verdict"] in out.stdout
    assert (tmp_path / "mainjob.png").stat().st_size > 10_000


def _run_of(mode, points, stopped=None):
    hist = [{"seconds": t, "accuracy": a, "steps": i + 1, "epoch": i + 1}
            for i, (t, a) in enumerate(points)]
    return {"mode": mode, "history": hist, "final_accuracy": hist[-1]["accuracy"],
            "train_seconds": hist[-1]["seconds"], "wire_bytes": 1, "epochs_done": 2,
            "stopped": stopped}


def test_time_to_accuracy_summary_names_the_winner():
    from thc.emu.mainreport import summarize, time_to

    fp32 = _run_of("fp32", [(10, 0.70), (20, 0.80), (30, 0.85)])
    thc = _run_of("thc", [(4, 0.72), (8, 0.845), (12, 0.846)])
    topk = _run_of("topk", [(5, 0.60), (9, 0.70)])
    bmv2 = _run_of("thc-bmv2", [(2, 0.90)], stopped="stopped at the 5 s limit")
    assert time_to(fp32["history"], 0.8) == 20 and time_to(topk["history"], 0.8) is None
    s = summarize([fp32, thc, topk, bmv2], 0.8)
    rows = {r["mode"]: r for r in s["rows"]}
    assert rows["thc"]["tta_fp32_minus_1pt"] == 8 and rows["fp32"]["tta_fp32_minus_1pt"] == 30
    assert rows["thc"]["speedup"] == 30 / 8 and rows["topk"]["speedup"] is None
    assert s["verdict"].startswith("thc won") and "3.75x" in s["verdict"]
    assert rows["thc-bmv2"]["stopped"]          # a stopped run never wins
    assert rows["thc-bmv2"]["speedup"] is None  # nor has a speedup printed beside the others
    # exactly one point below FP32 reaches the target, and may win (1 - 0.01 is not -1.0 pp)
    for top in (0.8438, 0.5097):   # 0.5097 - 0.01 is 0.49969999... in floats
        fp32_1 = _run_of("fp32", [(10, 0.40), (20, top)])
        low = _run_of("thc", [(4, 0.42), (8, round(top - 0.01, 4))])
        s = summarize([fp32_1, low], 0.8)
        assert s["verdict"].startswith("thc won"), (top, s["verdict"])
    # nor one whose workers' replicas differed (it won, only warned of)
    split = {**thc, "replicas_diverged_at": 2}
    s = summarize([fp32, split, topk], 0.8)
    assert s["verdict"].startswith("no mode beat FP32"), s["verdict"]
    assert {r["mode"]: r for r in s["rows"]}["thc"]["diverged_at"] == 2
    # FP32 the soonest: no mode beat it, not "fp32 won ... 1.00x sooner than FP32"
    slow = _run_of("thc", [(25, 0.80), (40, 0.85)])
    s = summarize([fp32, slow], 0.8)
    assert s["verdict"] == ("no mode beat FP32: it reached 0.8400 (its final accuracy minus 1 "
                            "point) in 30.0 s of training; the soonest other, thc, in 40.0 s "
                            "(0.75x)"), s["verdict"]
    # FP32 alone ran to a report (the others failed or were stopped): it beat no one
    s = summarize([fp32], 0.8)
    assert s["verdict"] == "no mode but FP32 ran to a report: nothing to compare it with"
    # FP32 stopped at the limit: its last accuracy is no target, and no speedup is claimed
    s = summarize([_run_of("fp32", [(10, 0.55)], stopped="stopped at the 10 s limit"), thc],
                  0.8)
    assert s["verdict"].startswith("FP32 stopped at the time limit")
    assert s["target_fp32_minus_1pt"] is None
    assert all(r["speedup"] is None for r in s["rows"])
    # FP32 at chance (two steps of a quick run): a mode "sooner" to chance wins nothing
    s = summarize([_run_of("fp32", [(10, 0.1056)]), _run_of("thc", [(7, 0.1056)])], 0.8)
    assert s["verdict"].startswith("FP32 ended at 0.1056, below twice chance (0.2): it did "
                                   "not learn in 1 steps"), s["verdict"]
    assert s["target_fp32_minus_1pt"] is None
    assert all(r["speedup"] is None for r in s["rows"])
    # FP32's own replicas differed: a mode twice as slow was named the winner, "0.50x sooner"
    s = summarize([{**fp32, "replicas_diverged_at": 2}, slow], 0.8)
    assert s["verdict"] == ("FP32's workers' replicas differed after step 2: it trained no "
                            "one model, so no speedup against it is claimed"), s["verdict"]
    assert s["target_fp32_minus_1pt"] is None
    assert all(r["speedup"] is None for r in s["rows"])


def test_deadline_stops_every_rank_after_the_same_step_and_evaluates():
    """Rank 0 is out of time after its first step, rank 1 never: both stop after step 1
    (they agree each step), so the run ends in time with an evaluation row, as `thc run`
    needs for a mode that reaches its limit (BMv2)."""
    from thc.testing.clusters import free_tcp_port
    port = free_tcp_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "thc.app.train", "--mode", "fp32", "--rank", str(rank),
         "--world", "2", "--rendezvous", f"127.0.0.1:{port}", "--data", "digits", "--epochs", "3",
         "--batch", "32", "--evals", "1", "--stop-at", "0" if rank == 0 else "1e12"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    rows = [json.loads(line) for line in outs[0][0].splitlines()
            if line.startswith("{") and "accuracy" in line]
    assert len(rows) == 1 and rows[0]["steps"] == 1 and 0.0 <= rows[0]["accuracy"] <= 1.0
    # the digits CNN's first weight (one input channel) has a gradient whose strides differ
    # from the parameter's along that size-1 dimension only: DDP's warning about it (once a
    # process) filled the stderr tails that a failing run's error quotes
    assert "Grad strides" not in outs[0][1] + outs[1][1]


def test_a_step_longer_than_the_margin_is_not_begun_before_the_deadline():
    """Workers stopped after the step during which the deadline passed: a step longer than
    the margin after it (a BMv2 step, a slow link) ran past the mode's limit, which then
    failed the mode instead of stopping it. They stop where their next step, as long as
    their longest, would end past it."""
    import time

    import torch.distributed as dist

    from thc.app.train import _out_of_time
    from thc.testing.clusters import free_tcp_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        soon = time.time() + 20
        assert not _out_of_time(soon, step_s=1.0) and not _out_of_time(None, step_s=1e9)
        assert _out_of_time(soon, step_s=30.0) and _out_of_time(time.time() - 1)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("unlike", [["--epochs", "1", "2"], ["--stop-at", "1e12", None]])
def test_ranks_given_unlike_settings_both_stop_at_once_naming_them(unlike):
    """Each rank decides from its flags alone when it steps, evaluates and stops: ranks given
    another --epochs or --max-steps waited in unlike collectives, silent, for torch's 30
    minutes (with --stop-at on one rank only, its flag's all-reduce paired with the other's
    step). The width, step bound and the rest are compared alike."""
    from thc.testing.clusters import free_tcp_port
    port = free_tcp_port()
    flag, *values = unlike
    procs = [subprocess.Popen(
        [sys.executable, "-m", "thc.app.train", "--mode", "fp32", "--rank", str(rank),
         "--world", "2", "--rendezvous", f"127.0.0.1:{port}", "--data", "digits", "--batch", "32",
         "--evals", "1"] + ([flag, values[rank]] if values[rank] is not None else []),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    name = flag[2:].replace("-", "_")
    name = "stop_at given" if name == "stop_at" else name
    for p, (_, err) in zip(procs, outs):
        assert p.returncode != 0 and "the ranks were given unlike settings" in err, err[-2000:]
        assert f"{name}: rank 0 " in err, err[-2000:]
        assert "accuracy" not in outs[0][0]


def test_ranks_given_flags_that_resolve_alike_train(monkeypatch):
    """--width 64 on one rank and none on the other (the digits model's default), or --lr
    0.05 and the default: the same training, once refused as unlike settings."""
    from thc.app import train
    seen = []
    monkeypatch.setattr("torch.distributed.get_world_size", lambda *a: 2)

    def gather(out, mine):
        out[:] = [mine, seen[0] if seen else mine]
    monkeypatch.setattr("torch.distributed.all_gather_object", gather)
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    plain = parser.parse_args(["--mode", "fp32"])
    given = parser.parse_args(["--mode", "fp32", "--width", "64", "--lr", "0.05"])
    facts = {"params": 1000}
    seen.append(({**{k: getattr(plain, k) for k in train.AGREED}, **facts,
                  "optimizer": train.optimizer_settings(plain)}, None))
    train.check_flags_agree(given, {**facts, "optimizer": train.optimizer_settings(given)})
    with pytest.raises(SystemExit, match=r"epochs: rank 0 5, rank 1 3"):
        train.check_flags_agree(parser.parse_args(["--mode", "fp32", "--epochs", "5"]),
                                {**facts, "optimizer": train.optimizer_settings(plain)})



def test_a_job_made_with_other_thc_flags_is_told_on_every_rank_before_training(
        monkeypatch, tmp_path):
    """--granularity 20 against a job made with 30 failed at the first backward, inside
    DDP's traceback; the ranks now stop at their start, each naming the job's table."""
    from thc.app import train
    from thc.testing.clusters import free_port_block, local_job
    from thc.wire.jobs import Cluster
    cfg = tmp_path / "cluster.json"
    from thc.codec.params import THCParams
    made = THCParams(granularity=30, p=1 / 32)
    Cluster(jobs=(local_job(1, 2, free_port_block(2), granularity=30, table=made.table),)
            ).save(cfg)
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--mode", "thc", "--config", str(cfg), "--granularity", "20"])
    why = train.job_mismatch(args)
    assert why and "job 1 has granularity 30" in why and "--granularity 20" in why, why
    for fine in (["--mode", "thc", "--config", str(cfg)],
                 ["--mode", "thc-dist", "--granularity", "20"],
                 ["--mode", "thc", "--config", str(cfg), "--slice-size", "1000"]):
        # the last: a flag THC refuses is the flags' agreement's and the build's to name
        assert train.job_mismatch(parser.parse_args(fine)) is None
    wide = train.job_mismatch(parser.parse_args(["--mode", "thc", "--config", str(cfg),
                                                 "--bits", "2", "--granularity", "4"]))
    assert wide and "--bits 2" in wide and "the aggregation protocol carries 4-bit indices" \
        in wide
    # rank 1 alone was given the flag: rank 0 stops too, naming rank 1's reason
    monkeypatch.setattr("torch.distributed.get_world_size", lambda *a: 2)
    monkeypatch.setattr("torch.distributed.all_gather_object",
                        lambda out, mine: out.__setitem__(slice(None), [mine, (mine[0], why)]))
    plain = parser.parse_args(["--mode", "thc", "--config", str(cfg)])
    with pytest.raises(SystemExit, match="rank 1: .*job 1 has granularity 30"):
        train.check_flags_agree(plain, {}, None)

@pytest.mark.parametrize("mode, argv", [
    ("topk", ["--no-error-feedback"]), ("fp32", ["--topk-ratio", "0.9"]),
    ("fp16", ["--uncompressed", "bias"]), ("marsit", ["--bits", "2"]),
    ("marsit", ["--slice-size", "7"]), ("topk", ["--granularity", "3"]),
    ("fp32", ["--p", "1/8"]), ("fp32", ["--config", "nonexistent.json"]),
    ("thc-dist", ["--agg", "1.2.3.4:5"]), ("fp16", ["--window", "3"]),
    ("topk", ["--deadline", "1"]), ("marsit", ["--rto", "5"]), ("fp32", ["--run-id", "7"]),
    ("fp32", ["--client-datapath", "python"]), ("thc-dist", ["--client-datapath", "compiled"]),
    ("marsit", ["--codec-cpu", "reference"]), ("topk", ["--codec-cpu", "compiled"])])
def test_train_refuses_flags_its_mode_would_ignore(mode, argv, capsys):
    """Each ran to its end with the flag unread (TopK keeps its error feedback whatever is
    asked; a slice size of 7 was not even checked; the aggregation client's flags, a cluster
    file that does not exist included, where no round goes through an aggregator)."""
    from thc.app import train
    with pytest.raises(SystemExit) as e:
        train.main(["--mode", mode, *argv])
    assert e.value.code == 2
    said = capsys.readouterr().err
    assert f"{argv[0]} applies to --mode" in said and f"--mode {mode} would ignore it" in said


@pytest.mark.parametrize("argv, said", [
    (["--momentum", "nan"], "not a finite number"), (["--momentum", "1"], "lies in [0, 1)"),
    (["--lr", "nan"], "not a finite number"), (["--lr", "0"], "must be above 0"),
    (["--stop-at", "inf"], "not a finite number"),
    (["--mode", "topk", "--topk-ratio", "nan"], "not a finite number"),
    (["--mode", "topk", "--topk-ratio", "0"], "a fraction lies in (0, 1]"),
    (["--mode", "thc-dist", "--slice-size", "3"], "slice_size must be a power of two"),
    (["--mode", "thc-dist", "--bits", "9"], "bits must be an integer in 1..8"),
    (["--mode", "thc-dist", "--bits", "1"], "error feedback diverges with this table")])
def test_train_refuses_settings_no_rank_could_train_with(argv, said, capsys):
    """A NaN momentum, compared unequal to itself, failed the ranks' flag agreement with
    every rank given the same; a slice size of 3 raised in every rank after its process
    group formed."""
    from thc.app import train
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("argv, epochs", [([], 2), (["--quick"], 1),
                                           (["--quick", "--epochs", "3"], 3)])
def test_quick_takes_one_epoch_unless_epochs_are_given(argv, epochs):
    """--quick replaced --epochs 3 with 1 without a word (its --train-subset gives way)."""
    assert mainargs.epochs_of(_main_args(*argv)) == epochs


@pytest.mark.parametrize("argv", [["--max-steps", "0"], ["--epochs", "0"], ["--batch", "-1"],
                                  ["--evals", "0"], ["--train-subset", "0"], ["--epochs", "x"],
                                  ["--width", "-3"]])
def test_counts_below_one_are_usage_errors(argv, capsys):
    """A zero count would start a job that trains nothing (``--max-steps 0`` loops idle)."""
    import argparse

    from thc.app import train
    for add in (train.add_arguments, mainjob.add_arguments):
        if argv[0] == "--max-steps" and add is mainjob.add_arguments:
            continue
        parser = argparse.ArgumentParser()
        add(parser)
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2
        assert "at least 1" in capsys.readouterr().err or argv[1] == "x"
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    assert parser.parse_args(["--max-steps", "1", "--epochs", "2"]).max_steps == 1


def test_bmv2_steps_take_a_count_or_all():
    import argparse
    parser = argparse.ArgumentParser()
    mainjob.add_arguments(parser)
    assert parser.parse_args([]).bmv2_steps == mainargs.BMV2_STEPS
    assert parser.parse_args(["--bmv2-steps", "all"]).bmv2_steps is None
    assert parser.parse_args(["--bmv2-steps", "3"]).bmv2_steps == 3
    for bad in ("0", "some"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--bmv2-steps", bad])


BMV2_BOUND = 12
"""Steps of the BMv2 mode in the main job's BMv2 test: past the first epoch's 8 and short of
the run's 16, so the compared prefix crosses an epoch and the bound (``--bmv2-steps``, as
``make run`` gives it) stops the mode mid-epoch."""


@pytest.mark.slow
@pytest.mark.bmv2
def test_main_job_through_bmv2_has_the_software_losses_step_by_step(tmp_path):
    """The main job's BMv2 mode trains the bounded number of steps and every step's loss
    equals THC's through the software aggregators (the sums are the same integers)."""
    from thc.emu.testbed import bmv2_unavailable_reason, mininet_unavailable_reason
    why = mininet_unavailable_reason() or bmv2_unavailable_reason()
    if why:
        pytest.skip(f"needs Mininet and BMv2: {why}")
    bound = BMV2_BOUND
    out = subprocess.run(
        [sys.executable, "-m", "thc.cli", "run", "--epochs", "2", "--data", "digits",
         "--width", "8", "--train-subset", "512", "--batch", "32", "--evals", "1",
         "--workers", "2", "--bw", "100", "--modes", "thc,thc-bmv2", "--bmv2-steps",
         str(bound), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "mainjob.json").read_text())
    runs = {r["mode"]: r for r in report["runs"]}
    steps = 2 * (512 // (2 * 32))
    assert steps // 2 < bound < steps
    assert runs["thc"]["stopped"] is None and runs["thc"]["epochs_done"] == 2.0
    assert runs["thc"]["step_bound"] is None
    assert len(step_losses(runs["thc"])) == steps == runs["thc"]["history"][-1]["steps"]
    hw = runs["thc-bmv2"]
    assert hw["replicas_diverged_at"] is None and runs["thc"]["replicas_diverged_at"] is None
    assert len(step_losses(hw)) == bound == hw["history"][-1]["steps"]
    assert hw["stopped"] == f"bounded to {bound} steps (--bmv2-steps)"
    assert hw["step_bound"] == bound and 1.0 < hw["epochs_done"] < 2.0
    assert f"thc-bmv2 (bounded to {bound} steps) vs thc" in out.stdout
    assert report["summary"]["bmv2_vs_software"] == [{
        "bmv2": "thc-bmv2", "software": "thc", "steps_compared": bound,
        "identical_losses": True, "first_difference": None, "bmv2_step_bound": bound}]
    assert "identical losses" in out.stdout


def _rows_text(epoch: float) -> str:
    """A worker's output: its data set's line and one evaluation row."""
    row = {"epoch": epoch, "accuracy": 0.5, "seconds": 1.0, "steps": 3, "bytes_sent": 10,
           "bytes_received": 25}
    return '{"dataset": "digits", "params": 1000}\n' + json.dumps(row) + "\n"


def _canned_run(name, losses, diverged_at=None):
    """What ``mainjob.run_mode`` returns for a mode that trained three steps."""
    acc, secs = (0.79, 2.0) if name == "fp32" else (0.8, 1.0)
    hist = [{"epoch": 1.0, "accuracy": acc, "seconds": secs, "steps": 3, "bytes_sent": 100,
             "step_losses": losses, "replicas_agree": diverged_at is None}]
    bound = 3 if name.endswith("-bmv2") else None
    return {"mode": name, "description": "", "testbed": "loopback", "dataset": "digits",
            "dataset_note": "", "params": 1000, "history": hist, "wall_seconds": 1,
            "train_seconds": secs, "final_accuracy": acc, "epochs_done": 1.0,
            "epochs_asked": 1, "stopped": bound and "bounded to 3 steps (--bmv2-steps)",
            "step_bound": bound, "wire_bytes": 100, "wire_source": "counted",
            "agg_link_bytes": None, "comm_seconds": None, "exposed_comm_seconds": None,
            "loss_bound": 0.0, "priorities": False, "congestion": None,
            "class_queued_links": False, "short_chunks": None,
            "replicas_diverged_at": diverged_at}


@pytest.mark.parametrize("case", ["agree", "losses", "vote losses", "diverged"])
def test_a_failed_check_fails_the_main_job(monkeypatch, capsys, tmp_path, case):
    """A BMv2 mode's losses unlike its twin's through the software aggregators (THC's, and
    Marsit's vote, which no check compared), or a mode whose workers' parameters differed,
    were printed and the run exited 0 (``make run`` passed); the difference was named by
    its 0-based index as a step."""
    monkeypatch.setattr(mainjob, "bmv2_unavailable_reason", lambda: None)
    monkeypatch.setattr(mainjob, "mininet_unavailable_reason", lambda *a: None)
    monkeypatch.setattr(mainjob, "probe_bmv2", lambda: {"build": "canned"})
    broken = {"losses": "thc-bmv2", "vote losses": "marsit-vote-bmv2"}.get(case)
    monkeypatch.setattr(mainjob, "run_mode", lambda name, args, bar: _canned_run(
        name, [2.3, 2.1, 1.9] if name == broken else [2.3, 2.0, 1.7],
        3 if case == "diverged" and name == "thc" else None))
    modes = "fp32,thc,thc-bmv2,marsit-vote,marsit-vote-bmv2"
    args = _main_args("--workers", "2", "--modes", modes, "--out", str(tmp_path))
    assert mainjob.run(args) == (0 if case == "agree" else 1)
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "mainjob.json").read_text())
    compared = {v["bmv2"]: v for v in report["summary"]["bmv2_vs_software"]}
    assert {m: v["software"] for m, v in compared.items()} == {
        "thc-bmv2": "thc", "marsit-vote-bmv2": "marsit-vote"}
    if broken:
        assert [m for m, v in compared.items() if not v["identical_losses"]] == [broken]
        assert compared[broken]["first_difference"] == 2
        twin = broken.removesuffix("-bmv2")
        assert f"CHECK FAILED: {broken}'s losses differ from {twin}'s from step 2 of 3" in out
    elif case == "diverged":
        assert "CHECK FAILED: thc: the workers' parameters differed after step 3" in out
    else:
        assert "CHECK FAILED" not in out and "identical losses" in out
    # the loopback has no links: its bytes are what rank 0 sent and received, as it says
    assert " MB rank 0 " in out and "MB links" not in out


@pytest.mark.parametrize("argv, mininet_why", [
    (("--loopback",), None), ((), "not running as root (Mininet needs root)")])
def test_bmv2_modes_are_skipped_where_the_workers_run_on_the_loopback(
        monkeypatch, capsys, tmp_path, argv, mininet_why):
    """The BMv2 switch sits between Mininet hosts: on the loopback its modes failed after
    every other mode had trained, and the run exited 1, where BMv2 was installed."""
    monkeypatch.setattr(mainjob, "bmv2_unavailable_reason", lambda: None)
    monkeypatch.setattr(mainjob, "mininet_unavailable_reason", lambda *a: mininet_why)
    monkeypatch.setattr(mainjob, "probe_bmv2", lambda: pytest.fail("BMv2 probed"))
    ran = []
    monkeypatch.setattr(mainjob, "run_mode", lambda name, args, bar: ran.append(name) or
                        _canned_run(name, [2.3, 2.0, 1.7], None))
    args = _main_args(*argv, "--workers", "2", "--modes", "fp32,thc,thc-bmv2",
                      "--out", str(tmp_path))
    assert mainjob.run(args) == 0 and ran == ["fp32", "thc"]
    assert ("skipping thc-bmv2: the BMv2 switch needs the Mininet testbed "
            f"({mininet_why or '--loopback'})") in capsys.readouterr().out
    assert mainjob.run(_main_args(*argv, "--modes", "thc-bmv2", "--out", str(tmp_path))) == 2


def _main_args(*argv):
    import argparse
    parser = argparse.ArgumentParser()
    mainjob.add_arguments(parser)
    return parser.parse_args(["--data", "digits", "--modes", "fp32", *argv])


@pytest.mark.filterwarnings("error")   # a report with no mode finished plots cleanly
@pytest.mark.parametrize("states, evaluating", [
    ({0: "sleeping", 1: "stopped (SIGSTOP?)"}, True), ({0: "running", 1: "sleeping"}, False),
    ({0: "running", 1: "sleeping"}, True)])
def test_a_mode_hung_at_its_limit_failed_and_says_so(monkeypatch, tmp_path, states, evaluating):
    """A worker stopped by SIGSTOP, or workers that never got to their final evaluation (a
    stopped aggregator, a lost peer), were reported as "stopped at the limit", the mode's
    rows in the table and the exit status 0. Workers slow in their final evaluation still
    report how far they got."""
    from thc.emu.procs import WorkerError, WorkerResult
    from thc.emu.testbed import LoopbackTestbed

    def hung(self, argv_for, env=None, timeout=None, on_line=None):
        raise WorkerError(f"workers timed out after 60 s\n--- worker 1 (worker1-0) still "
                          f"{states[1]} at the timeout, killed", [WorkerResult(
                              r, -9, _rows_text(0.1)
                              + ('{"final_evaluation": 4}\n' if evaluating else ""),
                              "", 60.0) for r in (0, 1)], timed_out=True, states=states)
    monkeypatch.setattr(LoopbackTestbed, "run_workers", hung)
    args = _main_args("--loopback", "--workers", "2", "--out", str(tmp_path))
    hung = "SIGSTOP" in states[1] or not evaluating
    assert mainjob.run(args) == (1 if hung else 0)
    report = json.loads((tmp_path / "mainjob.json").read_text())
    if hung:
        assert report["runs"] == [] and "still running at the 600 s limit" in \
            report["failed"][0]["error"]
        assert ("SIGSTOP" if evaluating else "before its final evaluation") in \
            report["failed"][0]["error"]
    else:
        assert report["failed"] == [] and report["runs"][0]["stopped"] == \
            "stopped at the 600 s limit (its final evaluation did not end within 25 s)"


@pytest.mark.filterwarnings("error")   # a report with no mode finished plots cleanly
def test_a_worker_that_failed_just_before_the_limit_fails_the_mode(monkeypatch, tmp_path):
    """Worker 1 exited with an error seconds before the limit, rank 0 in its final
    evaluation: the mode was "stopped at the limit", its rows kept, the crash unreported."""
    from thc.emu.procs import WorkerError, WorkerResult
    from thc.emu.testbed import LoopbackTestbed
    rows = _rows_text(0.1) + '{"final_evaluation": 4}\n'

    def crashed(self, argv_for, env=None, timeout=None, on_line=None):
        raise WorkerError("workers timed out after 60 s\n--- worker 1 exit code 1",
                          [WorkerResult(0, -9, rows, "", 60.0),
                           WorkerResult(1, 1, "", "RuntimeError: Gloo connection reset", 57.0)],
                          timed_out=True, states={0: "sleeping"})
    monkeypatch.setattr(LoopbackTestbed, "run_workers", crashed)
    args = _main_args("--loopback", "--workers", "2", "--out", str(tmp_path))
    assert mainjob.run(args) == 1
    report = json.loads((tmp_path / "mainjob.json").read_text())
    assert report["runs"] == [] and "worker(s) [1] failed just before the 600 s limit" in \
        report["failed"][0]["error"]


@pytest.mark.filterwarnings("error")   # a report with no mode finished plots cleanly
@pytest.mark.parametrize("limit, said", [
    (30, "still running at the 30 s limit, 20 s after the workers were to stop"),
    (8, "still running at the 8 s limit, before the workers' stop time (10 s after the launch: "
        "--timeout is too short")])
def test_a_short_limit_names_the_margin_the_workers_had(monkeypatch, tmp_path, limit, said):
    """The timeout said "25 s after the workers were to stop" whatever the limit: with 8 s
    the workers were told to stop at 10 s, after it, and nothing had hung."""
    from thc.emu.procs import WorkerError, WorkerResult
    from thc.emu.testbed import LoopbackTestbed

    def late(self, argv_for, env=None, timeout=None, on_line=None):
        raise WorkerError("workers timed out", [WorkerResult(r, -9, "", "", 8.0)
                                                for r in (0, 1)], timed_out=True,
                          states={0: "running", 1: "running"})
    monkeypatch.setattr(LoopbackTestbed, "run_workers", late)
    args = _main_args("--loopback", "--workers", "2", "--timeout", str(limit),
                      "--out", str(tmp_path))
    assert mainjob.run(args) == 1
    report = json.loads((tmp_path / "mainjob.json").read_text())
    assert said in report["failed"][0]["error"], report["failed"][0]["error"]


def test_a_line_of_rank_0_that_only_looks_like_json_is_not_a_row():
    """A library's print starting with "{" failed the mode with a bare parser error."""
    out = ('{garbage from a library\n{"dataset": "digits", "params": 10}\n[1, 2]\n{"x": [}\n'
           '{"epoch": 1.0, "accuracy": 0.5, "seconds": 1.0, "steps": 3}\n"{"\n')
    info, rows = mainjob._rows(out)
    assert info == {"dataset": "digits", "params": 10} and [r["steps"] for r in rows] == [3]
    seen = []

    class Bar:
        total = n = None

        def refresh(self):
            seen.append((self.n, self.total))

        def set_postfix(self, **kw):
            seen.append(kw)
    on_line = mainjob._show_progress(Bar())
    for line in ("{not json", '{"progress": 2, "of": 9}', '{"progress": 5, "of": 9}'):
        on_line(0, line)
    on_line(1, '{"progress": 7, "of": 9}')   # rank 0's alone
    assert seen == [(2, 9), (5, 9)]


@pytest.mark.parametrize("argv, said", [
    (["--modes", "fp32", "--loss-bound", "0.3"], "--loss-bound applies to thc-lossy, thc-dlcp"),
    (["--modes", "fp32,thc", "--bmv2-steps", "all"], "--bmv2-steps and --bmv2-timeout apply"),
    (["--modes", "fp32", "--bmv2-timeout", "60"], "--bmv2-steps and --bmv2-timeout apply"),
    (["--modes", "fp32,thc,fp32"], "--modes names fp32 more than once"),
    (["--modes", "fp32,thc-dist", "--software-lanes", "512"],
     "--software-lanes applies to thc, thc-central")])
def test_thc_run_refuses_flags_no_mode_reads_and_a_mode_twice(monkeypatch, capsys, tmp_path,
                                                              argv, said):
    """Each ran without a word: the bound or the BMv2 limits ignored, a mode trained twice."""
    monkeypatch.setattr(mainjob, "run_mode", lambda *a: pytest.fail("a mode ran"))
    assert mainjob.run(_main_args("--loopback", "--out", str(tmp_path), *argv)) == 2
    assert said in capsys.readouterr().err


def test_an_out_dir_that_takes_no_file_is_refused_before_any_mode(monkeypatch, capsys,
                                                                 tmp_path):
    """A full or read-only --out was found only when the report was written, after every
    mode had trained (a raw traceback and an empty mainjob.json)."""
    import errno

    def full(self, data):
        self.touch()   # made, then not filled
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Path, "write_bytes", full)
    monkeypatch.setattr(mainjob, "run_mode", lambda *a: pytest.fail("a mode ran"))
    assert mainjob.run(_main_args("--loopback", "--out", str(tmp_path))) == 2
    assert f"cannot write to --out {tmp_path}: No space left on device" in \
        capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_report_the_out_dir_cannot_take_is_kept_elsewhere(monkeypatch, capsys, tmp_path):
    """The disk filled while the modes trained: the report goes to a temporary directory,
    named, instead of a traceback that loses it."""
    import errno
    from thc.emu.procs import WorkerResult
    from thc.emu.testbed import LoopbackTestbed

    def ran(self, argv_for, env=None, timeout=None, on_line=None):
        return [WorkerResult(r, 0, _rows_text(1.0) + '{"final_evaluation": 4}\n', "", 1.0)
                for r in (0, 1)]

    write = mainreport._write_whole
    full = {tmp_path}

    def filling(path, text):
        if full & {path, *path.parents}:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, text)
    monkeypatch.setattr(LoopbackTestbed, "run_workers", ran)
    monkeypatch.setattr(mainreport, "_write_whole", filling)
    args = ("--loopback", "--workers", "2", "--modes", "fp32", "--out", str(tmp_path))
    assert mainjob.run(_main_args(*args)) == 2
    err = capsys.readouterr().err
    assert f"cannot write to --out {tmp_path} (No space left on device)" in err
    kept = Path(err.split("is kept in ")[1].split()[0])
    run = json.loads(kept.read_text())["runs"][0]
    assert run["mode"] == "fp32"
    # the loopback counts what the workers sent and received (10 and 25 in each's last row)
    assert run["wire_bytes"] == 2 * 35 and "sent and received" in run["wire_source"]
    shutil.rmtree(kept.parent)
    assert not (tmp_path / "mainjob.json").exists()
    full.add(Path(tempfile.gettempdir()))   # one disk: the temporary directory is full too
    before = set(Path(tempfile.gettempdir()).glob("thc-run-*"))
    assert mainjob.run(_main_args(*args)) == 2
    assert set(Path(tempfile.gettempdir()).glob("thc-run-*")) == before   # no empty folder
    out, err = capsys.readouterr()
    assert "the report of the runs is on standard output" in err
    assert json.loads(out[out.index("{\n"):])["runs"][0]["mode"] == "fp32"


def test_a_sigterm_while_the_report_is_written_waits_for_it_and_says_so(monkeypatch, capsys,
                                                                        tmp_path):
    """SIGTERM as the results table printed killed the run with no line and no report (or
    its JSON without its plot): the report is written whole, then the run ends saying so."""
    import signal
    from thc.emu.procs import WorkerResult
    from thc.emu.testbed import LoopbackTestbed

    def ran(self, argv_for, env=None, timeout=None, on_line=None):
        return [WorkerResult(r, 0, _rows_text(1.0) + '{"final_evaluation": 4}\n', "", 1.0)
                for r in (0, 1)]
    conclude = mainjob.conclude

    def signalled(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        return conclude(*a, **kw)
    monkeypatch.setattr(LoopbackTestbed, "run_workers", ran)
    monkeypatch.setattr(mainjob, "conclude", signalled)
    assert mainjob.run(_main_args("--loopback", "--workers", "2", "--out", str(tmp_path))) == 143
    assert ("terminated (SIGTERM) while its report was written, the report of the modes done "
            "written") in capsys.readouterr().err
    assert (tmp_path / "mainjob.json").exists() and (tmp_path / "mainjob.png").exists()


def test_a_sigterm_between_modes_keeps_the_modes_done(monkeypatch, capsys, tmp_path):
    """SIGTERM as a finished mode's line printed escaped the run: exit 143, no line and no
    report of the mode done."""
    import signal
    from thc.emu.procs import WorkerResult
    from thc.emu.testbed import LoopbackTestbed

    def ran(self, argv_for, env=None, timeout=None, on_line=None):
        return [WorkerResult(r, 0, _rows_text(1.0) + '{"final_evaluation": 4}\n', "", 1.0)
                for r in (0, 1)]
    print_mode = mainjob.print_mode

    def signalled(*a, **kw):
        print_mode(*a, **kw)
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(LoopbackTestbed, "run_workers", ran)
    monkeypatch.setattr(mainjob, "print_mode", signalled)
    argv = ("--loopback", "--workers", "2", "--modes", "fp32,thc", "--out", str(tmp_path))
    assert mainjob.run(_main_args(*argv)) == 143
    assert ("terminated (SIGTERM) between modes, the report of the modes done written"
            in capsys.readouterr().err)
    assert [r["mode"] for r in json.loads((tmp_path / "mainjob.json").read_text())["runs"]] \
        == ["fp32"]


def test_each_mode_says_which_datapath_its_aggregators_served_on(monkeypatch, capsys,
                                                                   tmp_path):
    """The aggregators fall back to the Python datapath (several times slower a packet, in
    train s) where the compiled one is not built or cannot serve the job: neither the table
    nor mainjob.json said so."""
    from thc.emu.procs import WorkerResult
    from thc.emu.testbed import LoopbackTestbed

    def ran(self, argv_for, env=None, timeout=None, on_line=None):
        return [WorkerResult(r, 0, _rows_text(1.0) + '{"final_evaluation": 4}\n', "", 1.0)
                for r in (0, 1)]
    monkeypatch.setattr(LoopbackTestbed, "run_workers", ran)
    monkeypatch.setenv("THC_AGGREGATOR_DATAPATH", "python")
    argv = ("--loopback", "--workers", "2", "--modes", "fp32,thc", "--out", str(tmp_path))
    mainjob.run(_main_args(*argv))
    assert "software aggregators' datapath: thc python (as asked)" in capsys.readouterr().out
    runs = json.loads((tmp_path / "mainjob.json").read_text())["runs"]
    assert [r["aggregator_datapath"] for r in runs] == [None, "python (as asked)"]


def test_ctrl_c_ends_the_main_job_with_a_line_not_a_traceback(monkeypatch, capsys, tmp_path):
    def interrupted(name, args, progress):
        raise KeyboardInterrupt
    monkeypatch.setattr(mainjob, "run_mode", interrupted)
    assert mainjob.run(_main_args("--loopback", "--out", str(tmp_path))) == 130
    assert "interrupted during fp32" in capsys.readouterr().err


def test_sigterm_ends_the_main_job_with_a_line(monkeypatch, capsys, tmp_path):
    from thc.lifetime import Terminated

    def terminated(name, args, progress):
        raise Terminated(143)
    monkeypatch.setattr(mainjob, "run_mode", terminated)
    assert mainjob.run(_main_args("--loopback", "--out", str(tmp_path))) == 143
    assert "terminated (SIGTERM) during fp32" in capsys.readouterr().err


def test_a_stopped_main_job_reports_the_modes_it_finished(monkeypatch, capsys, tmp_path):
    """A SIGTERM during the third mode of a long run wrote no report: the first two modes'
    training was lost."""
    from thc.lifetime import Terminated

    def second_stops(name, args, bar):
        if name == "topk":
            raise Terminated(143)
        return _canned_run(name, [2.3, 2.0, 1.7])
    monkeypatch.setattr(mainjob, "run_mode", second_stops)
    args = _main_args("--loopback", "--modes", "fp32,thc,topk", "--out", str(tmp_path))
    assert mainjob.run(args) == 143
    assert "terminated (SIGTERM) during topk; its testbed torn down, the report of the modes " \
           "done written" in capsys.readouterr().err
    report = json.loads((tmp_path / "mainjob.json").read_text())
    assert [r["mode"] for r in report["runs"]] == ["fp32", "thc"]
    assert report["stopped"] == "during topk; its testbed torn down"
    assert (tmp_path / "mainjob.png").exists()


@pytest.mark.parametrize("how, code, said", [
    ("ctrl-c", 130, "interrupted while measuring BMv2's forwarding rate"),
    ("sigterm", 143, "terminated (SIGTERM) while measuring BMv2's forwarding rate")])
def test_a_signal_while_bmv2_is_measured_ends_the_run_with_a_line(monkeypatch, capsys,
                                                                  tmp_path, how, code, said):
    """The probe's switch ran before any testbed had turned SIGTERM into an exception: a
    SIGTERM then left the switch and its veths behind for good, and Ctrl-C a traceback."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")

    def probe():
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)
        pytest.fail("SIGTERM did not reach the probe as an exception")
    monkeypatch.setattr(mainjob, "bmv2_unavailable_reason", lambda: None)
    monkeypatch.setattr(mainjob, "mininet_unavailable_reason", lambda *a: None)
    monkeypatch.setattr(mainjob, "probe_bmv2", probe)
    monkeypatch.setattr(mainjob, "run_mode", lambda *a: pytest.fail("a mode ran"))
    before = signal.signal(signal.SIGTERM, lambda *a: None)   # not this test process's end
    try:
        got = mainjob.run(_main_args("--modes", "fp32,thc-bmv2", "--out", str(tmp_path)))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C came out of thc run as a traceback")
    finally:
        signal.signal(signal.SIGTERM, before)
    assert got == code and said in capsys.readouterr().err


def _replicas_worker(rank, port, q):
    import torch
    import torch.distributed as dist

    from thc.app.train import replicas_agree
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3).to(torch.bfloat16)
    alike = replicas_agree(model)
    if rank == 1:
        with torch.no_grad():
            model.bias[2] += 1
    q.put((rank, (alike, replicas_agree(model))))
    dist.destroy_process_group()


def test_replicas_agree_until_one_ranks_parameter_differs():
    """Every rank learns whether all hold the same parameters (bfloat16 ones too)."""
    assert gloo_pair(_replicas_worker) == {0: (True, False), 1: (True, False)}


def test_a_worker_that_quit_early_without_an_error_is_named(tmp_path):
    """A worker that exited 0 mid-run left its peers to fail (Gloo: connection reset), and
    only the peers' errors were shown."""
    import subprocess

    from thc.emu.procs import Proc, wait_all

    def launch(argv, stdout, stderr):
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    # each peer waits for the other's mark, so the order holds however loaded the machine
    mark = tmp_path / "w0.done"
    wait_mark = (f"import pathlib, sys, time\nwhile not pathlib.Path({str(mark)!r}).exists():\n"
                 "    time.sleep(0.01)\n")
    quit_ = Proc.start("w0", [sys.executable, "-c", f"open({str(mark)!r}, 'w')"], tmp_path,
                       launch)
    failed = Proc.start("w1", [sys.executable, "-c",
                               wait_mark + "time.sleep(2.5)\nsys.exit('peer gone')"],
                        tmp_path, launch)
    with pytest.raises(mainjob.WorkerError) as e:
        wait_all([quit_, failed], timeout=30)
    said = str(e.value)
    assert "1 of 2 workers failed" in said and "worker 0 (w0) exited 0 after" in said, said
    # one that ended with the run, as a peer failed on its way out, is not named
    mark.unlink()
    done = Proc.start("w0", [sys.executable, "-c", f"open({str(mark)!r}, 'w')"], tmp_path,
                      launch)
    late = Proc.start("w1", [sys.executable, "-c", wait_mark + "sys.exit('failed in teardown')"],
                      tmp_path, launch)
    with pytest.raises(mainjob.WorkerError) as e:
        wait_all([done, late], timeout=30)
    assert "exited 0" not in str(e.value), str(e.value)


def test_a_failed_workers_reason_on_stdout_is_shown_and_killed_ones_are_counted_apart(
        tmp_path):
    """The smoke worker reports why it failed (a timeout naming the missing worker, wrong
    sums) as a JSON line on stdout, its stderr empty: the failure showed empty tails, and
    counted the peer the wait killed as failed."""
    import subprocess

    from thc.emu.procs import Proc, wait_all

    def launch(argv, stdout, stderr):
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    failed = Proc.start("w0", [sys.executable, "-c", "import sys\nprint('progress')\n"
                               "print('{\"error\": \"3 sums differ\"}')\nsys.exit(1)"],
                        tmp_path, launch)
    waits = Proc.start("w1", [sys.executable, "-c", "import time\ntime.sleep(60)"], tmp_path,
                       launch)
    with pytest.raises(mainjob.WorkerError) as e:
        wait_all([failed, waits], timeout=30)
    said = str(e.value)
    assert said.startswith("1 of 2 workers failed, 1 more killed 3 s later"), said
    assert 'last stdout line: {"error": "3 sums differ"}' in said, said


def test_the_failure_names_the_worker_that_failed_first_and_its_signal(tmp_path):
    """A worker killed (SIGKILL) made its peers fail on their closed connections: the
    message led with "3 of 3 workers failed", each peer's error naming another, and the
    cause was an "exit code -9" among them."""
    import subprocess

    from thc.emu.procs import Proc, wait_all

    def launch(argv, stdout, stderr):
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    # its peers fail as it dies, within a poll of it, read in rank order: it is named
    mark = tmp_path / "killed"
    peer = (f"import os, sys, time\nwhile not os.path.exists({str(mark)!r}): time.sleep(0.001)"
            f"\nsys.exit('Connection closed by peer')")
    procs = [Proc.start(f"w{r}", [sys.executable, "-c", peer], tmp_path, launch)
             for r in range(2)]
    procs.append(Proc.start("w2", [sys.executable, "-c", f"import os, time\ntime.sleep(0.5)\n"
                                   f"open({str(mark)!r}, 'w').close()\n"
                                   f"os.kill(os.getpid(), 9)"], tmp_path, launch))
    with pytest.raises(mainjob.WorkerError) as e:
        wait_all(procs, timeout=30)
    said = str(e.value)
    assert said.startswith("3 of 3 workers failed; the first, worker 2, killed by SIGKILL "
                           "after"), said
    assert "worker 2 (w2) killed by SIGKILL after" in said, said


def test_a_timeout_reads_every_state_before_it_kills_any(tmp_path):
    """A worker waiting on a peer exits on its own once that peer is being killed (Gloo:
    connection closed): read and killed one by one, the later ones read as workers that
    failed before the timeout, which `thc run` takes for a crash. Here worker 0 marks the
    SIGTERM it is sent, and worker 1 exits with an error when it sees the mark."""
    import subprocess

    from thc.emu.procs import Proc, wait_all
    from thc.lifetime import with_parent

    def launch(argv, stdout, stderr):
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=with_parent())
    mark = tmp_path / "terminated"
    first = Proc.start("w0", [sys.executable, "-c",
                              "import pathlib, signal, time\n"
                              f"signal.signal(signal.SIGTERM, lambda *a: "
                              f"pathlib.Path({str(mark)!r}).touch())\n"
                              "time.sleep(60)\n"], tmp_path, launch)
    second = Proc.start("w1", [sys.executable, "-c",
                               "import os, sys, time\n"
                               f"while not os.path.exists({str(mark)!r}):\n"
                               "    time.sleep(0.005)\n"
                               "sys.exit(1)\n"], tmp_path, launch)
    with pytest.raises(mainjob.WorkerError) as e:
        wait_all([first, second], timeout=1.0)
    assert mark.exists() and e.value.results[1].returncode == 1
    assert e.value.timed_out and set(e.value.states) == {0, 1}, e.value.states


def test_a_worker_without_stop_at_waits_minutes_for_a_peer_not_half_an_hour():
    """torchrun's restart whose rendezvous never completed hung silently for torch's 30
    minutes (init_group took no timeout without --stop-at)."""
    from thc.app import train
    assert train._group_timeout(None) == train.GROUP_TIMEOUT_S <= 600
    assert 30 <= train._group_timeout(time.time() + 100) <= 116


@pytest.mark.parametrize("netem, nft, modes, refused", [
    (False, False, "fp32,marsit-vote-bmv2", "marsit-vote-bmv2 with --bw/--delay/--loss: loss "
                                            "through BMv2 without netem needs nftables"),
    (False, True, "fp32,marsit-vote-bmv2", None),
    (False, True, "fp32,thc-dlcp,thc-lossy", None),
    (True, True, "fp32,thc-dlcp", "thc-dlcp with --bw/--delay/--loss: priority queueing "
                                  "needs a bandwidth limit and no netem delay/loss"),
    (True, False, "fp32,marsit-vote-bmv2", None)])
def test_links_a_mode_cannot_take_are_refused_before_any_mode_trains(monkeypatch, netem, nft,
                                                                     modes, refused):
    """Loss through BMv2 on a kernel without netem was refused by that mode's testbed,
    after the modes before it had trained; the DLCP modes were refused any --loss, though
    the fallback's drops at the hosts' ingress leave their class queues alone."""
    from thc.emu import links, mainargs
    monkeypatch.setattr(links, "netem_available", lambda: (netem, "no sch_netem"))
    monkeypatch.setattr(links, "iptables_statistic_available", lambda: (True, "canned"))
    monkeypatch.setattr(links.shutil, "which", lambda name: name if nft or name != "nft" else None)
    args = _main_args("--loss", "2", "--modes", modes)
    assert mainargs.refusal(args, modes.split(","), None) is None
    why = mainargs.links_refusal(args, modes.split(","), None)
    assert why is None if refused is None else why.startswith(refused), why


def test_a_bmv2_mode_skipped_for_want_of_bmv2_refuses_no_links(monkeypatch, capsys, tmp_path):
    """The links' refusal came before the modes without BMv2 were skipped: thc-bmv2, a
    default mode, refused a whole run whose other modes could train."""
    from thc.emu import links
    monkeypatch.setattr(links, "netem_available", lambda: (False, "no sch_netem"))
    monkeypatch.setattr(links, "iptables_statistic_available", lambda: (True, "canned"))
    monkeypatch.setattr(links.shutil, "which", lambda name: None if name == "nft" else name)
    monkeypatch.setattr(mainjob, "bmv2_unavailable_reason", lambda: "BMv2 not built (canned)")
    monkeypatch.setattr(mainjob, "mininet_unavailable_reason", lambda *a: None)
    ran = []
    monkeypatch.setattr(mainjob, "run_mode", lambda name, args, bar: ran.append(name) or
                        _canned_run(name, [2.3, 2.0, 1.7]))
    args = _main_args("--workers", "2", "--loss", "1", "--modes", "fp32,thc,thc-bmv2",
                      "--out", str(tmp_path))
    assert mainjob.run(args) == 0
    assert ran == ["fp32", "thc"]
    assert "skipping thc-bmv2: BMv2 not built (canned)" in capsys.readouterr().out
    # with BMv2 there, the mode stays and its links are refused before any mode trains
    monkeypatch.setattr(mainjob, "bmv2_unavailable_reason", lambda: None)
    ran.clear()
    assert mainjob.run(args) == 2 and ran == []
    assert capsys.readouterr().err.startswith(
        "thc run: thc-bmv2 with --bw/--delay/--loss: loss through BMv2 without netem needs "
        "nftables")


@pytest.mark.parametrize("delay, rto, bmv2_rto", [(0.0, None, None), (5.0, "0.02", "0.02"),
                                                  (30.0, "0.06", "0.03"),
                                                  (400.0, "0.5", "0.4")])
def test_workers_over_delayed_links_start_with_a_timeout_of_half_the_round_trip(delay, rto,
                                                                              bmv2_rto):
    """Over links of 15 ms or more (a 60 ms round trip), the workers' 20 ms timeout sent
    every THC chunk three times and the round trip was never learnt (tests/
    test_client_timers.py). The workers of the aggregated modes are given half the round
    trip instead, within the client's bounds: four link delays to an aggregator on a host,
    two where the switch answers. The flag parses as the worker's own."""
    from types import SimpleNamespace

    from thc.app import train
    args = _main_args("--workers", "2", "--epochs", "1", "--delay", str(delay))
    tb = SimpleNamespace(master_addr=("10.0.0.1", 29500), agg_addr=("10.0.0.100", 50100))
    for name, want in (("thc", rto), ("thc-bmv2", bmv2_rto), ("fp32", None)):
        argv = mainjob._argv(args, mainargs.MODES[name], tb, "c.json", None, 0.0, 0)
        given = argv[argv.index("--rto") + 1] if "--rto" in argv else None
        assert given == want, (name, argv)
        parser = argparse.ArgumentParser()
        train.add_arguments(parser)
        assert parser.parse_args(argv[3:]).rto == float(given or 0.02)
