"""``thc aggregator``'s refusals a user can meet, and both aggregators' handling of sends the
kernel refuses (counted in ``send_errors``; a refused UDP GSO send resent datagram by
datagram), the latter in a private network namespace where a firewall rule and a small
MTU make the kernel refuse them."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from thc.net import fastagg
from thc.net.report import Report
from thc.testing.clusters import free_port_block, local_job
from thc.testing.stats import fresh_stats
from thc.wire.jobs import Cluster


def _aggregator(tmp_path, *argv) -> subprocess.CompletedProcess:
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(local_job(1, 2, free_port_block(2)),)).save(cfg)
    return subprocess.run([sys.executable, "-m", "thc.cli", "aggregator", "--config",
                           str(cfg), "--duration", "5", *argv],
                          capture_output=True, text=True, timeout=60)


def test_a_listen_address_without_a_port_is_refused(tmp_path):
    r = _aggregator(tmp_path, "--listen", "127.0.0.1")
    assert r.returncode == 2 and "expected HOST:PORT, got '127.0.0.1'" in r.stderr, r.stderr
    assert "listening" not in r.stdout


@pytest.mark.parametrize("argv,env,message", [
    (["--listen", "127.0.0.1:99999"], {}, "port 99999 of '127.0.0.1:99999' is not in 0..65535"),
    (["--listen", "127.0.0.1:0"], {"THC_AGGREGATOR_DATAPATH": "bogus"},
     "aggregator datapath 'bogus' is not one of"),
    (["--listen", "127.0.0.1:0", "--stats-file", "/nonexistent-dir/stats.json"], {},
     "--stats-file /nonexistent-dir/stats.json: cannot write it")])
def test_bad_addresses_settings_and_stats_files_are_refused_at_startup(tmp_path, monkeypatch,
                                                                       argv, env, message):
    """These were tracebacks (OverflowError, ValueError), the stats file's only once the
    aggregator had announced that it was serving."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    r = _aggregator(tmp_path, *argv)
    assert r.returncode == 2 and f"thc aggregator: {message}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "listening" not in r.stdout


@pytest.mark.parametrize("datapath", ["python", "compiled"])
def test_a_port_in_use_cannot_be_listened_on(tmp_path, datapath):
    if datapath == "compiled" and not fastagg.available():
        pytest.skip(fastagg.UNAVAILABLE)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        r = _aggregator(tmp_path, "--listen", f"127.0.0.1:{port}", "--datapath", datapath)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "in use" in r.stderr, r.stderr


@pytest.mark.parametrize("option,value,message", [
    ("--loss", "1.5", "impairment loss=1.5 must lie in [0, 1)"),
    ("--dup", "-0.1", "impairment dup=-0.1 must lie in [0, 1)"),
    ("--jitter", "20", "impairment jitter=20.0 s must lie in [0, 10]")])
def test_an_impairment_out_of_range_is_refused(tmp_path, option, value, message):
    r = _aggregator(tmp_path, "--listen", "127.0.0.1:0", option, value)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "listening" not in r.stdout


@pytest.mark.parametrize("option,value", [
    ("--duration", "-1"), ("--duration", "0"), ("--duration", "nan"), ("--duration", "inf"),
    ("--duration", "soon"), ("--stats-interval", "nan"), ("--stats-interval", "-1")])
def test_times_that_serve_nothing_or_print_wrong_are_usage_errors(tmp_path, capsys, option,
                                                                  value):
    """--duration -1, 0 or nan served nothing and exited 0; --stats-interval nan never
    printed, -1 printed every half second."""
    import argparse

    from thc.net import aggregator
    parser = argparse.ArgumentParser()
    aggregator.add_arguments(parser)
    base = ["--config", str(tmp_path / "cluster.json")]
    with pytest.raises(SystemExit) as e:
        parser.parse_args([*base, option, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err
    assert any(said in err for said in ("must be above 0", "must be 0 or more",
                                        "not a finite number", "not a number: 'soon'"))
    args = parser.parse_args(base)   # no --duration: serve until interrupted
    assert args.duration is None and args.stats_interval == 5.0
    assert parser.parse_args([*base, "--stats-interval", "0"]).stats_interval == 0   # never


NETNS_SCRIPT = textwrap.dedent("""
    import json, subprocess, socket, sys, threading, time
    from thc.net.aggregator import Aggregator
    from thc.net.fastagg import FastAggregator
    from thc.testing.clusters import local_job
    from thc.wire import protocol as P

    N = 40
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)

    def rounds(make, base, blocked, errors):
        job = local_job(1, 2, base, pool_size=64)
        agg = make([job])
        addr = agg.bind("127.0.0.1", 0)
        workers = []
        for w in job.workers:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((w.ip, w.port))
            workers.append(s)
        payload = bytes(P.payload_bytes(P.PktType.DATA, job.lanes))
        for seq in range(N):      # all queued before it serves: replies leave in batches
            for w, s in enumerate(workers):
                slot, version = P.slot_of(seq, job.pool_size)
                s.sendto(P.Header(P.PktType.DATA, w, 1, slot, version, 0, seq,
                                  seq * job.lanes, job.config_tag, 1, 0).pack() + payload, addr)
        threading.Thread(target=agg.serve, args=(60.0,), daemon=True).start()
        got = []
        for w, s in enumerate(workers):
            s.settimeout(0.5 if w == blocked else 30.0)
            n = 0
            try:
                while n < N:
                    n += P.Header.unpack(s.recv(4096)).pkt_type == P.PktType.RESULT
            except socket.timeout:
                pass
            got.append(n)
        def send_errors():
            agg.counters()    # the compiled datapath reports send_errors with its counters
            return agg.send_errors

        end = time.monotonic() + 30   # the count settles once the last send was tried
        while send_errors() < errors and time.monotonic() < end:
            time.sleep(0.01)
        return {"results": got, "send_errors": send_errors()}

    out = {}
    rule = ["OUTPUT", "-p", "udp", "--dport", "41001", "-j", "DROP"]
    subprocess.run(["iptables", "-A", *rule], check=True)
    out["python, worker 1 blocked"] = rounds(Aggregator, 41000, 1, N)
    if sys.argv[1] == "compiled":
        subprocess.run(["iptables", "-A", *rule[:4], "41011", *rule[5:]], check=True)
        out["compiled, worker 1 blocked"] = rounds(FastAggregator, 41010, 1, N)
        subprocess.run(["ip", "link", "set", "lo", "mtu", "300"], check=True)
        out["compiled, GSO refused"] = rounds(FastAggregator, 41020, None, 0)
    print(json.dumps(out))
""")


def _netns_prefix() -> list[str] | None:
    if not (shutil.which("unshare") and shutil.which("iptables") and shutil.which("ip")):
        return None
    prefix = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    probe = subprocess.run(prefix + ["iptables", "-L", "OUTPUT"], capture_output=True)
    return prefix if probe.returncode == 0 else None


def test_refused_sends_are_counted_and_a_refused_gso_send_goes_out_one_by_one():
    """Worker 1's port firewalled: every RESULT to it fails (EPERM), each counted in
    ``send_errors``, while worker 0 gets all of its own. An MTU below a GSO send's size:
    the kernel refuses the burst (EINVAL); the compiled datapath sends its datagrams one by
    one, counting no error, and both workers get every RESULT."""
    prefix = _netns_prefix()
    if prefix is None:
        pytest.skip("needs a private network namespace with iptables (as Mininet does)")
    kind = "compiled" if fastagg.available() else "python"
    r = subprocess.run(prefix + [sys.executable, "-c", NETNS_SCRIPT, kind],
                       capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for datapath in ("python", "compiled")[: 2 if kind == "compiled" else 1]:
        assert out[f"{datapath}, worker 1 blocked"] == {"results": [40, 0], "send_errors": 40}
    if kind == "compiled":
        assert out["compiled, GSO refused"] == {"results": [40, 40], "send_errors": 0}


def _serving(tmp_path, *extra: str, **popen) -> subprocess.Popen:
    """`thc aggregator` started on a free port for a job of two workers, its counters
    printed on every stop (--stats-interval 0); its output piped, as text."""
    port = free_port_block(1)
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(local_job(3, 2, free_port_block(2)),), agg_port=port).save(cfg)
    popen.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.Popen(
        [sys.executable, "-m", "thc.cli", "aggregator", "--listen", f"127.0.0.1:{port}",
         "--config", str(cfg), "--stats-interval", "0", *extra],
        stdout=subprocess.PIPE, text=True, **popen)
    proc.port = port
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_aggregator_started_with_sigint_ignored_stops_on_a_signal(tmp_path, sig):
    """A shell's background job starts with SIGINT ignored: the aggregator still stops on
    Ctrl-C (and on SIGTERM, and on a hangup), printing its final counters."""
    proc = _serving(tmp_path, "--stats-file", str(tmp_path / "stats.json"),
                    stderr=subprocess.DEVNULL,
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    port = proc.port
    try:
        assert "listening" in proc.stdout.readline()
        fresh_stats([tmp_path / "stats.json"], alive=lambda: proc.poll() is None)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(5):   # dropped as malformed, less than a file rewrite before the stop
                s.sendto(b"junk", ("127.0.0.1", port))
        time.sleep(0.05)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0
    final = json.loads(out.strip().splitlines()[-1])
    assert sum(final["drops"].values()) == 5
    # the file was rewritten every 0.5 s while serving alone: it lagged the final line
    assert json.loads((tmp_path / "stats.json").read_text()) == final


def test_an_aggregator_under_nohup_serves_on_through_a_hangup(tmp_path):
    """Started with SIGHUP ignored (``nohup``), the hangup leaves it serving; SIGTERM then
    stops it with its final counters."""
    proc = _serving(tmp_path, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        assert "listening" in proc.stdout.readline()
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert proc.poll() is None
    except BaseException:
        proc.kill()
        raise
    assert "drops" in _final_counters(proc)


def _final_counters(proc: subprocess.Popen) -> dict:
    """SIGTERM to a serving aggregator: the final counters it prints as it exits 0."""
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("when", ["together", "at_its_first_line"])
def test_signals_together_or_at_once_still_end_with_the_final_counters(tmp_path, when):
    """Ctrl-C and a supervisor's SIGTERM together: the second signal's KeyboardInterrupt left
    the stop before its final counters (every try of five exited 130 with none). A SIGTERM
    right after the listening line, before the signal handlers were set, killed it with
    none."""
    port = free_port_block(1)
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(local_job(3, 2, free_port_block(2)),), agg_port=port).save(cfg)
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "thc.cli", "aggregator", "--listen", f"127.0.0.1:{port}",
             "--config", str(cfg), "--stats-interval", "0", "--stats-file",
             str(tmp_path / "stats.json")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert "listening" in proc.stdout.readline()
            if when == "together":
                fresh_stats([tmp_path / "stats.json"], alive=lambda: proc.poll() is None)
                proc.send_signal(signal.SIGINT)
        except BaseException:
            proc.kill()
            raise
        assert "drops" in _final_counters(proc)


def test_a_bug_in_the_serving_thread_is_kept_as_its_error():
    """Not only a socket failure: anything that ends the thread is kept, so that
    `thc aggregator` exits naming it instead of serving nothing with a clean face."""
    from thc.net.aggregator import Aggregator
    job = local_job(1, 2, free_port_block(2))

    def boom(datagram, src, now):
        raise RuntimeError("a bug in the model")

    with Aggregator([job]) as agg:
        agg._handle = boom
        addr = agg.start()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"\x00" * 40, addr)
        deadline = time.monotonic() + 10
        while agg.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(agg.error, RuntimeError) and "a bug in the model" in str(agg.error)


def test_a_flood_does_not_keep_the_aggregator_past_its_duration():
    """The serving loop read until the socket was empty, so a sender faster than the
    aggregator kept it past ``--duration`` and ``stop()`` for as long as the flood lasted.
    Here each datagram takes 1 ms or more to handle and a thread sends without pause for up
    to 30 s: the loop looks at the clock every DRAIN datagrams, however slow each one is."""
    from thc.net.aggregator import DRAIN, Aggregator
    job = local_job(1, 2, free_port_block(2))
    agg = Aggregator([job])
    handled = []
    agg._handle = lambda datagram, src, now: handled.append(time.monotonic()) or \
        time.sleep(0.001) or ([], None)
    addr = agg.bind()
    flooding = threading.Event()
    flooding.set()

    def flood():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            end = time.monotonic() + 30
            while flooding.is_set() and time.monotonic() < end:
                s.sendto(b"\x00" * 40, addr)
    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    try:
        time.sleep(0.1)
        start = time.monotonic()
        agg.serve(duration=0.2)
        took = time.monotonic() - start
    finally:
        flooding.clear()
        sender.join()
        agg.stop()
    late = sum(t >= start + 0.2 for t in handled)
    assert late <= DRAIN and took < 15, f"{late} datagrams handled after the duration, " \
        f"serve(duration=0.2) returned after {took:.1f} s"


def test_a_receive_queue_smaller_than_asked_is_named_at_startup(tmp_path, monkeypatch, capsys):
    """The kernel caps the receive queue at net.core.rmem_max without a word, and bursts
    beyond it are lost: `thc aggregator` says what it got. Here it asks four times the cap."""
    import argparse
    from pathlib import Path

    from thc.net import aggregator, server
    cap = Path("/proc/sys/net/core/rmem_max")
    if not cap.exists():
        pytest.skip("no /proc/sys/net/core/rmem_max: not Linux")
    rmem_max = int(cap.read_text())
    for module in (server, aggregator):
        monkeypatch.setattr(module, "RECEIVE_BUFFER", 4 * rmem_max)
    monkeypatch.setattr(aggregator, "_stop_on_signals", lambda: None)   # pytest's own
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(local_job(1, 2, free_port_block(2)),)).save(cfg)
    parser = argparse.ArgumentParser()
    aggregator.add_arguments(parser)
    args = parser.parse_args(["--config", str(cfg), "--listen", "127.0.0.1:0",
                              "--duration", "0.2", "--stats-interval", "0"])
    assert aggregator.run(args) == 0
    out = capsys.readouterr()
    assert (f"the kernel granted {rmem_max >> 10} KiB of receive queue of the "
            f"{4 * rmem_max >> 10} KiB asked (sysctl net.core.rmem_max)") in out.err, out.err
    assert '"queue_overflow": 0' in out.out, out.out


def test_without_listen_a_shard_serves_at_its_port_in_the_shard_map(tmp_path, monkeypatch,
                                                                     capsys):
    """``--listen``'s help said a shard's default was its address in the shard map; it was
    THC's port, and a shard map giving another port refused the start. Without ``--shard``
    the default stays THC's port."""
    import argparse
    import dataclasses

    from thc.net import aggregator
    from thc.wire import protocol as P
    from thc.wire.jobs import Shard
    monkeypatch.setattr(aggregator, "_stop_on_signals", lambda: None)   # pytest's own
    port = free_port_block(2)
    job = dataclasses.replace(local_job(1, 2, free_port_block(2)),
                              shards=(Shard("127.0.0.1", port), Shard("127.0.0.1", port + 1)))
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(job.validate(),)).save(cfg)
    assert aggregator.default_listen(Cluster(jobs=(job,)), None) == f"0.0.0.0:{P.UDP_PORT}"
    parser = argparse.ArgumentParser()
    aggregator.add_arguments(parser)
    assert aggregator.run(parser.parse_args(["--config", str(cfg), "--shard", "1",
                                             "--duration", "0.2",
                                             "--stats-interval", "0"])) == 0
    out = capsys.readouterr().out
    assert f"listening on 0.0.0.0:{port + 1} as shard 1" in out, out
    # a shard the map lacks is a usage error naming the map, not a traceback
    r = subprocess.run([sys.executable, "-m", "thc.cli", "aggregator", "--config", str(cfg),
                        "--shard", "5", "--duration", "0.2"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "shard 5 is not in job 1's shard map" in r.stderr, r.stderr


def test_a_central_aggregator_serves_where_its_workers_send(tmp_path, monkeypatch, capsys):
    """Without --listen it served THC's port whatever the cluster file's agg_port, where its
    workers send: every round timed out, naming only an aggregator that did not answer. A
    --listen elsewhere is said at the start, as is a shard serving jobs without a shard map
    elsewhere than their workers send."""
    import argparse
    import dataclasses

    from thc.net import aggregator
    from thc.wire.jobs import Shard
    monkeypatch.setattr(aggregator, "_stop_on_signals", lambda: None)   # pytest's own
    port = free_port_block(3)
    job = local_job(1, 2, free_port_block(2))
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(job,), agg_port=port).save(cfg)
    parser = argparse.ArgumentParser()
    aggregator.add_arguments(parser)
    for listen, said in ([], None), (["--listen", f"127.0.0.1:{port + 1}"], port + 1):
        assert aggregator.run(parser.parse_args(["--config", str(cfg), "--duration", "0.2",
                                                 "--stats-interval", "0", *listen])) == 0
        out = capsys.readouterr()
        assert f"listening on {'127.0.0.1' if said else '0.0.0.0'}:{said or port}" in out.out
        assert ("but the cluster file's workers send to 127.0.0.1:" f"{port}" in out.err) \
            == bool(said), out.err
    # a shard serves a job without a shard map at its own address, not at agg_ip:agg_port
    sharded = dataclasses.replace(local_job(2, 2, free_port_block(2)),
                                  shards=(Shard("127.0.0.1", port), Shard("127.0.0.1", port + 1)))
    note = aggregator.central_address_note(Cluster(jobs=(job, sharded), agg_port=port + 2),
                                           "0.0.0.0", port)
    assert f"but the workers of jobs [1] (no shard map) send to 127.0.0.1:{port + 2}" in note


def test_a_stats_file_or_reader_gone_never_stops_the_serving(tmp_path):
    """Its folder removed mid-run, the stats file's write ended the aggregator with a
    FileNotFoundError traceback; a reader of its lines gone (`| head -1`) with a
    BrokenPipeError. Each is said once on stderr and serving goes on to --duration; a stats
    file given as a link is written through it."""
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(local_job(1, 2, free_port_block(2)),)).save(cfg)
    folder = tmp_path / "stats"
    folder.mkdir()
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    base = [sys.executable, "-m", "thc.cli", "aggregator", "--config", str(cfg), "--listen",
            "127.0.0.1:0", "--duration", "3"]
    p = subprocess.Popen(base + ["--stats-interval", "0", "--stats-file",
                                 str(folder / "s.json")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (folder / "s.json").exists():
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    shutil.rmtree(folder)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "--stats-file: cannot write it" in err, err
    assert "Traceback" not in err and json.loads(out.splitlines()[-1])["jobs"]
    # standard output closed after the first line: serving goes on to its duration
    p = subprocess.Popen(base + ["--stats-interval", "0.5", "--stats-file", str(link)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "listening" in p.stdout.readline()
    p.stdout.close()
    t0 = time.monotonic()
    err = p.stderr.read()
    assert p.wait(timeout=60) == 0 and time.monotonic() - t0 > 1.5, err
    assert "standard output closed" in err and "Traceback" not in err, err
    assert link.is_symlink() and json.loads(real.read_text())["jobs"]


@pytest.mark.parametrize("datapath", ["python", "compiled"])
def test_stop_from_another_thread_ends_a_foreground_serve_and_a_second_start_is_refused(
        datapath):
    """serve() on a thread's foreground raised "Bad file descriptor" when another thread's
    stop() closed its socket under it; a second start() left the first loop serving an
    orphaned socket (compiled: a freed one)."""
    from thc.net.aggregator import Aggregator
    if datapath == "compiled" and not fastagg.available():
        pytest.skip(fastagg.UNAVAILABLE)
    make = Aggregator if datapath == "python" else fastagg.FastAggregator
    agg = make([local_job(1, 2, free_port_block(2))])
    agg.bind("127.0.0.1", 0)
    timer = threading.Timer(0.3, agg.stop)
    timer.start()
    agg.serve()   # returns, as documented, once stop() is called
    timer.join()
    agg.start()
    try:
        with pytest.raises(RuntimeError, match="already bound"):
            agg.start()
    finally:
        agg.stop()
    assert agg.error is None


@pytest.mark.parametrize("datapath", ["python", "compiled"])
def test_a_foreground_serve_hears_its_threads_signals(datapath):
    """The compiled loop never ran a signal's handler: a serve() on the main thread went on
    past Ctrl-C and past a handler's stop() (60 s, until killed). The Python loop's socket
    was closed under it by such a stop(): "Bad file descriptor"."""
    from thc.net.aggregator import Aggregator
    if datapath == "compiled" and not fastagg.available():
        pytest.skip(fastagg.UNAVAILABLE)
    make = Aggregator if datapath == "python" else fastagg.FastAggregator

    def interrupt(agg):
        raise KeyboardInterrupt   # as Ctrl-C's own handler does

    old = signal.getsignal(signal.SIGALRM)
    try:
        for handler in (make.stop, interrupt):
            agg = make([local_job(1, 2, free_port_block(2))])
            agg.bind("127.0.0.1", 0)
            signal.signal(signal.SIGALRM, lambda *a, agg=agg, handler=handler: handler(agg))
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            t0 = time.monotonic()
            if handler is interrupt:
                with pytest.raises(KeyboardInterrupt):
                    agg.serve(duration=20)
            else:
                agg.serve(duration=20)   # returns: the handler's stop() is heard
            assert time.monotonic() - t0 < 5
            agg.stop()
            with pytest.raises(RuntimeError, match="not bound"):
                agg.address
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("stderr", ["apart", "same pipe"])
def test_a_standard_output_nobody_reads_holds_up_neither_the_serving_nor_the_stop(tmp_path,
                                                                                   stderr):
    """A supervisor's pipe read only at the end: once it filled, the counters line blocked
    the serving loop (the stats file froze) and, after a signal, the final line blocked the
    exit for good; with standard error in the same pipe (2>&1), so did the note saying so.
    Lines and notes now wait in threads of their own; the exit waits for the last line a few
    seconds, says so and ends."""
    import fcntl
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(local_job(1, 2, free_port_block(2)),)).save(cfg)
    stats = tmp_path / "stats.json"
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "thc.cli", "aggregator", "--config", str(cfg), "--listen",
         "127.0.0.1:0", "--stats-interval", "0.5", "--stats-file", str(stats)],
        stdout=write_end, stderr=subprocess.PIPE if stderr == "apart" else write_end,
        text=True)
    os.close(write_end)
    reader = os.fdopen(read_end, "rb")
    try:
        while b"listening" not in reader.readline():
            pass
        # fill the pipe through a description of its own, non-blocking: the aggregator's
        # stays blocking, as a supervisor's pipe is
        with open(f"/proc/{proc.pid}/fd/1", "wb", buffering=0) as filler:
            fcntl.fcntl(filler, fcntl.F_SETFL, fcntl.fcntl(filler, fcntl.F_GETFL) | os.O_NONBLOCK)
            for size in (4096, 1):
                while filler.write(b"x" * size):   # None once full (EAGAIN)
                    pass
        for _ in range(3):   # the file goes on being rewritten past several lines' time
            fresh_stats([stats], timeout=10, alive=lambda: proc.poll() is None)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read() if stderr == "apart" else None
    finally:
        proc.kill()
        reader.close()
    assert json.loads(stats.read_text())["jobs"]
    if err is not None:
        assert "standard output is not being read" in err, err
        assert "exiting without the final counters line" in err and "Traceback" not in err, err


def test_a_closed_or_non_blocking_standard_output_loses_no_line_and_no_time(tmp_path):
    """Started with standard output closed (``>&-``), the lines' thread died with a traceback
    and the exit waited 5 s for it; a non-blocking pipe (a parent's O_NONBLOCK) was taken
    for a reader gone at its first full moment, and every later line was lost."""
    import fcntl
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(local_job(1, 2, free_port_block(2)),)).save(cfg)
    base = [sys.executable, "-m", "thc.cli", "aggregator", "--config", str(cfg), "--listen",
            "127.0.0.1:0", "--stats-interval", "0.5"]
    t0 = time.monotonic()
    r = subprocess.run(base + ["--duration", "1"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=60,
                       preexec_fn=lambda: os.close(1))
    assert r.returncode == 0 and time.monotonic() - t0 < 4.5, r.stderr
    assert "Traceback" not in r.stderr and "exiting without" not in r.stderr, r.stderr
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    fcntl.fcntl(write_end, fcntl.F_SETFL, fcntl.fcntl(write_end, fcntl.F_GETFL) | os.O_NONBLOCK)
    proc = subprocess.Popen(base + ["--duration", "5"], stdout=write_end,
                            stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    try:
        time.sleep(3.5)   # a few lines' time: the 4 KiB pipe fills
        with os.fdopen(read_end, "rb") as reader:
            out = reader.read().decode()
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
    finally:
        proc.kill()
    lines = [json.loads(line) for line in out.splitlines()[1:]]
    assert len(lines) >= 8 and lines[-1]["jobs"] and "closed" not in err, (len(lines), err)


def test_the_first_line_comes_before_every_note_on_one_pipe(tmp_path):
    """A supervisor that reads standard error in the same pipe takes the first line for where
    it listens: written by a thread of its own, it came after the notes."""
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(local_job(1, 2, free_port_block(2)),)).save(cfg)
    for _ in range(3):
        r = subprocess.run([sys.executable, "-m", "thc.cli", "aggregator", "--config", str(cfg),
                            "--listen", "127.0.0.1:0", "--duration", "0.2"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=60)
        lines = r.stdout.splitlines()
        assert r.returncode == 0 and len(lines) > 1, r.stdout
        assert lines[0].startswith("thc aggregator listening on 127.0.0.1:"), r.stdout


def test_an_interrupt_while_the_first_line_waits_still_sends_the_notes():
    """The notes (settings, addresses, receive queue) came after the first line's wait for a
    reader: a SIGTERM or Ctrl-C in that wait lost them."""
    from types import SimpleNamespace

    from thc.net import aggregator as agg_cli
    notes = []

    class Waiting:
        def announce(self, text):
            raise KeyboardInterrupt

        def note(self, text):
            notes.append(text)
    agg = SimpleNamespace(counters=lambda: {"epochs": {1: 5}},
                          receive_buffer=agg_cli.RECEIVE_BUFFER)
    chosen = SimpleNamespace(describe=lambda: "settings: the chosen ones")
    cluster = Cluster(jobs=(local_job(1, 2, free_port_block(2)),))
    with pytest.raises(KeyboardInterrupt):
        agg_cli._announce(Waiting(), agg, ("127.0.0.1", 1), "python", chosen, cluster,
                          "127.0.0.1", 1, None)
    assert notes and notes[0] == "settings: the chosen ones", notes


@pytest.mark.parametrize("stdout", ["full", "gone"])
def test_a_standard_output_full_or_gone_before_the_first_line_holds_up_nothing(tmp_path,
                                                                               stdout):
    """The first line (where it listens) was printed on the main thread: an output full from
    the start held up the stop, and the stats file was never written; one whose reader was
    gone ended the aggregator at once with status 141, serving nothing."""
    import fcntl
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=(local_job(1, 2, free_port_block(2)),)).save(cfg)
    stats = tmp_path / "stats.json"
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    if stdout == "full":
        fcntl.fcntl(write_end, fcntl.F_SETFL,
                    fcntl.fcntl(write_end, fcntl.F_GETFL) | os.O_NONBLOCK)
        for size in (4096, 1):
            try:
                while os.write(write_end, b"x" * size):
                    pass
            except BlockingIOError:
                pass
        fcntl.fcntl(write_end, fcntl.F_SETFL,
                    fcntl.fcntl(write_end, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    else:
        os.close(read_end)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "thc.cli", "aggregator", "--config", str(cfg), "--listen",
         "127.0.0.1:0", "--duration", "2", "--stats-file", str(stats)],
        stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    try:
        err = proc.communicate(timeout=30)[1]
    finally:
        proc.kill()
        if stdout == "full":
            os.close(read_end)
    took = time.monotonic() - t0
    assert proc.returncode == 0 and "Traceback" not in err, (proc.returncode, err)
    assert 1.5 < took < 2 + Report.FINAL_WAIT + 4, (took, err)
    assert json.loads(stats.read_text())["jobs"], err
    said = "exiting without the final counters line" if stdout == "full" \
        else "standard output closed"
    assert said in err, err


@pytest.mark.parametrize("text", ["{}", '{"jobs": []}'])
def test_a_cluster_with_no_job_is_refused(tmp_path, text):
    """It served with jobs [] for its --duration, dropping every packet, and exited 0."""
    cfg = tmp_path / "cluster.json"
    cfg.write_text(text)
    r = subprocess.run([sys.executable, "-m", "thc.cli", "aggregator", "--config", str(cfg),
                        "--listen", "127.0.0.1:0", "--duration", "5"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"thc aggregator: {cfg} holds no job to aggregate" in \
        r.stderr, r.stderr
    assert "listening" not in r.stdout
