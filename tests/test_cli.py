"""The ``thc`` dispatcher: every subcommand it names is a module with the add_arguments/run
contract, nested tables dispatch, and an unknown command is refused."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from thc import cli
from thc.codec import settings

ROOT = Path(__file__).resolve().parents[1]


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
        defined |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                    for a in n.names}
        assert {"add_arguments", "run"} <= defined, f"{command}: {module} lacks them"


def test_usage_lists_the_commands_and_the_benchmarks(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.COMMANDS)
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: thc bench <command>")
    assert all(f"  {name} " in out for name in cli.BENCHES)


def test_a_command_runs_its_module(capsys):
    assert cli.main(["table", "--bits", "2", "--granularity", "4", "--p", "1/8"]) == 0
    assert capsys.readouterr().out.strip()


def test_help_shows_defaults_its_text_does_not_already_say(capsys):
    """``thc model --workers`` (8) and the worker's ``--epochs`` (3, where the main job trains
    2) had no word of their defaults in --help."""
    import re

    from thc.app import train
    with pytest.raises(SystemExit):
        cli.main(["model", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--workers WORKERS default: 8" in out
    assert "compute per iteration (default: 100.0)" in out
    assert "measures this machine's) (default" not in out   # its text says it already
    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--epochs EPOCHS default: 3" in out
    assert not re.search(r"--no-error-feedback\s+\S*\s*default", out)   # a flag that is off
    assert "(default: )" not in out   # --uncompressed: nothing
    with pytest.raises(SystemExit):
        cli.main(["aggregator", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: True)" not in out   # --no-gso's dest is on: the flag is not
    assert "on sent results (not a percent) (default: 0.0)" in out   # --loss: a default of 0 is one
    with pytest.raises(SystemExit):
        cli.main(["bench", "switch", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: ())" not in out and "e.g. 16,64" in out   # --lanes-sweep: none

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
    (["run", "--loopback", "--workers", "33"], {},
     "argument --workers: a testbed hosts at most 32 workers, not 33"),
    (["run", "--loopback", "--modes", ""], {}, "thc run: --modes names no mode"),
    (["run", "--loopback", "--timeout", "-5"], {}, "argument --timeout: must be above 0"),
    (["run", "--loopback", "--bmv2-timeout", "nan"], {},
     "argument --bmv2-timeout: not a finite number"),
    (["bench", "hook", "--device", "cpu", "--quick", "--buckets", "100"],
     {"THC_CODEC_CPU": "bogus"}, "thc bench hook: codec cpu 'bogus'"),
    (["faults", "--loopback", "--quick", "--only", "dup"], {"THC_CLIENT_GSO": "yes"},
     "thc faults: THC_CLIENT_GSO='yes': use auto, 0 or 1"),
    (["bench", "allreduce", "--loopback", "--quick"], {"THC_CODEC_CPU": "bogus"},
     "thc bench allreduce: codec cpu 'bogus'"),
    (["bench", "dlcp", "--quick"], {"THC_CLIENT_DATAPATH": "bogus"},
     "thc bench dlcp: client datapath 'bogus'"),
    (["nmse", "--quick"], {"THC_CODEC_CPU": "bogus"}, "thc nmse: codec cpu 'bogus'"),
    (["bench", "kernels", "--device", "cpu", "--quick"],
     {"THC_CODEC_CPU": "bogus", "TRITON_INTERPRET": "1"}, "thc bench kernels: codec cpu 'bogus'")])
def test_bad_settings_and_flags_are_usage_errors_before_any_work(argv, env, message,
                                                                 monkeypatch, capsys, tmp_path):
    """A bad THC_* variable was a ValueError traceback; thc run's flags failed only once a
    mode had started (after minutes of the modes before it)."""
    from thc.codec import settings
    from thc.emu import bench_allreduce, bench_dlcp, mainjob

    def started(*a, **k):
        raise AssertionError("a mode or testbed started")
    monkeypatch.setattr(mainjob, "run_mode", started)
    monkeypatch.setattr(bench_allreduce, "open_testbed", started)
    monkeypatch.setattr(bench_dlcp, "open_testbed", started)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings.reset()
    try:
        code = cli.main([*argv, *(["--out", str(tmp_path)] if argv[0] == "run" else [])])
    except SystemExit as e:     # the parser's refusal
        code = e.code
    finally:
        settings.reset()
    out = capsys.readouterr()
    assert code == 2 and message in out.out + out.err
    assert list(tmp_path.iterdir()) == [], "nothing was written"


def _files(tmp: Path) -> None:
    """The files the mistakes below name: a JSON of something else, a main job's report
    without Marsit (what the README's tour runs), one whose runs lack their parameter
    counts (refused as `'params'` alone), a CPU codec's report."""
    (tmp / "other.json").write_text('{"x": 1}')
    (tmp / "list.json").write_text('[1]')
    report = json.loads((ROOT / "docs/runs/mainjob-makerun-bmv2-bounded-quiet.json").read_text())
    report["runs"] = [r for r in report["runs"] if not r["mode"].startswith("marsit")]
    (tmp / "nomarsit.json").write_text(json.dumps(report))
    for run in report["runs"]:
        run.pop("params", None)
    (tmp / "noparams.json").write_text(json.dumps(report))
    (tmp / "cpu.json").write_text(json.dumps({"device": "cpu", "results": [
        {"name": "THC encode+decode (compiled)", "elements": 1 << 22, "median_s": 0.05}]}))


@pytest.mark.parametrize("argv,message", [
    (["model", "--calibrate", "{tmp}/missing.json"],
     "thc model: cannot read a main job's report (out/mainjob.json of `thc run`) {tmp}/missing"),
    (["model", "--calibrate", "{tmp}/other.json"],
     "thc model: {tmp}/other.json is not a main job's report (out/mainjob.json of `thc run`): "
     "it has no 'args', 'runs'"),
    (["model", "--calibrate", "{tmp}/nomarsit.json"],
     "thc model --calibrate: cannot fit alpha and efficiency without the ['marsit'] run(s)"),
    (["model", "--gpu-codec", "{tmp}/cpu.json"], "was measured on the CPU: give a GPU's report"),
    (["model", "--calibrate", "{tmp}/noparams.json"],
     "thc model --calibrate: {tmp}/noparams.json: not a main job's report it can read (a run "
     "lacks 'params')"),
    (["model", "--gpu-codec", "{tmp}/list.json"], "{tmp}/list.json: no 'results' list"),
    (["model", "--calibrate", "{tmp}/list.json"], "it holds a JSON list, not an object"),
    (["sweep", "--report", "{tmp}/missing.json"], "thc sweep: cannot read a sweep's report"),
    (["model", "--workers", "0"], "argument --workers: must be at least 1, not 0"),
    (["model", "--bw", "1,-1"], "argument --bw: must be above 0, not -1"),
    (["model", "--overlap", "0.01"], "argument --overlap: must be 1 or more (a slowdown), not "
                                     "0.01"),
    (["model", "--params", "0.5"], "argument --params: must be a whole number, not 0.5"),
    (["sweep", "--report", "{tmp}/other.json"],
     "thc sweep: {tmp}/other.json is not a sweep's report"),
    (["faults", "--only", "loss,bogus"], "thc faults: --only bogus names no row; the rows: "),
    (["run", "--loopback", "--out", "/proc/thc-out"],
     "thc run: cannot create --out /proc/thc-out"),
    (["run", "--loopback", "--bw", "-5"], "argument --bw: must be above 0, not -5"),
    (["run", "--loopback", "--congest", "0.5"],
     "thc run: --congest needs the Mininet testbed: not with --loopback"),
    (["run", "--loopback", "--loss", "2"],
     "thc run: --loss 2 need emulated links (Mininet): not with --loopback"),
    (["run", "--loopback", "--bw", "500"],
     "thc run: --bw 500 need emulated links (Mininet): not with --loopback"),
    (["run", "--loss", "100"], "argument --loss: a loss lies in [0, 100) percent, not 100"),
    (["run", "--loopback", "--modes", "fp32", "--data", "digits", "--train-subset", "1"],
     "thc run: 1 training images (digits, --train-subset 1) cannot fill one global batch of 4 "
     "workers x --batch 128"),
    (["run", "--loopback", "--quick", "--data", "digits", "--batch", "512"],
     "thc run: 1437 training images (digits, --quick's 8192) cannot fill one global batch"),
    (["run", "--software-lanes", "-4"], "argument --software-lanes: must be at least 0"),
    (["run", "--loopback", "--modes", "fp32,marsit-vote", "--software-lanes", "4"],
     "--software-lanes 4 (marsit-vote's job): 4 lanes of vote do not fill whole bytes"),
    (["run", "--loopback", "--workers", "1"], "--workers 1: the modes compare gradient"),
    (["sweep", "--bw", "50,x"], "argument --bw: not a number: 'x'"),
    (["sweep", "--workers", "40"], "argument --workers: a testbed hosts at most 32 workers"),
    (["sweep", "--target", "73"], "argument --target: a fraction lies in (0, 1], not 73"),
    (["controller", "--grpc-addr", "127.0.0.1:65536", "jobs"],
     "argument --grpc-addr: HOST:PORT (a port 1..65535) or unix:PATH, not '127.0.0.1:65536'"),
    (["controller", "--grpc-addr", "", "jobs"], "argument --grpc-addr: HOST:PORT"),
    (["controller", "--grpc-addr", "127.0.0.1:1", "--timeout", "1e10", "jobs"],
     "argument --timeout: must be at most 9223372036 s (the longest wait a process can make)"),
    (["aggregator", "--duration", "1e300"], "argument --duration: must be at most"),
    (["sweep", "--timeout", "1e12"], "argument --timeout: must be at most"),
    (["model", "--efficiency", "0"], "argument --efficiency: a fraction lies in (0, 1], not 0"),
    (["bench", "allreduce", "--bw", "100,nan"], "argument --bw: not a finite number: 'nan'"),
    (["bench", "allreduce", "--loopback", "--lanes", "3", "--json", "{tmp}/a.json"],
     "--lanes 3 (4 workers, 8-bit sums): lanes must be a positive even number"),
    (["bench", "allreduce", "--loopback", "--aggregator", "bmv2", "--json", "{tmp}/a.json"],
     "thc-bmv2 skipped: not available: --loopback"),
    (["bench", "allreduce", "--loopback", "--workers", "1", "--json", "{tmp}/a.json"],
     "thc bench allreduce: --workers 1: an all-reduce of one worker exchanges nothing"),
    (["bench", "allreduce", "--workers", "64"],
     "argument --workers: a testbed hosts at most 32 workers, not 64"),
    (["bench", "dlcp", "--loss-bound", "2"], "argument --loss-bound: "),
    (["bench", "dlcp", "--layers", "0"], "argument --layers: must be at least 1, not 0"),
    (["bench", "aggregator", "--workers", "2,8", "--load-procs", "9"],
     "thc bench aggregator: --load-procs 9: the load generator runs at most a process a "
     "worker, and --workers 8 (the most) has fewer"),
    (["bench", "dlcp", "--modes", "retransmit", "--loss-bound", "0.1"],
     "thc bench dlcp: --loss-bound applies to bound, bound+prio, which --modes does not name"),
    (["bench", "hook", "--device", "bogus"], "argument --device: cpu, cuda or cuda:N, not"),
    (["bench", "hook", "--device", "cpu", "--buckets", ""],
     "argument --buckets: no integer in ''"),
    (["bench", "hook", "--device", "cpu", "--buckets", "5,x"],
     "argument --buckets: not an integer: 'x'"),
    (["bench", "hook", "--device", "cpu", "--steps", "0"],
     "argument --steps: must be at least 1, not 0"),
    (["bench", "hook", "--device", "cpu", "--bits", "9"], "thc bench hook: bits must be"),
    (["bench", "hook", "--device", "cpu", "--batch", "1", "--image", "32"],
     "--batch 1 of --image 32 leaves it 1x1"),
    (["bench", "kernels", "--device", "bogus"], "argument --device: cpu, cuda or cuda:N"),
    (["bench", "codec", "--device", "cuda:99"], "argument --device: cuda:99: torch sees "),
    (["bench", "kernels", "--error-size", "-1"], "argument --error-size: must be at least 0"),
    (["bench", "codec", "--sizes", ""], "thc bench codec: sizes must be log2 values"),
    (["bench", "codec", "--size", "64", "--sizes", "10"], "--size and --sizes: give one"),
    (["bench", "install", "--quick"], "unrecognized arguments: --quick"),
    (["bench", "install", "--repeat", "0"], "argument --repeat: must be at least 1, not 0"),
    (["bench", "switch", "--duration", "nan"], "argument --duration: not a finite number"),
    (["bench", "switch", "--lanes-sweep", "16,x"], "argument --lanes-sweep: not an integer"),
    (["bench", "install", "--workers", str(10 ** 30)], f"{10 ** 30} workers; 1..32 supported"),
    (["bench", "switch", "--workers", "10000000"], "10000000 workers; 1..32 supported"),
    (["bench", "codec", "--size", str(10 ** 30)],
     f"thc bench codec: a size of {10 ** 30} elements takes about 1.6e+22 GB (an "
     f"estimate), more than the 8.0 GB available"),
    (["bench", "codec", "--sizes", "20,30"],
     f"thc bench codec: a size of {1 << 30} elements takes about 17.2 GB (an estimate)"),
    (["bench", "hook", "--device", "cpu", "--batch", str(10 ** 30)],
     f"thc bench hook: --batch {10 ** 30} of --image 224 (the input alone) takes about"),
    (["bench", "hook", "--device", "cpu", "--batch", "100000", "--image", "1024"],
     "thc bench hook: --batch 100000 of --image 1024 (the input alone) takes about 1258.3 GB"),
    (["bench", "aggregator", "--chunks", str(10 ** 30)],
     f"thc bench aggregator: --chunks {10 ** 30} of 256 lanes for 4 workers takes about"),
    (["bench", "aggregator", "--chunks", str(10 ** 8), "--workers", "2,32"],
     f"thc bench aggregator: --chunks {10 ** 8} of 256 lanes for 32 workers takes about "
     f"614.4 GB"),
    (["bench", "allreduce", "--loopback", "--aggregator", "sharded", "--numel", str(10 ** 9)],
     f"thc bench allreduce: --workers 4 of --numel {10 ** 9} takes about 64.0 GB "
     f"(an estimate), more than the 8.0 GB available"),
    (["bench", "dlcp", "--numel", str(10 ** 13)],
     f"thc bench dlcp: --workers 4 of --numel {10 ** 13} takes about"),
    (["nmse", "--schemes", ","], "thc nmse: --schemes ',' names no scheme"),
    (["table", "--bits", "9"], "thc table: bits must be"),
    (["nmse", "--workers", "1,a"], "argument --workers: not an integer: 'a'"),
    (["nmse", "--workers", "10,100000", "--dim", "1048576"],
     "thc nmse: --workers 100000 of --dim 1048576 takes about 2516.6 GB (an estimate), more "
     "than the"),
    (["table", "--json", "/proc/thc/table.json"],
     "argument --json: cannot write /proc/thc/table.json"),
    (["faults", "--only", ","], "thc faults: --only ',' names no row"),
    (["faults", "--loopback", "--quick", "--only", "dup", "--json", "/proc/thc/f.json"],
     "thc faults: --json: cannot write /proc/thc/f.json")])
def test_user_mistakes_end_in_a_message_not_a_traceback(argv, message, tmp_path, capsys,
                                                       monkeypatch):
    """Each of these ended in a Python traceback (a missing or foreign JSON, a report the
    fit cannot use, a zero count, an --out that cannot be made), ran nothing and said it had
    succeeded (an --only key of no row), or read badly. The sizes past memory are held to
    8 GB available, the same on every machine."""
    from thc import argtypes
    from thc.emu import mainjob

    def started(*a, **k):
        raise AssertionError("a mode started")
    monkeypatch.setattr(mainjob, "run_mode", started)
    monkeypatch.setattr(argtypes, "available_memory", lambda: 8 * 10 ** 9)
    _files(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (print(e.code, file=sys.stderr) or 1)
    out = capsys.readouterr()
    assert rc == 2, out
    assert message.replace("{tmp}", str(tmp_path)) in out.err, out   # not the output's
    assert not (tmp_path / "a.json").exists()   # refused: no report


@pytest.mark.parametrize("argv,message", [
    (["switch", "--workers", "9"], "--workers 9 --pool 256 --sum-bits 8: job 1: 9 workers x "
                                   "granularity 30 = 270 overflows"),
    (["switch", "--pool", "1024"], "--pool 1024 --sum-bits 8: a pool of 1024 slots does not "
                                   "fit the switch's 512"),
    (["switch", "--lanes-sweep", "16,12"], "--lanes-sweep 12: 12 lanes: the switch takes lanes "
                                           "in groups of 8"),
    (["install", "--workers", "33"], "--workers 33 --pool 256: job 1: 33 workers"),
    (["install", "--pool", "100"], "--workers 4 --pool 100: job 1: the pool needs a "
                                   "power-of-two")])
def test_switch_benches_check_their_job_before_the_switch_starts(argv, message, monkeypatch,
                                                                  capsys):
    """A job the flags cannot make was a ConfigError traceback once BMv2 had started (and,
    for a lane count, once the first programs had been measured)."""
    pytest.importorskip("p4runtime_sh")
    from thc.controller import bench, bench_install, toolchain

    def started(*a, **k):
        raise AssertionError("the switch started")
    monkeypatch.setattr(toolchain, "bmv2_missing", lambda program: None)
    monkeypatch.setattr(toolchain, "p4c_missing", lambda: None)
    monkeypatch.setattr(bench, "LocalBMv2", started)
    monkeypatch.setattr(bench_install, "LocalBMv2", started)
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"thc bench {argv[0]}: --") and message in err, err


def test_a_run_that_can_run_no_mode_asked_for_fails(monkeypatch, capsys, tmp_path):
    """Every mode asked for skipped (BMv2 absent) fails rather than writing an empty report
    and exiting 0; Fashion-MNIST named and absent fails rather than training on digits."""
    from thc.emu import mainjob

    monkeypatch.setattr(mainjob, "bmv2_unavailable_reason", lambda: "no BMv2 here")
    monkeypatch.setattr(mainjob, "run_mode", lambda *a: pytest.fail("a mode started"))
    assert cli.main(["run", "--loopback", "--modes", "thc-bmv2", "--out", str(tmp_path)]) == 2
    assert "every mode asked for was skipped" in capsys.readouterr().err
    monkeypatch.setenv("THC_FASHION_MNIST", str(tmp_path / "absent"))
    settings.reset()
    try:
        assert cli.main(["run", "--loopback", "--data", "fashion-mnist", "--out",
                         str(tmp_path)]) == 2
    finally:
        settings.reset()
    assert "--data fashion-mnist: Fashion-MNIST not found in" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_output_path_is_checked_without_making_its_folders(tmp_path):
    """--json and --plot made their folders when parsed, so a run refused after parsing left
    empty folders behind; they are checked by making and removing one, and made when
    written."""
    import argparse

    from thc.argtypes import writable_path
    from thc.bench import emit_json
    target = tmp_path / "a" / "b" / "report.json"
    assert writable_path(str(target)) == str(target)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is not a folder"):
        writable_path(str(tmp_path / "file" / "x.json"))
    emit_json(argparse.Namespace(json=str(target)), {"x": 1})
    assert json.loads(target.read_text())["x"] == 1


def test_an_output_path_no_write_can_take_is_refused_before_the_work(tmp_path, monkeypatch):
    """A name too long for the file system, a loop of links and a link into a missing folder
    ended in OSError, FileExistsError or FileNotFoundError tracebacks (the last one after the
    work); a write that fails after the work anyway leaves the report on standard output."""
    import argparse
    import errno

    from thc.argtypes import writable_path
    from thc.bench import emit_json
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "dangling.json").symlink_to(tmp_path / "gone" / "x.json")
    for name, why in (("a" * 300 + ".json", "File name too long"),
                      ("loop1/x.json", "a loop of links"), ("loop1", "a loop of links"),
                      ("dangling.json", "its link leads into")):
        with pytest.raises(argparse.ArgumentTypeError, match=f"cannot write .*{why}"):
            writable_path(str(tmp_path / name))

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(SystemExit, match=r"\(No space left on device\): the report is above"):
        emit_json(argparse.Namespace(json=str(tmp_path / "r.json")), {"x": 1})


def test_a_report_nested_too_deeply_is_refused_by_name(tmp_path, capsys):
    """read_json caught OSError and ValueError, not RecursionError."""
    from thc.argtypes import read_json
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SystemExit) as e:
        read_json(deep, "a sweep report", prog="thc sweep")
    assert e.value.code == 2
    assert f"thc sweep: {deep} is nested too deeply to be a sweep report" in \
        capsys.readouterr().err


def test_the_version_and_the_bench_tables_help_say_what_they_are(capsys):
    """`thc --version` was an unknown command, and `thc bench --help` said only "THC
    in-network aggregation."."""
    from importlib.metadata import version
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"thc {version('thc-ina')}\n"
    assert cli.main(["bench", "--help"]) == 0
    assert "\nBenchmarks: codec, kernels, hook" in capsys.readouterr().out


def test_no_command_is_a_usage_error(capsys):
    """`thc` and `thc bench` alone printed their help and exited 0, as if they had run."""
    for argv, table in (([], "usage: thc <command>"), (["bench"], "usage: thc bench <command>")):
        assert cli.main(argv) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.startswith(table)


@pytest.mark.parametrize("argv", [
    ["table", "--p", "1e400"], ["table", "--p", "1e1000000000"], ["table", "--p", "1/0"],
    ["nmse", "--quick", "--p", "2e308"]])
def test_a_probability_no_float_holds_is_refused_at_once(argv, capsys):
    """1e400 ended in an OverflowError traceback; 1e1000000000 held the command for minutes
    while Fraction built 10**1000000000."""
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and time.monotonic() - t0 < 5
    assert "argument --p: not a number or fraction" in capsys.readouterr().err


def test_ctrl_c_ends_a_command_in_one_line_and_status_130(monkeypatch, capsys):
    """Wherever Ctrl-C lands (a command's start, before its own handler), no traceback."""
    def interrupted(*_args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["aggregator", "--help"]) == 130
    assert capsys.readouterr().err == "thc: interrupted\n"


@pytest.mark.parametrize("unbuffered", ["1", None])
@pytest.mark.parametrize("argv", [["--help"], ["table"], ["model"]])
def test_a_reader_gone_ends_a_command_with_status_141_and_no_traceback(argv, unbuffered):
    """``thc table | head -1`` printed a BrokenPipeError's traceback and exited 1 (with its
    standard output buffered, as it is by default, at the interpreter's exit: status 120)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    read, write = os.pipe()
    os.close(read)                           # the reader is gone before the first line
    try:
        proc = subprocess.run([sys.executable, "-m", "thc.cli", *argv], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_a_broken_pipe_not_the_standard_outputs_is_the_commands_error(monkeypatch):
    """Only the standard output's reader gone is quiet: a socket's broken pipe is raised."""
    def broken(*_args):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(cli.importlib, "import_module", broken)
    with pytest.raises(BrokenPipeError):
        cli.main(["aggregator", "--help"])


@pytest.mark.parametrize("argv,lines", [
    (["table", "--json"], ""),
    (["bench", "aggregator", "--quick", "--chunks", "64", "--json"], "aggregators vs UDP"),
    (["bench", "aggregator", "--quick", "--chunks", "64", "--json", "-"], "aggregators vs")])
def test_json_to_the_standard_output_comes_alone(argv, lines, capsys):
    """``--json`` with no FILE: the aggregator bench (as the all-reduce and DLCP benches)
    printed its table above the JSON on the standard output, which no JSON reader took."""
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["recorded"]["command"]
    assert lines in err                     # the lines went to the standard error


def test_a_commands_own_json_file_named_dash_keeps_its_lines_on_the_standard_output(
        tmp_path, monkeypatch, capsys):
    """``thc sweep --json -`` writes a file named "-": its lines went to the standard error
    as if the JSON were on the standard output."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["sweep", "--report", str(ROOT / "docs/runs/sweep-bandwidth.json"),
                     "--out", str(tmp_path), "--json", "-"]) == 0
    assert "break-even" in capsys.readouterr().out
    assert json.loads((tmp_path / "-").read_text())["points"]


def test_a_command_started_with_its_output_closed_runs_as_before():
    """``thc table >&-``: the dispatch's flush of the standard output met None there."""
    proc = subprocess.run(["bash", "-c", f"{shlex.quote(sys.executable)} -m thc.cli table >&-"],
                          stderr=subprocess.PIPE, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.parametrize("command", [["run"], ["faults"], ["sweep"], ["bench", "allreduce"],
                                     ["bench", "dlcp"]])
def test_the_testbed_commands_start_without_mininet(command):
    """Their loopback testbed needs no Mininet, yet without its Python module every one of
    them, --help included, ended in ModuleNotFoundError: thc.emu.links imported it."""
    code = ("import sys; sys.modules['mininet'] = None\n"
            "from thc.cli import main\n"
            f"main({command + ['--help']!r})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage: thc" in r.stdout, r.stderr[-1500:]
