"""``thc controller --target T --dry-run install``: prints, without connecting, the writes that
the same install makes on a switch holding no jobs (the in-memory switch records them)."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
from p4.v1 import p4runtime_pb2

from thc.controller import cli, dryrun, jobs, targets
from thc.wire.jobs import Cluster
from tests.test_target_writes import (committed_p4info, recording_switch, sample_cluster,
                                      wide_vote_cluster)

EPOCH = re.compile(r"epoch=0x[0-9a-f]{8}")
ENTRY = re.compile(r"(INSERT|MODIFY|DELETE) (\S+) ((?:\w+=\S+ ?)*)(?:-> (\S+)\((.*)\))?$")


def incomplete(p4info, lines: list[str]) -> list[str]:
    """The printed table entries that miss a key field of their table or, with an action, a
    parameter of the action (all in P4Info order)."""
    keys = {t.preamble.name: [f.name for f in t.match_fields] for t in p4info.tables}
    params = {a.preamble.name: [p.name for p in a.params] for a in p4info.actions}
    out = []
    for line in lines:
        m = ENTRY.match(line)
        ok = m is not None and keys.get(m[2]) == [kv.split("=")[0] for kv in m[3].split()]
        if ok and m[4] is not None:
            got = [kv.split("=")[0] for kv in m[5].split(", ")] if m[5] else []
            ok = params.get(m[4]) == got
        if not ok:
            out.append(line)
    return out


def thc_controller(monkeypatch, *argv: str) -> int:
    def no_switch(*args, **kw):
        raise AssertionError("a dry run connected to a switch")
    monkeypatch.setattr(cli, "Switch", no_switch)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(list(argv)))


def _config(tmp_path, cluster: Cluster) -> str:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster.to_dict()))
    return str(path)


@pytest.mark.parametrize("name", sorted(targets.TARGETS))
def test_dry_run_prints_the_writes_of_the_install(name, monkeypatch, capsys, tmp_path):
    target = targets.get(name)
    full = sample_cluster()
    cluster = Cluster(jobs=(full.job(5),), agg_ip=full.agg_ip, agg_mac=full.agg_mac)
    sw = recording_switch(target)
    jobs.install_cluster(sw, cluster)
    printer = dryrun.DryRunSwitch(target)
    want = Counter(EPOCH.sub("epoch=E", f"{op} {printer.describe(entity)}") for op, entity in
                   ((op, p4runtime_pb2.Entity.FromString(b)) for op, b in sw.writes))

    assert thc_controller(monkeypatch, "--target", name, "--dry-run", "install",
                          "--config", _config(tmp_path, cluster)) == 0
    lines = capsys.readouterr().out.splitlines()
    writes = [line for line in lines if line.split(" ", 1)[0] in ("INSERT", "MODIFY", "DELETE")]
    entries = [line for line in writes if "multicast group" not in line]
    assert Counter(EPOCH.sub("epoch=E", line) for line in entries) == want
    p4info = committed_p4info(target)
    tables = [line for line in entries if not line.startswith("MODIFY counter")]
    assert incomplete(p4info, tables) == []
    groups = [line for line in writes if "multicast group" in line]
    assert groups == [f"INSERT multicast group {j.mcast_grp}: " + " ".join(
        f"(port {w.switch_port}, instance {w.id + 1})" for w in sorted(
            j.workers, key=lambda w: (w.switch_port, w.id))) for j in cluster.jobs]
    resets = [line for line in lines if line.startswith("PACKET_OUT")]
    assert resets == [f"PACKET_OUT {2 * j.pool_size} RESET frames to the CPU port: job "
                      f"{j.job_id}, slots 0..{j.pool_size - 1}, versions [0, 1]"
                      for j in cluster.jobs]
    assert lines[-1] == f"dry run: {len(writes) + len(resets)} writes to a {name} switch " \
                        f"(256 lanes)"


def test_dry_run_refuses_what_the_target_cannot_run(monkeypatch, capsys, tmp_path):
    recording_switch(targets.get("tofino"))
    config = _config(tmp_path, wide_vote_cluster())
    assert thc_controller(monkeypatch, "--target", "tofino", "--dry-run", "install",
                          "--config", config) == 1
    out = capsys.readouterr()
    assert out.out == "" and "vote job with 16-bit sums" in out.err and "BMv2" in out.err


def test_dry_run_is_for_install_only(monkeypatch, capsys):
    assert thc_controller(monkeypatch, "--dry-run", "remove", "--job", "5") == 2
    assert "--dry-run" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["push", "remove", "jobs", "counters", "l2"])
def test_only_installs_help_offers_dry_run(action, capsys):
    """Every action's own copy of the switch options offered --dry-run, which only install
    takes: the others' help listed it and refused it when given."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for name, offered in ((action, False), ("install", True)):
        with pytest.raises(SystemExit):
            parser.parse_args([name, "--help"])
        assert ("--dry-run" in capsys.readouterr().out) == offered


def test_values_print_as_their_fields_are_written():
    assert dryrun.show("dst_mac", 48, bytes([2, 0, 0, 0, 0, 0xFE])) == "02:00:00:00:00:fe"
    assert dryrun.show("src_ip", 32, bytes([10, 0, 0, 1])) == "10.0.0.1"
    assert dryrun.show("value", 16, b"\x1e\x02") == "0x1e02"
    assert dryrun.show("pool_size", 16, b"\x10") == "16"


def test_a_reader_gone_ends_a_dry_run_as_any_command(tmp_path):
    """``thc controller --dry-run install ... | head -1`` said "thc controller: [Errno 32]
    Broken pipe" and exited 1: its own error handling took the pipe's for the switch's."""
    full = sample_cluster()
    config = _config(tmp_path, Cluster(jobs=(full.job(5),), agg_ip=full.agg_ip,
                                       agg_mac=full.agg_mac))
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "thc.cli", "controller", "--target", "bmv2",
                               "--dry-run", "install", "--config", config], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")
