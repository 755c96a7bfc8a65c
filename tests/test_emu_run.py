"""``python -m thc.emu.run``'s flags are refused before a testbed comes up."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_retransmission_timeout_that_is_no_time_is_a_usage_error(value, capsys):
    """--rto 0 reached every worker, each of which failed with its own traceback."""
    from thc.emu import run
    with pytest.raises(SystemExit) as e:
        run.main(["--rto", value])
    assert e.value.code == 2
    assert "argument --rto: " in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--loopback", "--delay", "5"], "--delay 5 need emulated links (Mininet): not with "
                                     "--loopback"),
    (["--loopback", "--loss", "1", "--delay", "2"], "--delay 2 and --loss 1 need emulated"),
    (["--loss", "100"], "a loss lies in [0, 100) percent"),
    (["--numel", "0"], "must be at least 1"), (["--window", "0"], "must be at least 1"),
    (["--timeout", "nan"], "not a finite number"), (["--lanes", "-1"], "must be at least 0"),
    (["--seed", "-1"], "argument --seed: must be at least 0, not -1"),
    (["--bw", "100", "--agg-bw-factor", "4"], "shapes the central aggregator's link, and none"),
    (["--bw", "1e12"], "must lie in [0.1, 100000] Mbit/s"),
    (["--bw", "1e-6"], "must lie in [0.1, 100000] Mbit/s (100 Gbit/s at most), got 1e-06"),
    (["--aggregator", "central", "--agg-bw-factor", "4"], "give --bw, without --loopback"),
    (["--aggregator", "central", "--bw", "100", "--loopback", "--agg-bw-factor", "4"],
     "--bw 100 need emulated links (Mininet): not with --loopback"),
    (["--loopback", "--bw", "50"], "--bw 50 need emulated links (Mininet): not with --loopback")])
def test_links_and_shapes_no_testbed_can_give_are_refused(argv, said, capsys):
    """--loopback --delay 5 (or --bw 50) ran unshaped, saying only that links were not
    emulated; a loss of 100% was taken and the round ended at its deadline; --numel 0 reached
    the workers (as did --seed -1, and each failed); --bw 1e12 (or 1e-6) printed tc's
    refusals and ran unshaped under its label."""
    from thc.emu import run
    try:
        code = run.main(argv)        # refused by run(), before its testbed
    except SystemExit as e:
        code = e.code                # refused by the parser
    assert code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("entry", ["thc run", "thc.emu.run"])
def test_delay_or_loss_where_mininet_cannot_run_is_refused_naming_why(entry, monkeypatch,
                                                                      capsys):
    """Without --loopback, a machine where Mininet cannot run sent the run to the loopback
    and took --delay and --loss unemulated, said only inside a progress line."""
    from thc import cli
    from thc.emu import mainjob, run, testbed
    why = "'brctl' is not on PATH (apt-get install bridge-utils)"
    monkeypatch.setattr(mainjob, "mininet_unavailable_reason", lambda *a: why)
    monkeypatch.setattr(testbed, "mininet_unavailable_reason", lambda *a: why)

    def started(*a, **k):
        raise AssertionError("a run started")
    monkeypatch.setattr(mainjob, "run_mode", started)
    monkeypatch.setattr(run, "open_testbed", started)
    if entry == "thc run":
        code = cli.main(["run", "--delay", "10", "--loss", "1", "--modes", "fp32,thc"])
    else:
        code = run.main(["--delay", "10"])
    err = capsys.readouterr().err
    assert code == 2 and "need emulated links (Mininet), which cannot run here" in err \
        and why in err, err
