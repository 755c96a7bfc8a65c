"""``thc bench codec``'s flags: a count that times nothing, or a backend that cannot run on
the device, is refused before any timing, as a usage error."""
from __future__ import annotations

import argparse

import pytest

from thc.bench import codec as bench


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="thc bench codec")
    bench.add_arguments(parser)
    return parser


@pytest.mark.parametrize("argv,message", [
    (["--size", "0"], "argument --size: must be at least 1, not 0"),
    (["--size", "-5"], "argument --size: must be at least 1, not -5"),
    (["--repeat", "0"], "argument --repeat: must be at least 1, not 0"),
    (["--repeat", "-5"], "argument --repeat: must be at least 1, not -5"),
    (["--ranks", "0"], "argument --ranks: must be at least 1, not 0"),
    (["--ranks", "1,x"], "argument --ranks: not an integer: 'x'"),
    (["--device", "bogus"], "argument --device: cpu, cuda or cuda:N, not 'bogus'")])
def test_counts_that_time_nothing_are_usage_errors(argv, message, capsys):
    """--size 0 ran the default sweep (a truth test), --repeat 0 or -5 ran once, --ranks 0
    timed a "PowerSGD rank 0"."""
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_ranks_parse_to_a_list_and_none_is_allowed():
    assert _parser().parse_args([]).ranks == [1, 4]
    assert _parser().parse_args(["--ranks", ""]).ranks == []


def test_a_backend_that_cannot_run_on_the_device_is_a_clear_error(monkeypatch, capsys):
    """--backend triton on the CPU without Triton's interpreter raised its RuntimeError from
    the first measurement, outside run()'s checks: a traceback."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = _parser().parse_args(["--backend", "triton", "--quick", "--repeat", "1"])
    assert bench.run(args) == 2
    assert "thc bench codec: the triton backend" in capsys.readouterr().err
