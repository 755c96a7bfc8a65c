"""The emulation testbed: loopback always, Mininet when root and Mininet are available."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from thc.wire import protocol as P
from thc.emu import cleanup
from thc.emu.smoke_worker import digest, reference_sums
from thc.emu.testbed import (
    LoopbackTestbed,
    TestbedError,
    WorkerError,
    bmv2_unavailable_reason,
    mininet_unavailable_reason,
    open_testbed,
)

ROOT = Path(__file__).resolve().parents[1]
MININET_REASON = mininet_unavailable_reason()
needs_mininet = pytest.mark.skipif(MININET_REASON is not None,
                                   reason=f"Mininet testbed unavailable: {MININET_REASON}")


def test_loss_through_bmv2_without_netem_or_nftables_is_refused(monkeypatch):
    """The fallback for a kernel without netem drops at every host's ingress as two links
    in series; through BMv2 a worker's packets up would meet no loss and its results twice
    it, so each worker link loses at its egress too, by an nftables rule, which needs
    ``nft``."""
    from thc.emu import emulation, links
    monkeypatch.setattr(links, "plan", lambda bw, delay, loss: {
        "link": {}, "iptables_loss": links.path_loss(loss), "notes": []})
    monkeypatch.setattr(links.shutil, "which", lambda name: None if name == "nft" else name)
    with pytest.raises(TestbedError, match="loss through BMv2 without netem needs nftables"):
        emulation.MininetTestbed(2, loss_pct=1.0, aggregator="bmv2")


def smoke(tb, numel=1 << 16, seed=5):
    """Run the smoke all-reduce on ``tb``; return (worker JSON rows, reference digest)."""
    tb.start_aggregator()
    agg = ["--agg", f"{tb.agg_addr[0]}:{tb.agg_addr[1]}"] if tb.agg_addr else []
    results = tb.run_workers(
        lambda r: ["python", "-m", "thc.emu.smoke_worker", "--rank", str(r), "--config",
                   str(tb.cluster_path), "--numel", str(numel), "--seed",
                   str(seed)] + agg, timeout=60)
    rows = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    job = tb.job
    for row in rows:   # each worker ran its round: every chunk answered
        assert row["rounds"] == 1 and row["mismatches"] == 0, row
        assert row["stats"]["received"] >= -(-numel // job.lanes), row
    return rows, digest(reference_sums(job.table, job.n_workers, seed, numel))


# -- loopback ----------------------------------------------------------------------------------

def test_loopback_testbed_describes_itself_and_its_cluster(capsys, monkeypatch):
    import thc.emu.base
    monkeypatch.setattr(thc.emu.base, "_said", set())  # said once per process: say it here
    with open_testbed(3, bw_mbit=100, prefer_mininet=False) as tb:
        assert tb.kind == "loopback" and tb.n_workers == 3
        job = tb.cluster.jobs[0]
        assert job.job_id == 1 and [w.id for w in job.workers] == [0, 1, 2]
        assert len({w.port for w in job.workers}) == 3
        assert all(w.ip == "127.0.0.1" for w in job.workers)
        assert tb.agg_addr == (tb.cluster.agg_ip, tb.cluster.agg_port)
        assert tb.master_addr[0] == "127.0.0.1"
        assert tb.wire_bytes() == {}
        logdir = tb.logdir
        assert logdir.exists()
    assert not logdir.exists()
    err = capsys.readouterr().err
    assert "loopback" in err and "NOT emulated" in err


@pytest.mark.parametrize("aggregator", ["software", "sharded"])
def test_loopback_smoke_allreduce_is_bit_exact(aggregator):
    with open_testbed(3, aggregator=aggregator, prefer_mininet=False) as tb:
        rows, ref = smoke(tb)
        counters = tb.stop_aggregator()
    assert [r["sha256"] for r in rows] == [ref] * 3
    assert all(r["mismatches"] == 0 for r in rows)
    assert counters["jobs"]["1"]["completions"] >= (1 << 16) // 256
    if aggregator == "sharded":  # every shard aggregated its third, nothing misrouted
        shards = counters["shards"]
        assert len(shards) == 3 and all(s["jobs"]["1"]["completions"] > 0 for s in shards)
        assert counters["drops"]["wrong_shard"] == 0


def test_workers_get_the_venv_python_one_thread_and_the_repo_on_the_path():
    code = ("import json, os, sys; print(json.dumps([sys.executable, os.environ['OMP_NUM_THREADS'],"
            " os.environ['PYTHONPATH'], os.environ['GLOO_SOCKET_IFNAME'], os.environ['X']]))")
    with LoopbackTestbed(2, aggregator="none") as tb:
        assert tb.agg_addr is None
        with pytest.raises(TestbedError):
            tb.start_aggregator()
        res = tb.run_workers(lambda r: ["python", "-c", code], env={"X": "1"}, timeout=30)
    for r in res:
        exe, threads, path, ifname, x = json.loads(r.stdout)
        assert exe == sys.executable and threads == "1" and x == "1" and ifname == "lo"
        assert str(ROOT) in path.split(":")


def test_workers_read_a_relative_fashion_mnist_folder_from_the_callers_folder(
        monkeypatch, tmp_path):
    """``THC_FASHION_MNIST=fm``, checked from the caller's folder: the workers start in the
    repository's root, read ``fm`` from there, and every mode failed (or trained from another
    folder of that name)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("THC_FASHION_MNIST", "fm")
    code = "import os; print(os.environ['THC_FASHION_MNIST'])"
    with LoopbackTestbed(1, aggregator="none") as tb:
        res = tb.run_workers(lambda r: ["python", "-c", code], timeout=30)
    assert res[0].stdout.strip() == str(tmp_path / "fm")


def test_a_ctrl_c_during_loopback_teardown_lets_it_finish(monkeypatch):
    """A second Ctrl-C while the loopback testbed tore down cut it short and left its folder
    of cluster file and logs: held, it is raised once the teardown is done."""
    tb = LoopbackTestbed(2, aggregator="none")
    kill = tb._kill_procs

    def interrupted():
        kill()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)   # delivered here, in the middle of the teardown
    monkeypatch.setattr(tb, "_kill_procs", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tb.close()
    assert not Path(tb.logdir).exists()


def test_a_state_folder_that_cannot_be_made_names_its_variable(monkeypatch, tmp_path):
    """It ended in a FileExistsError traceback naming only the path."""
    a_file = tmp_path / "f"
    a_file.write_text("")
    monkeypatch.setenv("THCNET_STATE_DIR", str(a_file))
    with pytest.raises(TestbedError, match=rf"state folder {a_file} \(THCNET_STATE_DIR\) "
                                           rf"cannot be made: File exists"):
        cleanup.state_dir()


def test_each_launch_of_workers_is_one_new_run():
    """All workers of one launch share THC_RUN; the next launch gets a newer one."""
    code = "import os; print(os.environ['THC_RUN'])"
    with LoopbackTestbed(3, aggregator="none") as tb:
        runs = [{int(r.stdout) for r in tb.run_workers(lambda r: ["python", "-c", code],
                                                        timeout=30)} for _ in range(3)]
    assert all(len(r) == 1 for r in runs)
    a, b, c = (r.pop() for r in runs)
    assert P.seq_newer(b, a) and P.seq_newer(c, b)


def test_a_failing_worker_raises_with_its_stderr_and_the_others_are_killed():
    def argv(r):
        if r == 0:
            return ["python", "-c", "import sys; sys.exit('worker zero broke on purpose')"]
        return ["python", "-c", "import time; time.sleep(60)"]
    t0 = time.monotonic()
    with LoopbackTestbed(3, aggregator="none") as tb:
        with pytest.raises(WorkerError) as e:
            tb.run_workers(argv, timeout=30)
    assert time.monotonic() - t0 < 20
    assert "worker zero broke on purpose" in str(e.value)
    codes = [r.returncode for r in e.value.results]
    assert codes[0] == 1 and all(c != 0 for c in codes[1:])


def test_a_timeout_kills_the_workers():
    with LoopbackTestbed(2, aggregator="none") as tb:
        with pytest.raises(WorkerError, match="timed out"):
            tb.run_workers(lambda r: ["python", "-c", "import time; time.sleep(60)"], timeout=1)


def test_a_timeout_names_a_stopped_worker_and_says_it_timed_out():
    """A worker stopped by SIGSTOP and one blocked on it read alike: "timed out", no more."""
    argv = lambda r: ["python", "-c", "import os, signal, time\n"  # noqa: E731
                      + ("os.kill(os.getpid(), signal.SIGSTOP)" if r else "time.sleep(60)")]
    with LoopbackTestbed(2, aggregator="none") as tb:
        with pytest.raises(WorkerError) as e:
            tb.run_workers(argv, timeout=3)
    assert e.value.timed_out
    assert re.search(r"worker 1 \(\S+\) still stopped \(SIGSTOP\?\) at the timeout", str(e.value))
    assert re.search(r"worker 0 \(\S+\) still sleeping at the timeout", str(e.value))


def test_an_aggregator_that_exits_ends_the_workers_wait_naming_it():
    """The workers of a dead aggregator waited out their own deadline, or the mode's limit,
    and the aggregator's exit was read only after that, if at all."""
    with LoopbackTestbed(2, aggregator="software") as tb:
        tb.start_aggregator()
        tb.agg_proc.kill(grace=0)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="the aggregator exited with code -9") as e:
            tb.run_workers(lambda r: ["python", "-c", "import time; time.sleep(60)"],
                           timeout=50)
    assert time.monotonic() - t0 < 15 and not e.value.timed_out
    assert re.search(r"worker 0 \(\S+\) still sleeping 3 s after a failure, not failing on "
                     r"its own, killed", str(e.value)), str(e.value)


def test_the_stderr_tail_keeps_the_error_under_torchs_frames():
    from thc.emu.procs import tail
    err = "\n".join(["Traceback (most recent call last):", '  File "x.py", line 3, in f',
                     "thc.net.outcomes.AggregationTimeout: job 1, worker 0: chunk seq 4212 not "
                     "aggregated within 30.0s; missing worker(s) [1]", "At:"]
                    + [f"[rank0]:   /usr/lib/python3.11/threading.py({n}): run"
                       for n in range(40)] + ["Exception in thread X:", "last words"])
    shown = tail(err, 5)
    assert "missing worker(s) [1]" in shown and "threading.py" not in shown
    assert shown.splitlines()[-1].strip() == "last words"


def test_sigterm_tears_the_loopback_testbed_down_too():
    """Its workers and aggregators run in sessions of their own: after a SIGTERM of the
    orchestrator they ran on, and its log directory stayed."""
    code = textwrap.dedent("""
        from thc.emu.testbed import LoopbackTestbed
        with LoopbackTestbed(2, aggregator="software") as tb:
            tb.start_aggregator()
            procs = tb.start_workers(lambda r: ["python", "-c", "import time; time.sleep(60)"])
            print(tb.logdir, *[p.pid for p in procs], tb.agg_proc.pid, flush=True)
            import time
            time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         cwd=ROOT)
    logdir, *pids = p.stdout.readline().split()
    p.terminate()
    # each process is given up to 10 s to go (procs.Proc.kill): three of them, and a margin
    assert p.wait(timeout=60) == 128 + 15
    time.sleep(0.5)
    alive = [pid for pid in map(int, pids) if os.path.exists(f"/proc/{pid}")
             and " Z " not in open(f"/proc/{pid}/stat").read()]
    assert alive == [] and not Path(logdir).exists()


def test_a_loopback_testbed_that_fails_to_build_leaves_the_signal_handlers(tmp_path, monkeypatch):
    """... and no log directory (each such failure left an empty one in /tmp)."""
    import signal
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = signal.getsignal(signal.SIGTERM)
    for pool_size in (10 ** 9, -5):
        with pytest.raises(TestbedError):
            LoopbackTestbed(2, aggregator="software", pool_size=pool_size)
    assert signal.getsignal(signal.SIGTERM) is before
    assert list(tmp_path.iterdir()) == []


@needs_mininet
def test_a_mininet_testbed_refused_for_its_links_leaves_no_log_directory(tmp_path, monkeypatch):
    import tempfile

    from thc.emu.emulation import MininetTestbed
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(TestbedError, match="priority queueing needs a bandwidth limit"):
        MininetTestbed(2, bw_mbit=None, priorities=True)
    # the aggregator's link is held to --bw's limit too: 1000 x 2880 Mbit/s reached tc
    with pytest.raises(TestbedError, match=re.escape(
            "the aggregator's link (1000 Mbit/s x 2880) must lie in [0.1, 100000] Mbit/s")):
        MininetTestbed(4, bw_mbit=1000, agg_bw_factor=2880.0)
    assert list(tmp_path.iterdir()) == []


def test_bmv2_and_bad_arguments_are_refused_clearly():
    with pytest.raises(TestbedError, match="bmv2"):
        open_testbed(2, aggregator="bmv2", prefer_mininet=False)
    with pytest.raises(TestbedError, match="aggregator"):
        open_testbed(2, aggregator="tofino", prefer_mininet=False)
    with pytest.raises(TestbedError, match="n_workers"):
        open_testbed(0, prefer_mininet=False)


def test_a_testbed_job_becomes_a_vote_job_before_the_aggregator_starts():
    """Marsit's vote modes: the same workers and pool, sign bits in whole bytes."""
    with open_testbed(2, aggregator="software", prefer_mininet=False, lanes=0) as tb:
        summing = tb.job
        vote = tb.use_vote_job()
        assert tb.job == vote and vote.aggregation == "vote" and vote.lanes % 8 == 0
        assert (vote.workers, vote.pool_size, vote.job_id) == (summing.workers,
                                                               summing.pool_size,
                                                               summing.job_id)
        assert json.loads(tb.cluster_path.read_text())["jobs"][0]["aggregation"] == "vote"
        with pytest.raises(TestbedError, match="already written"):
            tb.use_vote_job()


# -- Mininet -----------------------------------------------------------------------------------

@needs_mininet
def test_topology_ping_and_udp_between_a_worker_and_the_aggregator_host():
    with open_testbed(2, bw_mbit=100, aggregator="software") as tb:
        assert tb.kind == "mininet"
        assert tb.agg_addr == ("10.0.0.100", tb.cluster.agg_port)
        assert tb.master_addr == ("10.0.0.1", 29500)
        job = tb.job
        assert [(w.ip, w.port, w.switch_port) for w in job.workers] == \
            [("10.0.0.1", 50000, 1), ("10.0.0.2", 50001, 2)]
        r = tb.run(0, ["ping", "-c", "2", "-i", "0.2", "-W", "2", "10.0.0.100"], timeout=20)
        assert "2 received" in r.stdout
        # a UDP echo on the aggregator host, a client on worker 1
        server = tb.popen("agg", ["python", "-c", textwrap.dedent("""
            import socket
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("10.0.0.100", 40000))
            print("ready", flush=True)
            data, addr = s.recvfrom(2048)
            s.sendto(data.upper(), addr)
        """)])
        deadline = time.monotonic() + 20
        while "ready" not in server.stdout() and time.monotonic() < deadline:
            time.sleep(0.05)
        r = tb.run(1, ["python", "-c", textwrap.dedent("""
            import socket
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("10.0.0.2", 0)); s.settimeout(5)
            s.sendto(b"thc", ("10.0.0.100", 40000))
            print(s.recvfrom(2048)[0].decode())
        """)], timeout=20)
        assert r.stdout.strip() == "THC"
        tx, rx = tb.wire_bytes()[1]
        assert tx > 0 and rx > 0


@needs_mininet
def test_link_bandwidth_cap_is_roughly_honoured():
    mbit, nbytes = 20, 4_000_000
    sender = textwrap.dedent(f"""
        import socket, time
        s = socket.create_connection(("10.0.0.2", 40001), timeout=30)
        buf = bytes(65536); left = {nbytes}
        t0 = time.perf_counter()
        while left > 0:
            left -= s.send(buf[:min(left, len(buf))])
        s.shutdown(socket.SHUT_WR); s.recv(1)
        print(time.perf_counter() - t0)
    """)
    receiver = textwrap.dedent("""
        import socket
        srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("10.0.0.2", 40001)); srv.listen(1); print("ready", flush=True)
        c, _ = srv.accept()
        while c.recv(1 << 16):
            pass
        c.send(b"k")
    """)
    # Two workers and no aggregator: the FP32 baselines' layout, TCP with TSO on the veths.
    with open_testbed(2, bw_mbit=mbit, aggregator="none") as tb:
        server = tb.popen(1, ["python", "-c", receiver])
        deadline = time.monotonic() + 20
        while "ready" not in server.stdout() and time.monotonic() < deadline:
            time.sleep(0.05)
        seconds = float(tb.run(0, ["python", "-c", sender], timeout=60).stdout)
        (tx, _), (_, rx) = tb.wire_bytes()[0], tb.wire_bytes()[1]
    expected = nbytes * 8 / (mbit * 1e6)  # 1.6 s
    # the shaper holds the rate (a busy host only makes the transfer slower)
    assert seconds > 0.7 * expected, (seconds, expected)
    # Shaped links are counted at the shapers: every 1448-byte TCP segment with its 66 bytes
    # of headers, where the veth counts a 64 KB TSO skb with one (4.5 % against 0.1 %).
    assert nbytes * 1.03 < tx < nbytes * 1.08, tx / nbytes
    assert nbytes * 1.03 < rx < nbytes * 1.08, rx / nbytes


@needs_mininet
def test_cleanup_leaves_nothing_behind_after_an_exception():
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with open_testbed(2, bw_mbit=50) as tb:
            name = tb.switch_name
            pids = [p for p, _, _ in tb.registry.pids]
            state_file = tb.registry.path
            assert any(n.startswith(name) for n in cleanup.leftovers())
            tb.popen(0, ["python", "-c", "import time; time.sleep(60)"])
            raise Boom
    assert not [n for n in cleanup.root_interfaces() if n.startswith(name)]
    assert not state_file.exists()
    _all_end(pids)


def _all_end(pids: list[int]) -> None:
    """Every process of ``pids`` ends (or is a zombie) within 10 s."""
    def alive():
        return [p for p in pids if cleanup.start_time(p) is not None
                and not cleanup._is_zombie(p)]
    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()


@pytest.mark.parametrize("stopped", [False, True])
def test_a_loopback_testbed_killed_takes_its_aggregators_with_it(stopped):
    """Killed with SIGKILL (no handler runs), a loopback testbed left its aggregator
    shards serving for good: they are started to end with it, stopped ones (SIGSTOP, which
    a SIGTERM does not end) included."""
    code = textwrap.dedent(f"""
        import os, signal
        from thc.emu.testbed import LoopbackTestbed
        tb = LoopbackTestbed(2, aggregator="sharded")
        tb.start_aggregator()
        pids = [p.pid for _, p in tb._aggregator_procs()]
        print(tb.logdir, *pids, flush=True)
        for pid in pids if {stopped} else []:
            os.kill(pid, signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == -9, r.stderr
    logdir, *pids = r.stdout.split()
    assert len(pids) == 2
    _all_end([int(p) for p in pids])
    shutil.rmtree(logdir)   # its logs outlive a killed testbed, for its user to read


@needs_mininet
def test_the_next_start_cleans_up_after_a_crashed_run():
    """Killed with SIGKILL, a Mininet testbed left its aggregator serving (a session of its
    own, in host agg's namespace) until the next start reaped it: it now ends with its
    owner, as a loopback testbed's do. The bridge stays until the next start."""
    code = textwrap.dedent("""
        import os, signal
        from thc.emu.testbed import open_testbed
        tb = open_testbed(2, bw_mbit=10)
        tb.start_aggregator()
        print(tb.switch_name, tb.registry.path, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == -9, r.stderr
    name, state_file = r.stdout.split()
    state = json.loads(Path(state_file).read_text())
    def alive():
        return [p for p, st, _ in state["pids"] if cleanup.same_process(p, st)
                and not cleanup._is_zombie(p)]
    deadline = time.monotonic() + 10   # the shells and the aggregator end with their owner
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()
    assert name in cleanup.root_interfaces()
    with open_testbed(1) as tb:   # the next start reaps the crashed one
        assert tb.kind == "mininet"

    def ports():
        return [n for n in cleanup.root_interfaces() if n == name or n.startswith(name + "-")]
    # a switch port whose peer sat in a killed host's namespace goes when the kernel's
    # namespace cleanup runs, which is deferred work: slow on a loaded machine
    deadline = time.monotonic() + 10
    while ports() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ports()
    assert not Path(state_file).exists()
    assert not alive()


@needs_mininet
def test_sigterm_tears_the_testbed_down():
    code = textwrap.dedent("""
        import time
        from thc.emu.testbed import open_testbed
        with open_testbed(2) as tb:
            print(tb.switch_name, flush=True)
            time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         cwd=ROOT)
    name = p.stdout.readline().strip()
    assert name
    p.terminate()
    assert p.wait(timeout=30) != 0
    assert not [n for n in cleanup.root_interfaces() if n == name or n.startswith(name + "-")]


@needs_mininet
def test_loss_is_emulated_and_delay_is_refused_or_emulated():
    from thc.emu.links import netem_available
    with open_testbed(1, loss_pct=10) as tb:
        # The receiver counts datagrams until an end marker (sent 50 times: one gets through)
        # with room for all of them queued, so a slow receiver loses none of its own.
        rx = textwrap.dedent("""
            import socket
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE (root)
            s.bind(("10.0.0.100", 40002)); s.settimeout(60); print("ready", flush=True)
            n = 0
            while s.recv(100) != b"end":
                n += 1
            print(n)
        """)
        server = tb.popen("agg", ["python", "-c", rx])
        deadline = time.monotonic() + 20
        while "ready" not in server.stdout():
            assert time.monotonic() < deadline and server.poll() is None, server.stderr()
            time.sleep(0.05)
        tb.run(0, ["python", "-c", "import socket, time\n"
                   "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                   "for i in range(4000):\n"
                   "    s.sendto(b'x' * 64, ('10.0.0.100', 40002))\n"
                   "    if i % 100 == 0: time.sleep(0.001)\n"
                   "for i in range(50):\n"
                   "    s.sendto(b'end', ('10.0.0.100', 40002)); time.sleep(0.001)\n"],
               timeout=30)
        server.popen.wait(timeout=60)
        got = int(server.stdout().split()[-1])
    # two lossy links in series: 1 - 0.9^2 = 19% lost
    assert 0.73 * 4000 < got < 0.89 * 4000, got
    if netem_available()[0]:
        with open_testbed(1, delay_ms=5) as tb:
            r = tb.run(0, ["ping", "-c", "3", "-i", "0.2", "10.0.0.100"], timeout=20)
            rtts = [float(t) for t in re.findall(r"time=([0-9.]+) ms", r.stdout)]
            # 4 x 5 ms each way and back; a busy host only adds to it
            assert rtts and min(rtts) >= 19.5, r.stdout
    else:
        with pytest.raises(TestbedError, match="netem"):
            open_testbed(1, delay_ms=5)


@needs_mininet
@pytest.mark.slow
@pytest.mark.parametrize("aggregator", ["software", "sharded"])
def test_smoke_allreduce_through_the_software_aggregator_is_bit_exact_in_mininet(aggregator):
    with open_testbed(4, bw_mbit=100, aggregator=aggregator) as tb:
        before = tb.wire_bytes()
        rows, ref = smoke(tb, numel=1 << 20)
        after = tb.wire_bytes()
    assert [r["sha256"] for r in rows] == [ref] * 4
    # 4096 chunks of 128 index bytes up, 256 sum bytes down, plus headers
    up, down = 4096 * (128 + 62), 4096 * (256 + 62)
    if aggregator == "sharded":
        # 3/4 of the chunks go to remote shards, and the host's shard sends 3/4 of its sums
        # to remote workers: the same bytes each way, none for the host's own chunks
        up = down = 3 / 4 * (up + down)
    for r in range(4):
        tx = after[r][0] - before[r][0]
        rx = after[r][1] - before[r][1]
        assert up <= tx < 1.5 * up
        assert down <= rx < 1.5 * down


@needs_mininet
@pytest.mark.slow
def test_make_mininet_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "thc.emu.run", "--workers", "2", "--bw", "200",
                        "--numel", str(1 << 18)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit-exact" in r.stdout and "smoke all-reduce OK" in r.stdout


@needs_mininet
def test_bmv2_mode_is_offered_only_when_the_toolchain_is_there(monkeypatch):
    """Refused before any host starts, naming what is missing; where BMv2 is installed, as
    if it were not (the mode itself: test_smoke_allreduce_through_bmv2)."""
    from thc.emu import emulation
    why = bmv2_unavailable_reason() or "simple_switch_grpc is not on PATH"
    monkeypatch.setattr(emulation, "bmv2_unavailable_reason", lambda: why)
    with pytest.raises(TestbedError,
                       match=re.escape(f"the bmv2 aggregator is not available: {why}")):
        open_testbed(2, aggregator="bmv2")


@needs_mininet
@pytest.mark.slow
@pytest.mark.bmv2
def test_smoke_allreduce_through_bmv2_is_bit_exact():
    why = bmv2_unavailable_reason()
    if why:
        pytest.skip(f"BMv2 not available: {why}")
    with open_testbed(3, bw_mbit=100, aggregator="bmv2") as tb:
        rows, ref = smoke(tb, numel=1 << 14)
    assert [r["sha256"] for r in rows] == [ref] * 3


@needs_mininet
@pytest.mark.slow
@pytest.mark.bmv2
def test_a_lossy_testbed_through_bmv2_loses_on_the_worker_links_and_sums_exactly():
    """Loss through BMv2 was refused on a kernel without netem; each worker link now loses
    it each way (or netem does), and the workers' retransmissions still sum exactly."""
    from thc.emu.links import netem_available
    if why := bmv2_unavailable_reason():
        pytest.skip(f"BMv2 not available: {why}")
    with open_testbed(2, bw_mbit=100, loss_pct=10, aggregator="bmv2") as tb:
        rows, ref = smoke(tb, numel=1 << 14)
        dropped = None if netem_available()[0] else tb.worker_link_drops()
    assert [r["sha256"] for r in rows] == [ref] * 2
    assert dropped is None or dropped > 0, "no packet was lost on the worker links"


@needs_mininet
def test_a_host_whose_shell_died_is_named_instead_of_holding_the_run():
    """Reading a link's shaper through a host whose shell was killed (`mn -c` elsewhere
    kills every Mininet shell) must not wait on that shell for good: it raises, naming the
    host, and the testbed still tears down."""
    with open_testbed(2, bw_mbit=100, aggregator="none") as tb:
        name, pids = tb.switch_name, [p for p, _, _ in tb.registry.pids]
        shell = tb.host(1).shell
        shell.kill()
        shell.wait(timeout=10)
        start = time.monotonic()
        with pytest.raises(TestbedError, match=f"the shell of Mininet node "
                                               f"{tb.host(1).name} has exited"):
            tb.wire_bytes()
        assert time.monotonic() - start < 5
    assert not [n for n in cleanup.root_interfaces() if n.startswith(name)]
    _all_end(pids)


@needs_mininet
@pytest.mark.parametrize("trouble", [signal.SIGSTOP, signal.SIGKILL])
def test_a_shell_stopped_or_killed_while_the_testbed_is_built_fails_the_build(monkeypatch,
                                                                             trouble):
    """Mininet's build reads every node's shell with no deadline: a shell killed under it
    (`mn -c` run by another user) or stopped left `thc run` printing nothing, for good. The
    build is watched: the shell is named, and nothing is left behind."""
    from mininet.net import Mininet
    add_link = Mininet.addLink
    hit = []

    def add_link_troubled(net, node1, node2, **kw):
        if not hit:
            hit.append(node1.shell.pid)
            os.kill(node1.shell.pid, trouble)
        return add_link(net, node1, node2, **kw)
    monkeypatch.setattr(Mininet, "addLink", add_link_troubled)
    before = set(cleanup.root_interfaces())
    t0 = time.monotonic()
    with pytest.raises(TestbedError, match=r"building the Mininet testbed: the shell of "
                                           r"Mininet node h1 (is stopped|exited)"):
        open_testbed(2, bw_mbit=100, aggregator="none")
    assert hit and time.monotonic() - t0 < 30
    deadline = time.monotonic() + 10
    while set(cleanup.root_interfaces()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(cleanup.root_interfaces()) - before


@needs_mininet
@pytest.mark.parametrize("continued", [True, False])
def test_a_stopped_shell_does_not_hold_the_teardown(monkeypatch, continued):
    """Mininet's stop reads every node's shell with no deadline, and the teardown holds
    Ctrl-C: a SIGSTOPped shell held it for good. Stopped shells are continued; a shell that
    does not answer all the same is killed after STOP_S."""
    from thc.emu import emulation, procs, shellwatch
    if not continued:
        monkeypatch.setattr(emulation, "STOP_S", 2.0)
        monkeypatch.setattr(shellwatch, "state", lambda pid: "sleeping")
    with open_testbed(2, bw_mbit=100, aggregator="none") as tb:
        name, pids = tb.switch_name, [p for p, _, _ in tb.registry.pids]
        os.kill(tb.host(1).shell.pid, signal.SIGSTOP)
        while not procs.state(tb.host(1).shell.pid).startswith("stopped"):
            time.sleep(0.01)
        start = time.monotonic()
    assert time.monotonic() - start < 30
    assert not [n for n in cleanup.root_interfaces() if n.startswith(name)]
    _all_end(pids)


@needs_mininet
@pytest.mark.bmv2
def test_a_bmv2_switch_that_exits_ends_the_workers_wait_naming_it():
    """The workers of a dead switch waited out their deadline and were told of no answer
    from the aggregator's address, as if packets were lost; the switch's exit is named."""
    if why := bmv2_unavailable_reason():
        pytest.skip(f"BMv2 not available: {why}")
    with open_testbed(2, aggregator="bmv2") as tb:
        tb.start_aggregator()
        os.killpg(tb.switch.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"the BMv2 switch \(simple_switch_grpc\) exited "
                                              r"with code -9") as e:
            tb.run_workers(lambda r: ["python", "-c", "import time; time.sleep(60)"],
                           timeout=50)
    assert time.monotonic() - t0 < 15 and not e.value.timed_out


@needs_mininet
def test_workers_are_not_started_before_the_switch_forwards():
    """A BMv2 switch forwards nothing before its program is pushed: `thc bench allreduce`
    ran its FP32 baseline there and the workers waited for their rendezvous until the
    30-minute limit."""
    if why := bmv2_unavailable_reason():
        pytest.skip(f"BMv2 not available: {why}")
    with open_testbed(2, aggregator="bmv2") as tb:
        with pytest.raises(TestbedError, match="BMv2 switch has no program yet"):
            tb.run_workers(lambda r: ["true"], timeout=30)
        tb.start_aggregator()
        assert [r.returncode for r in tb.run_workers(lambda r: ["true"], timeout=30)] == [0, 0]


@needs_mininet
def test_a_shell_line_past_its_deadline_in_a_node_ends_with_its_forks():
    from thc.emu.nodeshell import node_run
    with open_testbed(1, aggregator="none") as tb:
        start = time.monotonic()
        with pytest.raises(TestbedError, match="did not end within 1 s"):
            node_run(tb.host(0), "sleep 20; echo done", timeout=1)
        assert time.monotonic() - start < 5
        assert node_run(tb.host(0), "echo a; echo b") == "a\nb\n"


@pytest.mark.parametrize("value,kept", [("", False), ("0", False), ("1", True), ("yes", True)])
def test_thcnet_keep_logs_0_removes_them(monkeypatch, tmp_path, value, kept):
    """Any value kept the logs, 0 included."""
    from thc.emu.base import Testbed
    logdir = tmp_path / "logs"
    logdir.mkdir()
    tb = Testbed.__new__(Testbed)
    tb.logdir = logdir
    monkeypatch.setenv("THCNET_KEEP_LOGS", value)
    tb._remove_logdir()
    assert logdir.exists() == kept


def test_a_ctrl_c_while_the_build_watch_reaps_stays_a_ctrl_c():
    """A Ctrl-C landing while the watch reaped the shells it killed was turned into its
    TestbedError (the run went on to its next mode), or, once it had unwound the body, the
    watch's late SIGUSR2 met the default handler and killed the process before any
    cleanup."""
    import threading

    from thc.emu import shellwatch

    class Shell:   # exited, slow to reap
        pid = os.getpid()

        def poll(self):
            return 0

        def kill(self):
            pass

        def wait(self, timeout=None):
            time.sleep(1.5)

    class Node:
        name, shell = "h1", Shell()
    # Ctrl-C's own handler: a pytest-xdist worker ignores SIGINT
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for at, body in ((0.7, 5.0), (0.9, 0.8)):
            timer = threading.Timer(at, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                try:
                    with shellwatch.watched(lambda: [Node()], "building", 180):
                        time.sleep(body)
                finally:
                    time.sleep(2)   # the watch's reap ends in here: no SIGUSR2 may kill us
            timer.join()
    finally:
        signal.signal(signal.SIGINT, old)


def test_link_loss_is_set_in_millionths_both_ways(monkeypatch):
    """The egress rule counted in thousandths: --loss 0.05 lost nothing from worker to
    switch while the ingress rule lost 0.05%."""
    from thc.emu import links
    sent = []
    monkeypatch.setattr(links, "node_run", lambda host, cmd: sent.append(cmd) or "")
    links.set_link_loss(object(), "h1-eth0", 0.05)
    ingress = next(c for c in sent if "statistic" in c)
    egress = next(c for c in sent if "numgen" in c)
    assert "--probability 0.000500 " in ingress
    assert "mod 1000000 '<' 500 " in egress
