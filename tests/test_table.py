"""The lookup table: shape constraints, DP optimality against exhaustive search, parameters."""
import argparse
import itertools
import math

import numpy as np
import pytest

from thc.app import table as table_cmd
from thc.codec import table as T
from thc.codec.params import THCParams, parse_fraction
from thc.codec.table import truncation_threshold


def test_default_table_shape():
    t = T.optimal_table(4, 30, 1 / 32)
    print("b=4 g=30 p=1/32 table:", t.tolist())
    assert t.dtype == np.int64 and t.size == 16
    assert t[0] == 0 and t[-1] == 30
    assert np.all(np.diff(t) > 0)
    assert np.array_equal(t + t[::-1], np.full(16, 30))


def test_params_table_matches_and_is_a_copy():
    p = THCParams()
    t = p.table
    t[0] = 99
    assert p.table[0] == 0
    assert np.array_equal(p.table, T.optimal_table(4, 30, 1 / 32))
    assert np.array_equal(THCParams(table_kind="uniform").table, np.arange(0, 31, 2))


def test_cached_table_is_read_only():
    t = T.optimal_table(4, 30, 1 / 32)
    assert t is T.optimal_table(4, 30, 1 / 32)
    with pytest.raises(ValueError):
        t[1] = 5


@pytest.mark.parametrize("bits,g,p", [(2, 6, 1 / 32), (3, 14, 1 / 32), (4, 30, 1 / 32),
                                      (4, 30, 1 / 1024), (5, 62, 1 / 64), (6, 100, 1 / 256)])
def test_dp_not_worse_than_uniform(bits, g, p):
    opt = T.table_objective(T.optimal_table(bits, g, p), p, g)
    uni = T.table_objective(T.uniform_table(bits, g), p, g)
    assert opt <= uni + 1e-12


def _symmetric_tables(bits, g):
    half = 1 << (bits - 1)
    for lower in itertools.combinations(range(1, (g - 1) // 2 + 1), half - 1):
        low = (0,) + lower
        yield np.array(low + tuple(g - v for v in reversed(low)))


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("p", [1 / 8, 1 / 32, 1 / 1024])
def test_dp_matches_exhaustive_search(bits, p):
    for g in range((1 << bits) - 1, 17):
        best = min(T.table_objective(t, p, g) for t in _symmetric_tables(bits, g))
        dp = T.optimal_table(bits, g, p)
        assert T.table_objective(dp, p, g) == pytest.approx(best, rel=1e-12, abs=1e-15), (g, dp)


def test_model_matches_reference_figures():
    """Analytic NMSE of one Gaussian worker vs the reference figures (0.0204 THC, 0.0206 UHC,
    0.0196 at p = 1/64)."""
    thc = T.expected_nmse(T.optimal_table(4, 30, 1 / 32), 1 / 32, 30)
    uhc = T.expected_nmse(T.uniform_table(4, 30), 1 / 32, 30)
    opt64 = T.expected_nmse(T.optimal_table(4, 30, 1 / 64), 1 / 64, 30)
    print(f"model: THC {thc:.5f} UHC {uhc:.5f} THC p=1/64 {opt64:.5f}")
    assert thc == pytest.approx(0.0204, rel=0.01)
    assert uhc == pytest.approx(0.0206, rel=0.01)
    assert opt64 == pytest.approx(0.0196, rel=0.02)
    assert opt64 < thc


def test_truncation_thresholds_match_design():
    for p, t in [(1 / 32, 2.1539), (1 / 64, 2.4176), (1 / 128, 2.6601), (1 / 512, 3.0973)]:
        assert truncation_threshold(p) == pytest.approx(t, abs=5e-5)
        assert THCParams(p=p).t_p == pytest.approx(t, abs=5e-5)


def test_extreme_bit_widths():
    assert T.optimal_table(1, 30, 1 / 32).tolist() == [0, 30]
    assert T.optimal_table(8, 255, 1 / 32).tolist() == list(range(256))
    t = T.optimal_table(8, 600, 1 / 1024)
    assert t.size == 256 and t[0] == 0 and t[-1] == 600 and np.all(np.diff(t) > 0)


def test_uniform_table_symmetric_for_odd_granularity():
    for bits, g in [(2, 7), (3, 9), (4, 31), (4, 45)]:
        t = T.uniform_table(bits, g)
        assert t[0] == 0 and t[-1] == g and np.all(np.diff(t) > 0)
        assert np.array_equal(t + t[::-1], np.full(t.size, g))


@pytest.mark.parametrize("bits,g", [(4, 14), (8, 254), (3, 6)])
def test_granularity_too_small_is_a_clear_error(bits, g):
    with pytest.raises(ValueError, match="granularity"):
        T.optimal_table(bits, g, 1 / 32)
    with pytest.raises(ValueError, match="granularity"):
        THCParams(bits=bits, granularity=g)


@pytest.mark.parametrize("kw,word", [({"bits": 0}, "bits"), ({"bits": 9}, "bits"),
                                     ({"p": 0.0}, "p"), ({"p": 1.0}, "p"),
                                     ({"slice_size": 1000}, "slice_size"),
                                     ({"seed": -1}, "seed"), ({"table_kind": "x"}, "table_kind")])
def test_params_validation(kw, word):
    with pytest.raises(ValueError, match=word):
        THCParams(**kw)


def test_fraction_parsing_and_argparse():
    assert parse_fraction("1/32") == 1 / 32
    assert parse_fraction("0.03125") == 1 / 32
    with pytest.raises(argparse.ArgumentTypeError):
        parse_fraction("a/b")
    parser = argparse.ArgumentParser()
    THCParams.add_arguments(parser)
    params = THCParams.from_args(parser.parse_args(["--bits", "3", "-g", "14", "--p", "1/64"]))
    assert (params.bits, params.granularity, params.p) == (3, 14, 1 / 64)


def test_cli_prints_table(capsys):
    parser = argparse.ArgumentParser()
    table_cmd.add_arguments(parser)
    assert table_cmd.run(parser.parse_args(["--bits", "4", "--granularity", "30", "--p", "1/32",
                                    "--uniform"])) == 0
    out = capsys.readouterr().out
    assert " ".join(map(str, T.optimal_table(4, 30, 1 / 32))) in out
    assert "t_p = 2.1539" in out and "uniform table" in out
    assert table_cmd.run(parser.parse_args(["--bits", "8", "--granularity", "30"])) == 2
    assert "granularity" in capsys.readouterr().err


def test_uniform_table_rounds_halves_up_not_down():
    """round(i g / (2^b - 1)): for b = 2, g = 11 the lower half is 0, round(3.67) = 4 (a floor
    gave 3, not the evenly spaced table the docstring promises)."""
    assert T.uniform_table(2, 11).tolist() == [0, 4, 7, 11]
    assert T.uniform_table(3, 10).tolist() == [0, 1, 3, 4, 6, 7, 9, 10]


def test_more_than_8_bits_are_refused_as_bits_whatever_the_granularity():
    """bits=9 with the default g was refused by the granularity check (whose message names
    2^bits); with a granularity that fits 2^9 values it must still be refused as bits."""
    with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
        THCParams(bits=9, granularity=1000, table_kind="uniform")


def test_largest_granularity_and_slice_size_are_taken():
    """The limits are inclusive: an optimal table up to g = 4096, slices up to 2^32."""
    assert THCParams(granularity=4096).granularity == 4096
    assert THCParams(slice_size=1 << 32).slice_size == 1 << 32
    with pytest.raises(ValueError, match="at most 4096"):
        THCParams(granularity=4097)
    with pytest.raises(ValueError, match="slice_size"):
        THCParams(slice_size=1 << 33)


def test_from_args_without_a_seed_flag_takes_seed_0():
    """Commands that add the flags with seed=False share the default rotation seed 0."""
    parser = argparse.ArgumentParser()
    THCParams.add_arguments(parser, seed=False)
    assert THCParams.from_args(parser.parse_args([])) == THCParams()


def test_describe_writes_a_fraction_only_when_it_is_p():
    """1/3 + 1e-7 is not 1/3: the text must not claim it is."""
    assert "p=1/32 " in THCParams().describe()
    text = THCParams(p=1 / 3 + 1e-7).describe()
    assert "p=0.333333 " in text and "1/3" not in text


def test_numpy_integer_fields_are_stored_as_python_ints():
    """Parameters are compared, hashed and written out (JSON) across workers: a numpy int64
    granularity kept as such cannot be written as JSON."""
    import dataclasses
    import json
    p = THCParams(bits=np.int64(4), granularity=np.int64(30), seed=np.uint64(3),
                  slice_size=np.int64(256))
    assert all(type(getattr(p, f)) is int for f in ("bits", "granularity", "seed", "slice_size"))
    assert json.loads(json.dumps(dataclasses.asdict(p)))["granularity"] == 30


def _trapezoid(y, x) -> float:
    """The trapezoid rule, written out: numpy's is trapz before 2.0 and trapezoid from 2.0 on,
    and the package takes numpy from 1.24."""
    return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2)


def test_the_cli_reports_each_tables_own_figures(capsys):
    """`thc table --json -`: the uniform table's figures are its own (they were the optimal
    table's), and the one-worker NMSE is the rounding variance of the coordinates kept plus
    the clamping's error, each integrated here over a standard normal: stochastic rounding
    between table points a < b costs (x - a)(b - x) at x, in grid units of 2 t_p / g; a
    clamped coordinate costs (|z| - t_p)^2. And P(|Z| > t_p) printed is p."""
    import json
    import math

    parser = argparse.ArgumentParser()
    table_cmd.add_arguments(parser)
    assert table_cmd.run(parser.parse_args(["--bits", "4", "--granularity", "30",
                                            "--p", "1/32"])) == 0
    assert "(P(|Z| > t_p) = 0.03125)" in capsys.readouterr().out
    assert table_cmd.run(parser.parse_args(["--bits", "4", "--granularity", "30", "--p", "1/32",
                                            "--json", "-"])) == 0
    result = json.loads(capsys.readouterr().out)
    t, p, g = result["t_p"], 1 / 32, 30
    assert math.erfc(t / math.sqrt(2)) == pytest.approx(p, rel=1e-4)
    z = np.linspace(-t, t, 400_001)
    pdf = np.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    x = (z + t) / (2 * t) * g
    tail = np.linspace(t, t + 12, 400_001)
    clamped = 2 * _trapezoid((tail - t) ** 2 * np.exp(-tail * tail / 2), tail) \
        / math.sqrt(2 * math.pi)
    assert result["uniform"]["table"] == list(range(0, 31, 2))   # round(2i)
    for name in ("uniform", "optimal"):
        pts = np.array(result[name]["table"], dtype=float)
        hi = np.clip(np.searchsorted(pts, x, side="right"), 1, len(pts) - 1)
        cost = (x - pts[hi - 1]) * (pts[hi] - x) * (2 * t / g) ** 2
        variance = _trapezoid(cost * pdf, z) / (1 - p)
        assert result[name]["expected_variance"] == pytest.approx(variance, rel=1e-3), name
        assert result[name]["expected_nmse_one_worker"] == pytest.approx(
            (1 - p) * variance + clamped, rel=1e-3), name


def test_the_threshold_keeps_a_tiny_ps_tail():
    """t_p was Phi^-1(1 - p/2), which loses p's digits: at p = 3e-16 the tail beyond it held
    0.74 p, at 1e-15 1.11 p. P(|Z| > t) is erfc(t / sqrt 2), exact there."""
    for p in (1e-6, 1e-13, 1e-15, 3e-16, 1e-16):
        t = truncation_threshold(p)
        assert math.erfc(t / math.sqrt(2)) / p == pytest.approx(1, abs=1e-9), p
