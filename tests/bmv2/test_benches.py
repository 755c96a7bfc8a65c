"""``thc bench switch`` and ``thc bench install`` run small on BMv2: the figures they print
must agree with their own counts (the README's switch rates come from them)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def _children(pid: int, name: str) -> list[int]:
    """Processes whose parent is ``pid`` and whose command name starts with ``name``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if int(rest.split()[1]) == pid and comm.split("(", 1)[1].startswith(name):
            found.append(int(stat.parent.name))
    return found


def test_sigterm_ends_a_bench_with_a_line_and_takes_its_switch_down():
    """SIGTERM's default action ended ``thc bench install`` at once, its switch left serving
    (its parent now init, its ports held), its veths up and its folder on disk. A second
    after the switch starts its pipeline is being pushed: a SIGTERM there was told as the
    session failing (status 1), and then, told right, waited for good in a grpc channel's
    finalizer (1 run in 6 or so)."""
    proc = subprocess.Popen([sys.executable, "-m", "thc.cli", "bench", "install", "--workers",
                             "2", "--pool", "16", "--repeat", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end, switch = time.monotonic() + 120, []
        while not switch and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
            switch = _children(proc.pid, "simple_switch")
        assert switch, proc.poll()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and "thc: terminated (SIGTERM)" in err, err
    assert not Path(f"/proc/{switch[0]}").exists()
    assert not Path(f"/sys/class/net/t{proc.pid % 100000}h0").exists()
