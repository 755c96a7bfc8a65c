"""``thc nmse``: the table, the JSON and the plot."""
import argparse
import json

import numpy as np
import pytest

from host.bench import nmse as bench


def parse(argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_nmse_helper():
    xs = [np.ones(4, np.float32), 3 * np.ones(4, np.float32)]
    assert bench.nmse(xs, np.full(4, 2.0)) == 0.0
    assert bench.nmse(xs, np.full(4, 3.0)) == pytest.approx(4 / 20)


def test_quick_run_json_and_table(tmp_path, capsys):
    out = tmp_path / "nmse.json"
    args = parse(["--quick", "--workers", "1,4", "--schemes", "thc,uhc:p=1/1024,qsgd,fp16",
                  "--json", str(out)])
    assert bench.run(args) == 0
    text = capsys.readouterr().out
    assert "n=1" in text and "n=4" in text and "model" in text and "reference" in text
    res = json.loads(out.read_text())
    assert res["dim"] == 2 ** 14 and res["workers"] == [1, 4]
    rows = {r["spec"]: r for r in res["results"]}
    thc = rows["thc"]
    print("quick THC NMSE:", thc["nmse"], "model:", thc["model"])
    assert thc["nmse"]["1"] == pytest.approx(thc["model"]["1"], rel=0.1)
    assert thc["nmse"]["4"] == pytest.approx(thc["model"]["4"], rel=0.1)
    assert rows["uhc:p=1/1024"]["nmse"]["1"] > thc["nmse"]["1"]
    assert rows["qsgd"]["reference"] == {"1": 0.079}
    assert rows["fp16"]["nmse"]["1"] < 1e-6


def test_plot(tmp_path):
    png = tmp_path / "plot.png"
    args = parse(["--quick", "--dim", "4096", "--trials", "1", "--workers", "1",
                  "--schemes", "thc", "--plot", str(png), "--dist", "lognormal"])
    assert bench.run(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_best_p_prefers_smaller_p_for_more_bits():
    assert bench.best_p(4, 30, "optimal") in (1 / 32, 1 / 64)
    assert bench.best_p(8, 510, "optimal") < bench.best_p(2, 6, "optimal")


def test_bad_arguments(capsys):
    assert bench.run(parse(["--workers", "0"])) == 2
    assert bench.run(parse(["--schemes", "nope", "--quick"])) == 2
    assert "unknown scheme" in capsys.readouterr().out
