"""The main job end to end on the loopback testbed (short: one epoch, two modes)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_main_job_runs_and_reports(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "host.app.cli", "run", "--loopback", "--epochs", "1",
         "--modes", "fp32,thc", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loopback" in out.stdout + out.stderr, "the fallback must say so"
    report = json.loads((tmp_path / "mainjob.json").read_text())
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == {"fp32", "thc"}
    for r in runs.values():
        assert len(r["history"]) == 1 and 0.0 <= r["final_accuracy"] <= 1.0
        assert r["wire_bytes_sent"] > 0
    # THC moves far fewer bytes than FP32 for the same steps.
    assert runs["fp32"]["wire_bytes_sent"] > 4 * runs["thc"]["wire_bytes_sent"]
    assert (tmp_path / "mainjob.png").stat().st_size > 10_000
    assert "final accuracy" in out.stdout
