"""`thc bench allreduce`'s arithmetic: ideal bytes of the ring modes, and speedups taken
against FP32 on the same elements (BMv2's smaller run is never scaled to the full size)."""
import argparse

import pytest

from thc.wire import protocol as P
from thc.emu.bench_allreduce import _rings
from thc.emu.wirebytes import annotate, ideal_bytes


def _mode(numel, seconds, **kw):
    return {"numel": numel, "seconds": seconds, **kw}


def test_ring_modes_ideal_bytes():
    lanes, n = P.max_software_lanes(8), 25_000_000
    fp32 = ideal_bytes("fp32", _mode(n, 1), 4, lanes, 1.0)["busiest"]
    fp16 = ideal_bytes("fp16", _mode(n, 1), 4, lanes, 1.0)["busiest"]
    dist = ideal_bytes("thc-dist", _mode(n, 1), 4, lanes, 1.0)["busiest"]
    assert fp16 == pytest.approx(fp32 / 2)
    # one byte per (padded) coordinate for 4 workers x g=30 <= 255, plus the norms' ring
    assert 3.5 < fp32 / dist < 4.0
    wide = ideal_bytes("thc-dist", _mode(n, 1), 16, lanes, 1.0)["busiest"]  # 16 x 30 > 255
    assert wide > 1.9 * dist


def test_speedups_use_the_baseline_on_the_same_elements():
    point = {"bw_mbit": 100.0, "modes": {
        "fp32": _mode(25_000_000, 14.0),
        "fp16": _mode(25_000_000, 7.0),
        "fp32-bmv2-size": _mode(1 << 18, 0.2),
        "thc-bmv2": _mode(1 << 18, 0.8, baseline="fp32-bmv2-size"),
    }}
    annotate(point, 4, P.max_software_lanes(8))
    assert point["modes"]["fp16"]["speedup_vs_fp32"] == pytest.approx(2.0)
    assert point["modes"]["thc-bmv2"]["speedup_vs_fp32"] == pytest.approx(0.25)
    assert point["modes"]["thc-bmv2"]["seconds"] == 0.8  # measured, not scaled
    assert "speedup_vs_fp32" not in point["modes"]["fp32-bmv2-size"]


def test_ring_names_are_checked():
    assert _rings("fp16, thc-dist") == ["fp16", "thc-dist"]
    assert _rings("") == []
    with pytest.raises(argparse.ArgumentTypeError, match="ring modes"):
        _rings("fp8")


def test_a_run_that_failed_part_way_says_so_in_its_json(monkeypatch, tmp_path):
    """Its --json looked like a whole run with fewer points."""
    import argparse
    import json

    from thc.emu import bench_allreduce
    from thc.emu.testbed import TestbedError

    def broken(*a, **k):
        raise TestbedError("no room for another testbed")
    monkeypatch.setattr(bench_allreduce, "open_testbed", broken)
    parser = argparse.ArgumentParser()
    bench_allreduce.add_arguments(parser)
    out = tmp_path / "allreduce.json"
    args = parser.parse_args(["--quick", "--aggregator", "central", "--json", str(out)])
    assert bench_allreduce.run(args) == 1
    result = json.loads(out.read_text())
    assert result["complete"] is False and result["error"] == "no room for another testbed"
    assert result["points"] == []


def test_a_finished_run_of_differing_or_wrong_results_is_no_measurement():
    """Workers that ended with different results were only noted in the table, and an
    estimate no better than zeros (an aggregator summing wrong) timed as any other: the run
    exited 0 with a whole JSON."""
    from thc.emu.bench_allreduce import failed_checks

    def run(**thc):
        mode = {"identical_results": True, "nmse": 0.004, "nmse_of_zeros": 0.25, **thc}
        return {"points": [{"bw_mbit": 100.0, "modes": {
            "fp32": {"identical_results": True, "nmse": 0.0, "nmse_of_zeros": 0.25},
            "thc": mode}}]}
    assert failed_checks(run()) == []
    assert failed_checks(run(nmse=None, nmse_of_zeros=None)) == []   # not checked: no claim
    assert failed_checks(run(identical_results=False)) == [
        "thc at 100.0 Mbit/s: the workers' results differ"]
    wrong = failed_checks(run(nmse=0.2))
    assert len(wrong) == 1 and "NMSE 0.2, no better than half an all-zero" in wrong[0]


@pytest.mark.parametrize("argv,message", [
    (["--numel", "0"], "argument --numel: must be at least 1, not 0"),
    (["--numel", "-5"], "argument --numel: must be at least 1, not -5"),
    (["--repeat", "0"], "argument --repeat: must be at least 1, not 0"),
    (["--bmv2-numel", "0"], "argument --bmv2-numel: must be at least 1, not 0")])
def test_counts_that_measure_nothing_are_usage_errors(argv, message, capsys):
    """--numel 0 became the default 2,000,000 or 25,000,000 (a truth test), -5 failed in every
    worker after the testbed was up, --repeat 0 timed one round."""
    import argparse

    from thc.emu import bench_allreduce
    parser = argparse.ArgumentParser()
    bench_allreduce.add_arguments(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--aggregator", "sharded"], ["--loopback"]])
def test_an_aggregator_link_factor_that_shapes_nothing_is_refused(argv, capsys):
    """Taken and written into the JSON with no central aggregator, or no link, to shape."""
    import argparse

    from thc.emu import bench_allreduce
    parser = argparse.ArgumentParser()
    bench_allreduce.add_arguments(parser)
    args = parser.parse_args(["--agg-bw-factor", "4", *argv])
    assert bench_allreduce.run(args) == 2
    assert "--agg-bw-factor" in capsys.readouterr().err
