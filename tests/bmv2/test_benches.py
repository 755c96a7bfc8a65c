"""``thc bench switch`` and ``thc bench install`` run small on BMv2: the figures they print
must agree with their own counts (the README's switch rates come from them)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bmv2.harness import bmv2_available

pytestmark = pytest.mark.skipif(not bmv2_available()[0], reason=f"BMv2 benchmarks skipped: "
                                f"{bmv2_available()[1]}")


def _bench(tmp_path, *argv) -> dict:
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "thc.cli", "bench", *argv, "--json",
                        str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


def test_bench_switch_figures_are_consistent(tmp_path):
    res = _bench(tmp_path, "switch", "--quick", "--duration", "0.4", "--sum-bits", "8",
                 "--workers", "2")
    thc, l2 = res["thc"], res["l2"]
    assert res["thc_by_sum_bits"]["8"] == thc
    assert (thc["workers"], thc["sum_bits"], thc["lanes"]) == (2, 8, 256)
    assert thc["result_payload_bytes"] == 256
    assert thc["frame_bytes"] == l2["frame_bytes"] == 42 + 28 + 128
    for r in (thc, l2):
        # measured over the receiver's window, a rate may exceed the sender's: no bound
        assert r["pps"] > 0 and r["offered_pps"] > 0, r
    assert thc["coords_per_s"] == pytest.approx(thc["pps"] * 256 / thc["workers"])
    assert 0 < thc["completion_ratio"] <= 1.0 and thc["stale_drops"] == 0
    assert res["ratio_to_l2"] == pytest.approx(thc["pps"] / l2["pps"])


def test_bench_install_figures_are_consistent(tmp_path):
    res = _bench(tmp_path, "install", "--workers", "2", "--pool", "16", "--repeat", "1")
    med, runs = res["median_seconds"], res["runs"]
    assert (res["workers"], res["pool"], res["repeat"]) == (2, 16, 1)
    for k in ("install", "reinstall", "remove", "lut_serialized", "lut_messages"):
        assert runs[k] == [med[k]] and med[k] > 0
    assert res["messages_over_serialized"] == pytest.approx(
        med["lut_messages"] / med["lut_serialized"])
