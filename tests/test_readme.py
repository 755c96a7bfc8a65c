"""The README's examples run as written: the public API and the README change together.

Every fenced block of README.md is checked. A ``python`` block carries a label in the line
above it (``<!-- example: NAME -->``, or ``<!-- example: NAME, needs: bmv2 -->`` for one
that needs a switch) and has a check here: the blocks run in order in one namespace, each
followed by its check; the test provides only what the prose assumes (a running central
aggregator and its central.json, a gradient ``grad``, a model in a one-process DDP group, a
BMv2 switch at the address the prose names). A ``json`` block is a cluster file and must
load. In an ``sh`` block every ``thc``, ``python -m`` and ``torchrun`` line must parse with
the command's own parser (``thc table`` and ``--help`` lines also run), every ``make``
target must exist, and any other program must be one of :data:`EXTERNAL`.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXTERNAL = {"simple_switch_grpc", ".", "cd"}
"""Programs the README may name in a shell block that are not the project's own."""
HARDWARE = {"bmv2": "a BMv2 switch (simple_switch_grpc) and root"}
SWITCH_ADDRESS = "127.0.0.1:9559"
"""Where the controller example's prose says simple_switch_grpc listens."""

FENCE = re.compile(r"(?:<!-- example: (?P<label>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```",
                   re.S)


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    name: str | None
    needs: str | None
    line: int


def blocks(text: str) -> list[Block]:
    """Every fenced block of ``text``, with its label's name and what it needs."""
    out = []
    for m in FENCE.finditer(text):
        name = needs = None
        if m["label"]:
            name, _, rest = m["label"].partition(",")
            name = name.strip()
            if rest:
                key, _, value = rest.partition(":")
                if key.strip() != "needs" or value.strip() not in HARDWARE:
                    raise AssertionError(f"README.md:{text.count(chr(10), 0, m.start()) + 1}: "
                                         f"unknown label {m['label']!r} (needs: one of "
                                         f"{sorted(HARDWARE)})")
                needs = value.strip()
        out.append(Block(m["lang"], m["code"], name, needs,
                         text.count("\n", 0, m.start("code")) + 1))
    return out


def python_blocks(text: str) -> list[Block]:
    found = [b for b in blocks(text) if b.lang == "python"]
    for b in found:
        if b.name not in CHECKS:
            raise AssertionError(f"README.md:{b.line}: python block "
                                 f"{b.name or '(no <!-- example: NAME --> label)'} has no check "
                                 f"in tests/test_readme.py")
    return found


def run_block(b: Block, ns: dict) -> None:
    """Execute a block, then its check."""
    exec(compile(b.code, f"README.md:{b.line}", "exec"), ns)
    CHECKS[b.name](ns)


def _nmse(estimate, truth) -> float:
    return float(((estimate - truth) ** 2).sum() / (truth ** 2).sum())


def check_codec(ns: dict) -> None:
    true_mean = torch.stack(ns["xs"]).mean(0)
    assert _nmse(ns["mean"], true_mean) < 0.05


def check_allreduce(ns: dict) -> None:
    # one worker: the all-reduce's mean is its own gradient, up to THC's error
    assert _nmse(ns["mean_grad"], ns["grad"]) < 0.05
    r, idx = ns["result"], ns["idx"][0].numpy()
    table = torch.tensor(ns["params"].table)
    assert (r.sums[: idx.size] == table[idx.astype("int64")].numpy()).all()
    assert (r.counts == 1).all() and r.datapath in ("compiled", "python")


def check_ddp(ns: dict) -> None:
    model, plain = ns["model"], ns["plain"]
    x = torch.randn(4, 16)
    ns["ddp_model"](x).sum().backward()
    plain(x).sum().backward()
    # the biases (kept FP32, as the example asks) get their own gradient, the weights its
    # THC estimate through the aggregator
    assert ns["hook"].fp32_elements == 8 + 2 and ns["hook"].bytes_sent > 0
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if "bias" in name:
            torch.testing.assert_close(p.grad, q.grad)
        else:
            assert _nmse(p.grad, q.grad) < 0.1, name


def check_controller(ns: dict) -> None:
    job_id = ns["cluster"].jobs[0].job_id
    assert set(ns["index"]) == {job_id}
    from thc.controller import Switch, installed_jobs
    with Switch(ns["switch_address"]).connect(program=None) as sw:
        assert job_id not in installed_jobs(sw)


def check_amp(ns: dict) -> None:
    # a finite step: taken (a skipped one halves the scale), so the residuals keep their units
    assert ns["old"] == ns["scaler"].get_scale() == 2.0 ** 16
    assert all(p.grad is not None for p in ns["model"].parameters())


CHECKS = {"codec": check_codec, "allreduce": check_allreduce, "ddp": check_ddp,
          "amp": check_amp, "controller": check_controller}


def test_every_python_block_is_labelled_and_checked():
    names = [b.name for b in python_blocks(README.read_text())]
    assert sorted(names) == sorted(CHECKS), names


def test_python_examples_run(tmp_path, monkeypatch):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.net.aggregator import Aggregator
    from thc.testing.clusters import free_port_block, free_tcp_port, local_job
    from thc.wire.jobs import Cluster

    job = local_job(1, 1, free_port_block(1))
    ran = []
    with Aggregator([job]) as agg:
        host, port = agg.start()
        Cluster(jobs=(job,), agg_ip=host, agg_port=port).save(tmp_path / "central.json")
        monkeypatch.chdir(tmp_path)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                                rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))
            ns: dict = {"grad": torch.randn(5000), "model": model,
                        "plain": copy.deepcopy(model), "ddp_model": DDP(model)}
            for b in python_blocks(README.read_text()):
                if b.needs is None:
                    run_block(b, ns)
                    ran.append(b.name)
        finally:
            dist.destroy_process_group()
    assert ran == ["codec", "allreduce", "ddp", "amp"]


@pytest.mark.bmv2
@pytest.mark.parametrize("name", [b.name for b in blocks(README.read_text()) if b.needs])
def test_python_examples_that_need_hardware(name, tmp_path):
    from thc.controller.toolchain import bmv2_missing
    b = next(b for b in python_blocks(README.read_text()) if b.name == name)
    why = bmv2_missing()
    if why:
        pytest.skip(f"README example {name!r} needs {HARDWARE[b.needs]}: {why}")
    from thc.controller.testing.bmv2 import LocalBMv2
    from thc.wire.jobs import SWITCH_AGG_IP, SWITCH_AGG_MAC, Cluster, Job
    workers = [{"id": i, "ip": f"10.0.0.{i + 1}", "port": 50000 + i,
                "mac": f"02:00:00:00:00:{i + 1:02x}", "switch_port": i} for i in range(2)]
    cluster = Cluster(jobs=(Job.from_dict({"job_id": 1, "workers": workers, "p": 1 / 32,
                                           "granularity": 30}),),
                      agg_ip=SWITCH_AGG_IP, agg_mac=SWITCH_AGG_MAC)
    with LocalBMv2(2, connect=False, receive=False) as bm:
        code = b.code.replace(SWITCH_ADDRESS, bm.grpc_addr)
        assert code != b.code, f"the example names no switch at {SWITCH_ADDRESS}"
        ns = {"cluster": cluster, "switch_address": bm.grpc_addr}
        run_block(Block(b.lang, code, b.name, b.needs, b.line), ns)


def test_cluster_file_example_loads(tmp_path):
    from thc.wire.jobs import Cluster
    found = [b for b in blocks(README.read_text()) if b.lang == "json"]
    assert found
    for b in found:
        (tmp_path / "cluster.json").write_text(b.code)
        cluster = Cluster.load(tmp_path / "cluster.json")
        assert cluster.jobs and json.loads(b.code)["jobs"][0]["job_id"] == cluster.jobs[0].job_id


def _parser(module: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=module, exit_on_error=False)
    importlib.import_module(module).add_arguments(parser)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str], where: str) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise AssertionError(f"{where}: {shlex.join(argv)}: {e}") from None


def check_command(argv: list[str], where: str, makefile: str) -> bool:
    """Parse one README command line with the command's own parser (or find its make
    target); True when it is cheap enough to run as well."""
    from thc.cli import BENCHES, COMMANDS
    prog = argv[0]
    if prog == "make":
        for target in argv[1:]:
            if "=" not in target:
                assert re.search(rf"^{re.escape(target)}:", makefile, re.M), \
                    f"{where}: no make target {target!r}"
        return False
    if prog == "thc":
        if argv[1:] in ([], ["--help"]):
            return True
        name = argv[1]
        assert name in COMMANDS, f"{where}: no thc command {name!r}"
        if name == "bench":
            assert argv[2] in BENCHES, f"{where}: no thc bench {argv[2]!r}"
            _parse(_parser(BENCHES[argv[2]][0]), argv[3:], where)
        else:
            _parse(_parser(COMMANDS[name][0]), argv[2:], where)
        return name == "table" or "--help" in argv
    if prog == "torchrun":
        module = argv[argv.index("-m") + 1]
        _parse(_parser(module), argv[argv.index("-m") + 2:], where)
        return False
    if prog in ("python", "python3") and argv[1] == "-m":
        _parse(_parser(argv[2]), argv[3:], where)
        return False
    assert prog in EXTERNAL, f"{where}: {prog!r} is neither the project's nor in EXTERNAL"
    return False


def shell_commands(text: str) -> list[tuple[list[str], str]]:
    """(argv, README line) of every command in the sh blocks; `&&` splits a line."""
    out = []
    for b in blocks(text):
        if b.lang != "sh":
            continue
        for i, line in enumerate(b.code.splitlines()):
            line = line.split("#", 1)[0].strip()
            for part in filter(None, (p.strip() for p in line.split("&&"))):
                out.append((shlex.split(part), f"README.md:{b.line + i}"))
    return out


def test_shell_examples_parse_and_the_cheap_ones_run():
    makefile = (ROOT / "Makefile").read_text()
    commands = shell_commands(README.read_text())
    assert len(commands) > 10
    ran = 0
    for argv, where in commands:
        if check_command(argv, where, makefile):
            r = subprocess.run([sys.executable, "-m", "thc.cli", *argv[1:]],
                               capture_output=True, text=True, timeout=120, cwd=ROOT)
            assert r.returncode == 0, f"{where}: {shlex.join(argv)}: {r.stderr[-2000:]}"
            ran += 1
    assert ran >= 2


def test_command_table_lists_every_thc_command():
    from thc.cli import BENCHES, COMMANDS
    text = README.read_text()
    rows = re.findall(r"^\| `thc (\w+)` \| (.*) \|$", text, re.M)
    assert [name for name, _ in rows] == list(COMMANDS)
    benches = dict(rows)["bench"]
    assert re.findall(r"`(\w+)`", benches) == list(BENCHES)


@pytest.mark.parametrize("change, error", [
    (lambda t: t.replace("codec.decode(", "codec.undecode("), "undecode"),
    (lambda t: t.replace("<!-- example: ddp -->\n", ""), "no check"),
    (lambda t: t.replace("<!-- example: codec -->", "<!-- example: codec, needs: gpu -->"),
     "unknown label"),
    (lambda t: t.replace("--granularity 30 --p 1/32", "--granularity 30 --q 1/32"), "--q"),
    (lambda t: t.replace("make mininet", "make mininett"), "mininett"),
    (lambda t: t.replace("thc faults", "thc fault"), "'fault'"),
    (lambda t: t.replace("simple_switch_grpc --device-id", "simple_switch --device-id"),
     "EXTERNAL"),
])
def test_the_checks_fail_on_a_broken_readme(change, error):
    """A README whose example no longer runs, or names a flag, target or command that does
    not exist, fails these checks."""
    text = change(README.read_text())
    assert text != README.read_text()
    makefile = (ROOT / "Makefile").read_text()
    with pytest.raises((AssertionError, AttributeError)) as e:
        ns: dict = {}
        for b in python_blocks(text):
            if b.name == "codec":
                run_block(b, ns)
        for argv, where in shell_commands(text):
            check_command(argv, where, makefile)
    assert error in str(e.value)
