"""The ``thc`` dispatcher: every subcommand it names is a module with the add_arguments/run
contract, nested tables dispatch, and an unknown command is refused."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from thc import cli


def leaves(table: dict, prefix: str = "thc"):
    for name, (target, _) in table.items():
        if isinstance(target, dict):
            yield from leaves(target, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}", target


def test_every_subcommand_names_a_module_with_the_contract():
    """Checked from the source, without importing: Mininet or p4runtime-shell may be absent."""
    for command, module in leaves(cli.COMMANDS):
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, f"{command}: no module {module}"
        tree = ast.parse(Path(spec.origin).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert {"add_arguments", "run"} <= defined, f"{command}: {module} lacks them"


def test_usage_lists_the_commands_and_the_benchmarks(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.COMMANDS)
    assert cli.main(["bench"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: thc bench <command>")
    assert all(f"  {name} " in out for name in cli.BENCHES)


def test_a_command_runs_its_module(capsys):
    assert cli.main(["table", "--bits", "2", "--granularity", "4", "--p", "1/8"]) == 0
    assert capsys.readouterr().out.strip()


def test_unknown_commands_are_refused(capsys):
    assert cli.main(["nonesuch"]) == 2
    assert cli.main(["bench", "nonesuch"]) == 2
    err = capsys.readouterr().err
    assert "thc: unknown command 'nonesuch'" in err
    assert "thc bench: unknown command 'nonesuch'" in err


def test_the_bench_list_in_the_usage_is_the_benches_table(capsys):
    """It was written by hand and lacked nmse, install and dlcp."""
    assert cli.main(["--help"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  bench "))
    assert line.split("benchmarks: ")[1] == ", ".join(cli.BENCHES)


@pytest.mark.parametrize("argv,env,message", [
    (["bench", "codec"], {"THC_CODEC_CPU": "bogus"}, "thc bench codec: codec cpu 'bogus'"),
    (["bench", "aggregator"], {"THC_AGGREGATOR_DATAPATH": "bogus"},
     "thc bench aggregator: aggregator datapath 'bogus'"),
    (["bench", "aggregator", "--lanes", "7"], {}, "thc bench aggregator: lanes must be"),
    (["run", "--loopback"], {"THC_CLIENT_DATAPATH": "bogus"},
     "thc run: client datapath 'bogus'"),
    (["run", "--loopback", "--software-lanes", "7"], {}, "thc run: --software-lanes 7"),
    (["run", "--loopback", "--workers", "33"], {}, "thc run: --workers 33: a job takes 1..32"),
    (["run", "--loopback", "--modes", ""], {}, "thc run: --modes names no mode"),
    (["run", "--loopback", "--timeout", "-5"], {}, "thc run: --timeout -5: give a positive"),
    (["run", "--loopback", "--bmv2-timeout", "nan"], {}, "thc run: --bmv2-timeout nan")])
def test_bad_settings_and_flags_are_usage_errors_before_any_work(argv, env, message,
                                                                 monkeypatch, capsys, tmp_path):
    """A bad THC_* variable was a ValueError traceback; thc run's flags failed only once a
    mode had started (after minutes of the modes before it)."""
    from thc.codec import settings
    from thc.emu import mainjob

    def started(*a, **k):
        raise AssertionError("a mode started")
    monkeypatch.setattr(mainjob, "_run_mode", started)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings.reset()
    try:
        assert cli.main([*argv, *(["--out", str(tmp_path)] if argv[0] == "run" else [])]) == 2
    finally:
        settings.reset()
    out = capsys.readouterr()
    assert message in out.out + out.err
    assert list(tmp_path.iterdir()) == [], "nothing was written"
