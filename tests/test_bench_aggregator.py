"""``thc bench aggregator`` run small: the figures it prints are the README's packet rates,
so each must be what its own counts and sizes say."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from thc.net import fastagg

SERVERS = ("compiled", "python", "compiled_echo", "python_echo")


@pytest.mark.skipif(not fastagg.available(), reason=f"{fastagg.UNAVAILABLE}")
def test_bench_aggregator_figures_are_consistent(tmp_path):
    out = tmp_path / "bench.json"
    workers, chunks = 2, 512
    r = subprocess.run([sys.executable, "-m", "thc.cli", "bench", "aggregator",
                        "--workers", str(workers), "--chunks", str(chunks), "--repeat", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["benchmark"] == "aggregator" and res["lanes"] == 256
    (row,) = res["rows"]
    assert row["workers"] == workers
    for name in SERVERS:
        s = row[name]
        assert (s["workers"], s["chunks"], s["lanes"]) == (workers, chunks, 256)
        # every chunk of every worker arrived at least once; nothing arrived unsent
        assert workers * chunks <= s["packets_in"] <= workers * chunks + s["retransmitted"]
        assert s["seconds"] > 0
        assert s["packets_in_per_s"] == pytest.approx(s["packets_in"] / s["seconds"])
        assert s["coords_per_s"] == pytest.approx(chunks * 256 / s["seconds"])
        # Ethernet + IPv4 + UDP (42) + THC header (28) + 4-bit indices / 8-bit sums
        assert s["packet_bytes_up"] == 42 + 28 + 128 and s["packet_bytes_down"] == 42 + 28 + 256
    rate = {k: row[k]["packets_in_per_s"] for k in SERVERS}
    assert row["ratios"]["compiled_vs_python"] == pytest.approx(rate["compiled"] / rate["python"])
    assert row["ratios"]["python_vs_python_echo"] == pytest.approx(
        rate["python"] / rate["python_echo"])
    for name in SERVERS:
        assert f"{name.replace('_', ' '):>14} {rate[name]:>12,.0f}" in r.stdout


def test_the_real_client_takes_every_servers_answers(tmp_path):
    """``--load python`` plays the workers with AggregationClient, which refuses a reply of
    another configuration's epoch or a sum without its own values: the echoes answered with
    the worker's nonce for an epoch, and every run ended AggregatorMisconfigured."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "thc.cli", "bench", "aggregator", "--load",
                        "python", "--workers", "2", "--chunks", "128", "--repeat", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = json.loads(out.read_text())["rows"]
    for name in SERVERS:
        assert row[name]["packets_in"] >= 2 * 128, (name, row[name])


def test_a_benchmarks_json_says_when_how_and_where_it_was_made(tmp_path):
    """A figure carries its machine, date and command: the reports carried none, so a JSON
    under docs/runs could not be traced to its run."""
    import argparse
    import json

    from thc.bench import emit_json
    out = tmp_path / "r.json"
    emit_json(argparse.Namespace(json=str(out)), {"x": 1})
    rec = json.loads(out.read_text())["recorded"]
    assert rec["utc"].startswith("20") and rec["cores"] >= 1 and rec["command"]
    assert set(rec) >= {"utc", "command", "commit", "cpu", "cores"}
    again = tmp_path / "again.json"   # a report read back and written again keeps its own
    emit_json(argparse.Namespace(json=str(again)), {**json.loads(out.read_text()), "y": 2})
    assert json.loads(again.read_text())["recorded"] == rec
