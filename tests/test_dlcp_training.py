"""DLCP in training: the DDP hook's layer positions, the main job's DLCP modes, the loss-bound
flag. (The end-to-end run is ``thc run --modes thc-central,thc-lossy,thc-dlcp``.)"""
from __future__ import annotations

import argparse
import itertools

import pytest
import torch

from thc.collective.ddp import layer_positions


def _model():
    torch.manual_seed(0)
    # distinct sizes: every parameter is recognisable by its element count
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 7),
                               torch.nn.ReLU(), torch.nn.Linear(7, 3, bias=False))


def test_layer_positions_follow_the_forward_order():
    model = _model()
    pos = layer_positions(model)
    assert [pos[id(p)] for p in model.parameters()] == [0.0, 0.0, 0.5, 0.5, 1.0]
    nested = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3)),
                                 torch.nn.Flatten(), torch.nn.Linear(2, 2))
    pos = layer_positions(nested)
    assert [pos[id(p)] for p in nested.parameters()] == [0.0, 0.0, 1.0, 1.0]


def test_a_tied_weight_takes_its_first_layers_place():
    """An embedding tied to the output head took the head's place (1.0), the lowest DLCP
    class, where the next forward needs it first."""
    tied = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4),
                               torch.nn.Linear(4, 10, bias=False))
    tied[2].weight = tied[0].weight
    pos = layer_positions(tied)
    assert pos[id(tied[0].weight)] == 0.0 and pos[id(tied[1].weight)] == 0.5


def _runs(position: torch.Tensor) -> list[tuple[float, int]]:
    return [(float(v), len(list(g))) for v, g in itertools.groupby(position.tolist())]


@pytest.mark.parametrize("priorities", [True, False])
def test_thc_hook_hands_every_bucket_its_layer_positions(priorities):
    """Through a real software aggregator (one worker): each bucket's position vector is, run
    by run, the parameters of the bucket with their layer's place; without priorities none."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.transports import AggregatorTransport
    from thc.collective.ddp import THCHook
    from thc.net.aggregator import Aggregator
    from thc.net.client import AggregationClient
    from thc.testing.clusters import free_port_block, free_tcp_port, local_job

    calls = []

    class Recording(THCAllReduce):
        def __call__(self, tensor, position=None):
            calls.append((tensor.numel(), position))
            return super().__call__(tensor, position)

    model = _model()
    sizes = {p.numel(): pos for p, pos in zip(model.parameters(), [0.0, 0.0, 0.5, 0.5, 1.0])}
    job = local_job(1, 1, free_port_block(1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}", rank=0,
                            world_size=1)
    try:
        with Aggregator([job]) as agg:
            addr = agg.start()
            client = AggregationClient(job, 0, addr, deadline=10.0, run=7)
            params = THCParams(slice_size=16)
            ddp = DDP(model)
            hook = THCHook(model, lambda group: Recording(AggregatorTransport(client), params),
                           overlap=False, priorities=priorities).register(ddp)
            ddp(torch.randn(4, 6)).sum().backward()
            client.close()
    finally:
        dist.destroy_process_group()
    assert hook.bytes_sent > 0 and calls
    if not priorities:
        assert all(pos is None for _, pos in calls)
        return
    seen = []
    for numel, pos in calls:
        assert pos is not None and pos.numel() == numel
        for value, length in _runs(pos):
            # a run may join a layer's weight and bias: split it by the sizes of that layer
            parts = [n for n, v in sizes.items() if v == value]
            assert length in parts or length == sum(parts), (value, length, sizes)
            seen.append(value)
    assert sorted(set(seen)) == [0.0, 0.5, 1.0]
    assert sum(n for n, _ in calls) == sum(p.numel() for p in model.parameters())


def test_main_job_has_the_dlcp_modes():
    from thc.emu.mainargs import DEFAULT_MODES, MODES

    dlcp, lossy = MODES["thc-dlcp"], MODES["thc-lossy"]
    assert (dlcp.train_mode, dlcp.aggregator, dlcp.loss_bound, dlcp.priorities) == (
        "thc", "software", True, True)
    assert (lossy.train_mode, lossy.aggregator, lossy.loss_bound, lossy.priorities) == (
        "thc", "software", True, False)
    for name in ("thc", "thc-central"):      # the retransmit-everything baseline
        assert MODES[name].train_mode == "thc" and not MODES[name].loss_bound
        assert not MODES[name].priorities
    assert MODES["thc-central"].aggregator == dlcp.aggregator
    assert {"thc-dlcp", "thc-lossy"}.isdisjoint(DEFAULT_MODES.split(","))


def _parser(module):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser


@pytest.mark.parametrize("bad", ["1", "1.5", "-0.01", "nan", "inf", "x"])
def test_loss_bound_outside_0_1_is_a_usage_error(bad, capsys):
    from thc.app import train
    from thc.emu import mainjob

    for module in (train, mainjob):
        with pytest.raises(SystemExit) as e:
            _parser(module).parse_args(["--loss-bound", bad])
        assert e.value.code == 2
        assert "--loss-bound" in capsys.readouterr().err


def test_loss_bound_flags_accept_a_fraction():
    from thc.app import train
    from thc.emu import mainjob

    assert _parser(train).parse_args(["--loss-bound", "0.1"]).loss_bound == 0.1
    assert _parser(train).parse_args([]).loss_bound is None      # the job's
    assert _parser(mainjob).parse_args([]).loss_bound == 0.05
    assert _parser(mainjob).parse_args(["--loss-bound", "0"]).loss_bound == 0.0
    with pytest.raises(SystemExit):
        _parser(mainjob).parse_args(["--congest", "-1"])


def test_train_refuses_dlcp_flags_outside_mode_thc(capsys):
    from thc.app import train

    with pytest.raises(SystemExit):
        train.main(["--mode", "thc-dist", "--priorities"])
    assert "--mode thc" in capsys.readouterr().err


def test_congest_without_mininet_is_refused(tmp_path, capsys):
    from thc.emu import mainjob

    args = _parser(mainjob).parse_args(["--loopback", "--congest", "0.8", "--modes", "thc-dlcp",
                                        "--out", str(tmp_path)])
    assert mainjob.run(args) == 2
    assert "--congest needs the Mininet testbed" in capsys.readouterr().err
    assert not (tmp_path / "mainjob.json").exists()


def test_dlcp_ratios_compare_with_the_retransmit_baseline_of_the_run():
    from thc.emu.mainreport import dlcp_ratios

    def run(mode, rows, bound=0.0):
        return {"mode": mode, "loss_bound": bound, "short_chunks": 3 if bound else None,
                "history": [{"steps": n, "seconds": t, "accuracy": a} for n, t, a in rows]}

    base = run("thc-central", [(8, 80.0, 0.40)])
    dlcp = run("thc-dlcp", [(8, 8.0, 0.41), (16, 16.0, 0.60)], bound=0.05)
    rows = dlcp_ratios([run("fp32", [(16, 4.0, 0.7)]), base, dlcp])
    assert len(rows) == 1 and rows[0]["mode"] == "thc-dlcp"
    assert rows[0]["speedup"] == 10.0 and rows[0]["baseline"] == "thc-central"
    assert (rows[0]["at_step"], rows[0]["accuracy"], rows[0]["baseline_accuracy"]) == (
        8, 0.41, 0.40)
    # no baseline in the run: its short chunks and step time still, no ratio
    assert dlcp_ratios([dlcp]) == [{"mode": "thc-dlcp", "baseline": None, "step_seconds": 1.0,
                                    "short_chunks": 3}]


def test_the_table_says_a_dlcp_modes_short_chunks_without_a_baseline(capsys):
    """Without thc or thc-central in the run, the chunks a DLCP mode closed short were in
    its report alone: the table printed nothing of them."""
    from thc.emu.mainreport import dlcp_ratios, print_table, summarize
    run = {"mode": "thc-dlcp", "testbed": "mininet", "final_accuracy": 0.5,
           "train_seconds": 8.0, "wire_bytes": 1e6, "wire_source": "worker links",
           "epochs_done": 1.0, "stopped": None, "loss_bound": 0.05, "short_chunks": 15,
           "history": [{"steps": 8, "seconds": 8.0, "accuracy": 0.5}]}
    summary = summarize([run], 0.8)
    summary["dlcp"] = dlcp_ratios([run])
    print_table([run], summary)
    assert ("thc-dlcp: loss bound 0.05, 15 chunks closed short (rank 0); 1.00 s a step, no "
            "thc or thc-central run to compare it with") in capsys.readouterr().out


def test_a_dlcp_step_time_of_zero_prints_no_ratio(capsys):
    """A DLCP mode whose evaluations took no measured time has no speedup: the table's
    format of it raised a TypeError."""
    from thc.emu.mainreport import dlcp_ratios, print_table, summarize

    def run(mode, seconds, bound):
        return {"mode": mode, "testbed": "mininet", "final_accuracy": 0.5,
                "train_seconds": seconds, "wire_bytes": 1e6, "wire_source": "worker links",
                "epochs_done": 1.0, "stopped": None, "loss_bound": bound, "short_chunks": 2,
                "history": [{"steps": 8, "seconds": seconds, "accuracy": 0.5}]}
    runs = [run("thc-central", 8.0, 0.0), run("thc-dlcp", 0.0, 0.05)]
    summary = summarize(runs, 0.8)
    summary["dlcp"] = dlcp_ratios(runs)
    print_table(runs, summary)
    assert "0.00 s a step, thc-central's 1.00 s (same run)" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.mininet
def test_thc_central_and_dlcp_train_under_congestion_on_the_compiled_window(tmp_path):
    """``thc run --congest``'s baseline mode: competing flows fill the aggregator link's
    class queues, whose tail drop refused every UDP GSO burst whole (a veth carries one as
    one packet), retransmissions included, until the round timed out. The testbed sends
    datagram by datagram on class-queued links, and the compiled window trains through;
    DLCP's mode too, its loss bound and marks on the same window."""
    import json
    import subprocess
    import sys

    from thc.emu.testbed import mininet_unavailable_reason
    if why := mininet_unavailable_reason("software"):
        pytest.skip(f"--congest needs Mininet: {why}")
    out = subprocess.run(
        [sys.executable, "-m", "thc.cli", "run", "--workers", "2", "--bw", "20", "--congest",
         "0.8", "--width", "32", "--data", "digits", "--train-subset", "512", "--batch", "32",
         "--epochs", "1", "--evals", "1", "--timeout", "120", "--modes", "thc-central,thc-dlcp",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    from thc.net.fastclient import CLIENT_UNAVAILABLE
    central, dlcp = json.loads((tmp_path / "mainjob.json").read_text())["runs"]
    assert (central["mode"], central["loss_bound"], dlcp["mode"]) == (
        "thc-central", 0.0, "thc-dlcp") and dlcp["loss_bound"] > 0 and dlcp["priorities"]
    for run in (central, dlcp):
        assert run["congestion"]["fraction"] == 0.8 and run["class_queued_links"], run
        assert run["stopped"] is None and run["epochs_done"] == 1.0, run
        transport = run["history"][-1]["transport"]
        if CLIENT_UNAVAILABLE is None:
            assert transport["compiled_rounds"] == transport["rounds"] > 0, transport
        assert "no GSO" in run["aggregator_datapath"], run["aggregator_datapath"]
