"""The ``thc`` dispatcher: every subcommand it names is a module with the add_arguments/run
contract, nested tables dispatch, and an unknown command is refused."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

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
