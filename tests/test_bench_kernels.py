"""``thc bench kernels`` under Triton's interpreter (a check that it runs and restores the
kernels' settings, not a speed), and its settings parser."""
import json
import os
import subprocess
import sys

import pytest

from thc.bench.tiles import TUNABLE, parse_configs


def test_configs_parse_and_refuse_what_is_not_a_setting():
    class Kernels:
        TILE, COLS_FIRST, COLS_LOG, NUM_WARPS, ROW_TILES = 4096, True, 12, 4, 4
        FORM, FORMS = "transpose", ("transpose", "sandwich")
    assert parse_configs("", Kernels) == [{}]
    assert parse_configs("TILE=8192,COLS_FIRST=0;COLS_LOG=0;FORM=sandwich", Kernels) == [
        {"TILE": 8192, "COLS_FIRST": False}, {"COLS_LOG": 0}, {"FORM": "sandwich"}]
    for bad in ("PRECISION=1", "TILE=big", "NOPE=3", "FORM=2", "FORM=twisted"):
        with pytest.raises(ValueError, match="NAME=INTEGER") as err:
            parse_configs(bad, Kernels)
        assert all(name in str(err.value) for name in TUNABLE if name != "PRECISION")
    for bad, message in (("TILE=3000", "TILE is a power of two in 16..65536"),
                         ("NUM_WARPS=64", "NUM_WARPS is a power of two in 1..32"),
                         ("COLS_FIRST=2", "COLS_FIRST is an integer in 0..1"),
                         ("ROW_TILES=0", "ROW_TILES is a power of two in 1..64")):
        with pytest.raises(ValueError, match=f"config item {bad}: {message}"):
            parse_configs(bad, Kernels)


def test_runs_under_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "k.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "thc.cli", "bench", "kernels", "--device", "cpu",
                        "--quick", "--precisions", "tf32x2", "--configs", ";FORM=transpose",
                        "--json", str(out)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())["precisions"]["tf32x2"]
    assert {row["config"] for row in rep["rows"]} == {"as set", "FORM=transpose"}
    assert rep["decode_rel_error"] < 1e-6 and rep["indices_differing"] < 1e-3
    names = [row["name"] for row in rep["rows"]]
    assert names.count("decode pass 2") == 2 and "copy in pass 2's tiles" in names


@pytest.mark.parametrize("argv,message", [
    (["--precisions", ","], "--precisions ',': unknown precision []"),
    (["--sizes", "abc"], "sizes must be log2 values in 0..34, got 'abc'"),
    (["--bits", "9"], "bits must be an integer in 1..8, got 9"),
    (["--sizes", "20", "--error-size", "100"], "--error-size is a log2 value in 0..34")])
def test_bad_flags_end_in_a_message_before_any_kernel(argv, message, monkeypatch, capsys):
    """Each was a traceback (a size that is no number, bits THC cannot take, 2^100 elements
    for the error check) or, for no precision, a run that timed nothing and exited 0."""
    pytest.importorskip("triton")
    from thc.bench import kernels
    from thc.cli import main
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "_kernel_rows", lambda *a: pytest.fail("a kernel ran"))
    monkeypatch.setattr(kernels, "_errors", lambda *a: pytest.fail("a kernel ran"))
    assert main(["bench", "kernels", "--device", "cpu", *argv]) == 2
    assert f"thc bench kernels: {message}" in capsys.readouterr().out


def test_quick_keeps_an_error_size_given(monkeypatch, capsys):
    """``--quick`` set the error check's 2^12 over the ``--error-size`` given, silently."""
    pytest.importorskip("triton")
    from thc.bench import kernels
    from thc.cli import main
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    checked = []
    monkeypatch.setattr(kernels, "_kernel_rows", lambda tk, n, *a: [
        {"name": "copy", "elements": n, "median_s": 1e-6, "gb_per_s": 1.0, "of_copy": 1.0}])
    monkeypatch.setattr(kernels, "_errors", lambda n, *a: checked.append(n) or {
        "decode_rel_error": 0.0, "indices_differing": 0.0})
    assert main(["bench", "kernels", "--device", "cpu", "--quick", "--precisions", "ieee",
                 "--error-size", "11"]) == 0
    assert checked == [1 << 11] and "(2^11 elements)" in capsys.readouterr().out
