"""``thc nmse``: the table, the JSON and the plot."""
import argparse
import json

import numpy as np
import pytest

from thc.bench import nmse as bench


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
    assert rows["fp16"]["nmse"]["1"] < 1e-6
    # QSGD's reference holds at d = 2^18 only (0.079 beside a measured 0.056 read as a gap)
    assert "reference" in thc and "reference" not in rows["qsgd"]
    # both ways: THC's sums come down 8 bits a coordinate to 8 workers at g = 30
    assert res["thc_bits_down"] == {"1": 8, "4": 8}
    assert "bits down: THC's, the sums a coordinate (n=1: 8, n=4: 8)" in text


def test_thc_sums_come_down_wider_past_the_8_bit_limit(tmp_path, capsys):
    out = tmp_path / "nmse.json"
    assert bench.run(parse(["--quick", "--workers", "8,9", "--schemes", "fp16",
                            "--json", str(out)])) == 0
    assert json.loads(out.read_text())["thc_bits_down"] == {"8": 8, "9": 16}


DESIGN_REFERENCE = {"thc": {"1": 0.0204, "10": 0.0020}, "uhc": {"1": 0.0206, "10": 0.0021},
                    "qsgd": {"1": 0.079, "10": 0.0079}}
"""The reference figures, from an independent numpy implementation (b=4, g=30, p=1/32, QSGD
s=7; Gaussian vectors, d = 2^18), written out here rather than taken from the bench."""


def test_measured_nmse_matches_the_independent_reference(tmp_path):
    """Measured at the reference's own size: THC and UHC within 2 % of it (one trial of
    2^18 coordinates varies by well under 1 %; the n = 10 figures have two digits: 5 %),
    QSGD within 8 % (its L-inf scale follows the vector's largest coordinate); n
    independent workers divide the error by n."""
    out = tmp_path / "nmse.json"
    args = parse(["--dim", str(2 ** 18), "--workers", "1,10", "--trials", "1",
                  "--schemes", "thc,uhc,qsgd", "--json", str(out)])
    assert bench.run(args) == 0
    rows = {r["spec"]: r["nmse"] for r in json.loads(out.read_text())["results"]}
    for scheme, tol in (("thc", 0.02), ("uhc", 0.02), ("qsgd", 0.08)):
        for n, ref in DESIGN_REFERENCE[scheme].items():
            rel = max(tol, 0.05) if n == "10" else tol
            assert rows[scheme][n] == pytest.approx(ref, rel=rel), (scheme, n, rows[scheme][n])
        assert rows[scheme]["10"] == pytest.approx(rows[scheme]["1"] / 10, rel=0.1), scheme
    assert rows["thc"]["1"] < rows["uhc"]["1"] < rows["qsgd"]["1"] / 3


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
    assert bench.run(parse(["--schemes", "nope", "--quick"])) == 2
    assert "unknown scheme" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--dim", "--trials", "--workers"])
def test_a_size_below_one_is_refused_by_the_parser(flag, capsys):
    """``--dim 0``, ``--trials 0`` and ``--workers 0`` were told apart from other errors only
    once run."""
    with pytest.raises(SystemExit) as e:
        parse([flag, "0"])
    assert e.value.code == 2
    assert f"argument {flag}: must be at least 1, not 0" in capsys.readouterr().err


def test_every_scheme_is_checked_before_the_first_is_measured(monkeypatch, capsys):
    """``--schemes thc,bogus`` measured THC (seconds at 2^18, more with --plot) before it
    found the typo; ``--schemes ,`` measured nothing and exited 0."""
    monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail("a scheme was measured"))
    assert bench.run(parse(["--schemes", "thc,bogus"])) == 2
    assert "unknown scheme 'bogus'" in capsys.readouterr().err
    assert bench.run(parse(["--schemes", ","])) == 2
    assert "--schemes ',' names no scheme" in capsys.readouterr().err


def test_a_schemes_own_option_wins_over_the_flags_default_with_spaces_too(monkeypatch):
    """``--schemes "thc: p=1/64"`` ran p=1/32: the flag's default won where a space stood
    before the option's name."""
    seen = []
    monkeypatch.setattr(bench, "measure", lambda scheme, workers, *a: seen.append(scheme)
                        or {n: {"nmse": 0.0, "stderr": None} for n in workers})
    bench.run(parse(["--quick", "--schemes", "thc: p=1/64,thc:p=1/16", "--workers", "1"]))
    assert [s.params.p for s in seen] == [1 / 64, 1 / 16]


def test_a_size_given_wins_over_quick(tmp_path):
    """``--quick --dim 2^16`` measured 2^14 coordinates and ``--trials 3`` two, silently."""
    out = tmp_path / "nmse.json"
    args = parse(["--quick", "--dim", str(2 ** 15), "--trials", "3", "--workers", "1",
                  "--schemes", "fp16", "--json", str(out)])
    assert bench.run(args) == 0
    res = json.loads(out.read_text())
    assert (res["dim"], res["trials"]) == (2 ** 15, 3)


@pytest.mark.parametrize("argv", [["nmse"], ["bench", "nmse"]])
def test_errors_name_the_command_as_typed(argv, capsys):
    from thc.cli import main
    assert main(argv + ["--schemes", ","]) == 2
    assert capsys.readouterr().err.startswith(" ".join(["thc"] + argv) + ": --schemes")
    with pytest.raises(SystemExit) as e:
        main(argv + ["--workers", "0"])
    assert e.value.code == 2
    assert f"{' '.join(['thc'] + argv)}: error: argument --workers" in capsys.readouterr().err
