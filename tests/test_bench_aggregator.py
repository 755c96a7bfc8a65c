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
                        "--quick", "--json", str(out)],   # the counts given win over --quick's
                       capture_output=True, text=True, timeout=300)
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


@pytest.mark.parametrize("argv,message", [
    (["--quick", "--window", "0"], "argument --window: must be at least 1, not 0"),
    (["--quick", "--window", "-1", "--load", "python"], "argument --window: must be at least 1"),
    (["--chunks", "0", "--repeat", "1"], "argument --chunks: must be at least 1, not 0"),
    (["--repeat", "0"], "argument --repeat: must be at least 1, not 0"),
    (["--repeat", "2"], "argument --repeat: an odd count, so that the median is a run: not 2"),
    (["--workers", "0"], "argument --workers: must be at least 1, not 0"),
    (["--workers", "2,,3"], "argument --workers: not an integer: ''"),
    (["--workers", "33"], "argument --workers: a job takes 1..32 workers, not 33"),
    (["--load-procs", "0"], "argument --load-procs: must be at least 1, not 0")])
def test_counts_that_make_no_bench_are_usage_errors(argv, message, capsys):
    """A window or chunk count of 0 failed in the load processes while the bench waited 300 s
    for them; 0 workers divided by zero, '2,,3' was int()'s ValueError, 0 load processes
    max() of nothing; of 2 runs, the best was reported as their median."""
    from thc import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "aggregator", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_lanes_of_0_are_refused_not_taken_for_the_default(capsys):
    """--lanes 0 ran 256 lanes a packet (``or``), where other commands read 0 as the most
    that fit one MTU."""
    from thc import cli
    assert cli.main(["bench", "aggregator", "--quick", "--lanes", "0"]) == 2
    assert "lanes must be a positive even number, got 0" in capsys.readouterr().err


def test_load_procs_is_refused_where_it_would_be_ignored(capsys):
    """--load python runs one client process a worker: --load-procs was silently dropped."""
    from thc import cli
    assert cli.main(["bench", "aggregator", "--load", "python", "--load-procs", "3"]) == 2
    assert "--load-procs applies to --load compiled" in capsys.readouterr().err


@pytest.mark.skipif(not fastagg.available(), reason=f"{fastagg.UNAVAILABLE}")
def test_load_procs_beyond_a_points_workers_run_one_a_worker(tmp_path):
    """--workers 1,2 --load-procs 2: the 1-worker point runs one process, and says so (a
    count above every point's workers is refused: test_cli)."""
    from thc import cli
    out = tmp_path / "agg.json"
    assert cli.main(["bench", "aggregator", "--quick", "--chunks", "64", "--workers", "1,2",
                     "--load-procs", "2", "--json", str(out)]) == 0
    assert [r["load_procs"] for r in json.loads(out.read_text())["rows"]] == [1, 2]


@pytest.mark.parametrize("load", ["python", pytest.param("compiled", marks=pytest.mark.skipif(
    not fastagg.available(), reason=f"{fastagg.UNAVAILABLE}"))])
def test_a_load_process_that_fails_ends_the_run_at_once_with_its_error(load):
    """The bench waited 300 s on its queue for a result a dead load process would never send,
    then ended in queue.Empty, the child's error only on stderr."""
    import time

    from thc.bench import aggregator as bench
    from thc.wire import protocol as P
    payloads = {w: bench._payload(P.LANES, w, 64) for w in range(2)}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(client of worker \d|load generator 0 \(workers "
                                           r"0,1\)) failed: ValueError: .*(window|bad arg)"):
        bench.run_point("python", 2, 64, P.LANES, 0, load, payloads)   # window 0
    assert time.monotonic() - t0 < 10


def test_a_load_process_that_dies_without_a_word_is_named_with_its_exit_code(monkeypatch):
    import os
    import time

    from thc.bench import aggregator as bench
    from thc.wire import protocol as P

    def dies(*args):
        os._exit(3)
    monkeypatch.setattr(bench, "_client", dies)    # the forked clients run it
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the client of worker \d died with exit code 3"):
        bench.run_point("python", 2, 64, P.LANES, 8, "python", {})
    assert time.monotonic() - t0 < 10


def test_an_aggregator_that_dies_mid_run_is_named_at_once(monkeypatch):
    """The bench went on waiting for its load, then hung for good setting the stop Event its
    dead server had been waiting on (Event.set waits for every waiter to wake)."""
    import os
    import threading
    import time

    from thc.bench import aggregator as bench
    from thc.wire import protocol as P
    serve = bench._serve

    def dies(*args):
        threading.Timer(0.5, os._exit, (9,)).start()
        serve(*args)
    monkeypatch.setattr(bench, "_serve", dies)    # the forked server runs it
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the aggregator under test ended mid-run \(exit "
                                           r"code 9\)"):
        bench.run_point("python", 2, 1 << 20, P.LANES, 8, "python", {})
    assert time.monotonic() - t0 < 10


def test_a_killed_bench_leaves_no_aggregator_serving(tmp_path):
    """Killed (SIGKILL), the bench left its server waiting for a stop that could not come."""
    import os
    import signal
    import time
    pidfile = tmp_path / "server.pid"
    script = (f"import os\nfrom thc.bench import aggregator as bench\n"
              f"from thc.wire import protocol as P\nserve = bench._serve\n"
              f"def mark(*args):\n    open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
              f"    serve(*args)\nbench._serve = mark\n"
              f"bench.run_point('python', 2, 1 << 20, P.LANES, 8, 'python', {{}})\n")
    bench = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        end = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text():
            assert bench.poll() is None and time.monotonic() < end, "no server started"
            time.sleep(0.05)
        time.sleep(1.0)
        server = int(pidfile.read_text())
        bench.kill()
        bench.wait()

        def serving() -> bool:
            try:
                return open(f"/proc/{server}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
            except FileNotFoundError:
                return False
        end = time.monotonic() + 10
        while serving() and time.monotonic() < end:
            time.sleep(0.1)
        assert not serving(), "the server outlived its bench by 10 s"
    finally:
        try:
            os.killpg(bench.pid, signal.SIGKILL)   # its load processes, within their deadline
        except ProcessLookupError:
            pass


def _session_alive(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``."""
    import os
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(pid))
    return alive


@pytest.mark.parametrize("load", ["python", pytest.param("compiled", marks=pytest.mark.skipif(
    not fastagg.available(), reason=f"{fastagg.UNAVAILABLE}"))])
def test_a_bench_killed_before_its_start_leaves_no_load_process(load):
    """Killed before it raised its start flag, the bench left its load processes waiting
    for it for good (busy, once the Event became a polled flag)."""
    import os
    import signal
    import time
    script = ("import os, signal, time, types\nfrom thc.bench import aggregator as bench\n"
              "from thc.wire import protocol as P\nme, real = os.getpid(), time\n"
              "def sleep(s):\n"
              "    if os.getpid() == me and s == 0.3:   # just before the start flag\n"
              "        os.kill(me, signal.SIGKILL)\n"
              "    real.sleep(s)\n"
              "bench.time = types.SimpleNamespace(sleep=sleep, perf_counter=real.perf_counter,"
              " monotonic=real.monotonic)\n"
              f"bench.run_point('python', 2, 1 << 10, P.LANES, 8, {load!r},"
              " {w: bench._payload(P.LANES, w, 1 << 10) for w in range(2)})\n")
    bench = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        assert bench.wait(timeout=60) == -signal.SIGKILL
        end = time.monotonic() + 10
        while _session_alive(bench.pid) and time.monotonic() < end:
            time.sleep(0.1)
        assert not _session_alive(bench.pid), "processes outlived their bench by 10 s"
    finally:
        try:
            os.killpg(bench.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
