"""The C extensions' own argument checks. Their Python wrappers never pass such arguments; a
direct caller gets a ValueError, not a read or write past a buffer, a division by zero, or a
loop that neither ends nor hears Ctrl-C. And a build that is not of the source beside it is
not used (setup.py, thc.built)."""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import operator
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

from thc.built import source_hash, stale
from thc.net import cext, fastagg
from thc.net.client import DATAPATH_ENV, AggregationClient
from thc.testing.clusters import free_port_block, local_job
from thc.wire import protocol as P
from thc.wire.jobs import ConfigError

pytestmark = pytest.mark.skipif(cext.UNAVAILABLE is not None, reason=f"{cext.UNAVAILABLE}")
LOOPBACK = 0x7F000001
TABLE = np.arange(16, dtype=np.uint32).tobytes()
REACH = bytes([1]) * 3 * 61
"""Job.reachable_sums's shape for DATA rounds of 2 workers at granularity 30, every sum
possible: these tests are of the arguments, not the sums."""
TIMING = (0.02, 0.05, 0.3, 3, 4, 3, 256)


def _no_dlcp(total: int, shards: int = 1) -> tuple:
    """stream()'s last arguments for a round without classes or a loss bound: the DLCP
    tuple, the counts and bitmaps."""
    return ((b"", 0, int(P.PktType.FLUSH), 0, 0, bytes(shards)), np.full(total, 2, np.uint8),
            np.zeros(total, np.uint32))


def _datapath(max_lanes: int = P.MAX_LANES):
    return cext._fastagg.Datapath(cext.TYPE_CODES,
                                  [int(P.DropReason[r]) for r in cext._fastagg.REASONS],
                                  max_lanes, P.SEQ_RESET, P.RUN_JUMP, 60.0, False, False)


def _udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    return s


def test_a_lane_count_whose_result_size_wraps_is_refused():
    """2^27 lanes of 16-bit sums: lanes * 16 wraps a 32-bit int to a negative size."""
    dp = _datapath()
    with pytest.raises(ValueError, match="outside what the compiled datapath holds"):
        dp.install(7, 1, 1, 1 << 27, 16, list(range(16)), [(LOOPBACK, 40000)], False, 1, 0, 1)
    dp.install(7, 1, 1, P.LANES, 16, list(range(16)), [(LOOPBACK, 40000)], False, 1, 0, 1)


@pytest.mark.parametrize("max_lanes", [0, (1 << 30) + 1, (1536 - 28) // 4 + 1])
def test_a_max_lane_count_whose_reply_outgrows_its_buffer_is_refused(max_lanes):
    """2^30 + 1 lanes: 4 x max_lanes wrapped in the range check, and a 4-byte MAX payload was
    taken whole, read and answered 2^30 lanes past its buffers."""
    with pytest.raises(ValueError, match="max_lanes out of range"):
        _datapath(max_lanes)
    _datapath((1536 - 28) // 4)


def test_a_source_port_or_address_beyond_its_field_is_refused_not_cut():
    dp = _datapath()
    for ip, port in ((LOOPBACK, 40000 + 65536), (LOOPBACK, -1), (LOOPBACK + (1 << 32), 40000)):
        with pytest.raises(ValueError, match="an IPv4 address and a port"):
            dp.handle(bytes(P.HEADER_BYTES), ip, port, 0.0)
    for ip in (LOOPBACK + (1 << 64), LOOPBACK - (1 << 64)):   # "k" would mask these
        with pytest.raises(OverflowError):
            dp.handle(bytes(P.HEADER_BYTES), ip, 40000, 0.0)


def test_an_installed_address_or_epoch_beyond_its_field_is_refused_not_cut():
    """install() cut a worker's address above 2^32 and an epoch above 2^32 to 32 bits: the
    address 127.0.0.1 + 2^32 was installed, and answered, as 127.0.0.1."""
    dp = _datapath()
    args = (7, 1, 1, 16, 8, list(range(16)))
    with pytest.raises(ValueError, match="IPv4 address as an int below 2"):
        dp.install(*args, [(LOOPBACK + (1 << 32), 40000)], False, 1, 0, 1 << 16)
    for epoch in (0, (1 << 32) + 5):
        with pytest.raises(ValueError, match="nonzero 32-bit"):
            dp.install(*args, [(LOOPBACK, 40000)], False, 1, 0, epoch)
    dp.install(*args, [(LOOPBACK, 40000)], False, 1, 0, 1 << 16)


def _stream(pool: int, is_data: bool, chunk: bytes, lanes: int, agg=None, out=None,
            reach=REACH):
    cl, ag = _udp(), _udp()
    try:
        kind = (P.PktType.DATA, P.PktType.RESULT) if is_data else (P.PktType.MAX,
                                                                    P.PktType.MAX_RESULT)
        header = (int(kind[0]), int(kind[1]), int(P.PktType.PENDING), 0, int(is_data), 0, 9,
                  pool, 77, 0, 0, lanes, 2, int(P.PktType.REFUSED),
                  30 if is_data else P.MAX_LANE_TOP, 0x1234, (0, 0xFFFF0000, 0), TABLE, False,
                  reach if is_data else b"")
        out = np.zeros((1, lanes), np.uint32) if out is None else out
        return cext._fastagg.stream(cl.fileno(), header, np.frombuffer(chunk, np.uint8),
                                    len(chunk), [agg or (LOOPBACK, ag.getsockname()[1])], [None], 1,
                                    TIMING, [None], [0.0], out, 4, 4 * lanes, False,
                                    *_no_dlcp(1))
    finally:
        cl.close()
        ag.close()


@pytest.mark.parametrize("pool", [1 << 32, 1 << 17, 3, (1 << 64) + 4])
def test_a_pool_beyond_the_slot_field_or_not_a_power_of_two_is_refused(pool):
    """2^32 was cut to 0 and divided by."""
    with pytest.raises((ValueError, OverflowError), match="stream: bad arguments|too large"):
        _stream(pool, True, bytes(8), 16)


@pytest.mark.parametrize("agg", [(LOOPBACK + (1 << 32), 9), (LOOPBACK, 70000), (LOOPBACK, -1),
                                 (LOOPBACK + (1 << 64), 9), (-1, 9)])
def test_an_aggregator_address_out_of_its_fields_is_refused(agg):
    """Cut down to 32 and 16 bits, these were sent to another host or port."""
    with pytest.raises((ValueError, OverflowError),
                       match="aggregator is an IPv4|too large|negative value"):
        _stream(4, True, bytes(8), 16, agg)


def test_a_max_round_whose_lanes_overrun_its_chunks_is_refused():
    """A 4-byte MAX chunk said to hold 64 lanes: its own values were read past the chunk."""
    with pytest.raises(ValueError, match="stream: bad arguments"):
        _stream(4, False, bytes(4), 64)


@pytest.mark.parametrize("reach", [REACH[1:], REACH + bytes(1), b""])
def test_reachable_sums_unlike_the_jobs_shape_are_refused(reach):
    """A result's lanes index the rows of n_workers x granularity + 1 sums: a shorter table
    would be read past its end."""
    with pytest.raises(ValueError, match="stream: bad arguments"):
        _stream(4, True, bytes(8), 16, reach=reach)


def test_sums_written_at_an_address_unlike_their_size_are_refused():
    """The sums are written through 16- and 32-bit pointers: an odd address is undefined."""
    with pytest.raises(ValueError, match="stream: bad arguments"):
        _stream(4, True, bytes(8), 16, out=memoryview(bytearray(4 * 16 + 1))[1:])


@pytest.mark.parametrize("rto,deadline", [(0.5, float("nan")), (float("nan"), 1.0),
                                          (0.5, float("inf")), (0.0, 1.0)])
def test_the_load_generator_refuses_a_time_that_never_comes(rto, deadline):
    w, sink = _udp(), _udp()
    try:
        with pytest.raises(ValueError, match="drive: bad arguments"):
            cext._fastagg.drive([(w.fileno(), 0)], LOOPBACK, sink.getsockname()[1], 3, 4, 16,
                                77, 0, 4, 4, [bytes(32)], cext.TYPE_CODES, rto, deadline)
    finally:
        w.close()
        sink.close()


@pytest.mark.parametrize("chunks,types,error", [
    (2 ** 62, None, "drive: a payload is shorter than chunks"),
    (4, -1, "drive: bad arguments"), (4, 256, "drive: bad arguments")])
def test_the_load_generator_refuses_chunks_past_its_payloads_and_bad_type_codes(chunks, types,
                                                                                error):
    """chunks x bytes a chunk once wrapped past 2^63 and passed the payloads' length check;
    a type code outside a byte was cast into one."""
    w, sink = _udp(), _udp()
    codes = list(cext.TYPE_CODES) if types is None else [types] + list(cext.TYPE_CODES)[1:]
    try:
        with pytest.raises(ValueError, match=error):
            cext._fastagg.drive([(w.fileno(), 0)], LOOPBACK, sink.getsockname()[1], 3, 4, 16,
                                77, 0, chunks, 4, [bytes(32)], codes, 0.5, 1.0)
    finally:
        w.close()
        sink.close()


class _Alarm(Exception):
    pass


def _rings(call) -> None:
    """``call`` raises what a SIGALRM handler raises 0.3 s in, within seconds."""
    def ring(signum, frame):
        raise _Alarm

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(_Alarm):
            call()
        assert time.monotonic() - t0 < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_the_load_generator_hears_a_signal_before_its_deadline():
    """A silent aggregator and a 30 s deadline: a signal's handler runs within a poll."""
    w, sink = _udp(), _udp()
    try:
        _rings(lambda: cext._fastagg.drive([(w.fileno(), 0)], LOOPBACK, sink.getsockname()[1],
                                           3, 4, 16, 77, 0, 4, 4, [bytes(32)], cext.TYPE_CODES,
                                           0.5, 30.0))
    finally:
        w.close()
        sink.close()


@pytest.mark.parametrize("loop", ["drive", "serve", "stream"])
def test_a_signal_pending_as_a_loop_starts_is_raised(loop):
    """A Ctrl-C whose handler had yet to run when a loop started: it ran in the loop's check
    for the main thread. The load generator cleared its error and ran to its deadline hearing
    no signal; a serve whose time was spent and a stream of no chunks, which never look
    again, returned with it still set (a SystemError)."""
    w, sink = _udp(), _udp()
    if loop == "drive":
        call = functools.partial(cext._fastagg.drive, [(w.fileno(), 0)], LOOPBACK,
                                 sink.getsockname()[1], 3, 4, 16, 77, 0, 4, 4, [bytes(32)],
                                 cext.TYPE_CODES, 0.5, 30.0)
    elif loop == "serve":
        call = functools.partial(_datapath().serve, w.fileno(), 0.0)
    else:
        header = (1, 3, 5, 4, 1, 0, 9, 4, 77, 0, 0, 16, 2, 8, 30, 1, (0, 0xFFFF0000, 0),
                  TABLE, False, REACH)
        call = functools.partial(cext._fastagg.stream, w.fileno(), header,
                                 np.zeros(0, np.uint8), 8, [(LOOPBACK, sink.getsockname()[1])],
                                 [None], 1, TIMING, [None], [0.0], np.zeros(0, np.uint16), 2,
                                 16, False, *_no_dlcp(0))
    old = signal.signal(signal.SIGINT, signal.default_int_handler)   # xdist's ignores it
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            # what SIGINT's handler does, then the loop with no bytecode between: still pending
            list(map(operator.call, (ctypes.pythonapi.PyErr_SetInterrupt, call)))
        assert time.monotonic() - t0 < 5
    finally:
        signal.signal(signal.SIGINT, old)
        w.close()
        sink.close()


def test_the_compiled_window_hears_a_signal_before_its_deadline(monkeypatch):
    monkeypatch.setenv(DATAPATH_ENV, "compiled")
    sink = _udp()
    job = local_job(3, 2, free_port_block(2))
    try:
        with AggregationClient(job, 0, sink.getsockname(), run=1, deadline=30.0) as c:
            _rings(lambda: c.reduce(np.zeros(4 * job.lanes // 2, np.uint8)))
            assert c.stats.compiled_rounds == 1
    finally:
        sink.close()


EXIT_WHILE_SERVING = """
import threading
from thc.net.fastagg import FastAggregator
from thc.testing.clusters import local_job
for _ in range(48):
    agg = FastAggregator([local_job(1, 2, 47000, pool_size=64)])
    agg.bind("127.0.0.1", 0)
    threading.Thread(target=agg.serve, daemon=True).start()
"""


@pytest.mark.skipif(not fastagg.available(), reason="the compiled datapath is not built")
def test_a_process_exits_cleanly_while_daemon_threads_serve():
    """Compiled aggregators serving on daemon threads (as ``start()`` runs them) when the
    process exits: each loop took the GIL every 50 ms to check for signals, and one that did
    while the interpreter finalized crashed the process (SIGSEGV in PyGILState_Ensure: most
    of these exits did). Only a loop on the main thread checks, where handlers run."""
    codes = [subprocess.run([sys.executable, "-c", EXIT_WHILE_SERVING], timeout=120).returncode
             for _ in range(6)]
    assert codes == [0] * 6


def test_a_job_built_by_hand_is_checked_by_the_client():
    """pool 0 made a window of no chunks: the Python window waited past its deadline."""
    job = dataclasses.replace(local_job(3, 2, free_port_block(2)), pool_size=0)
    with pytest.raises(ConfigError, match="power-of-two pool_size"):
        AggregationClient(job, 0, ("127.0.0.1", 9), run=1)


def test_a_build_of_another_source_is_named_stale(tmp_path):
    source = tmp_path / "_ext.c"
    source.write_text("int x;\n")
    module = types.ModuleType("pkg._ext")
    module.__file__ = str(tmp_path / "_ext.cpython-311-x86_64-linux-gnu.so")
    module.SOURCE_SHA256 = source_hash([b"int x;\n"])
    assert stale(module, "thing") is None
    source.write_text("int x, y;\n")
    assert "the thing was built from another version of _ext.c" in stale(module, "thing")
    source.unlink()
    assert stale(module, "thing") is None, "an installed wheel has no source to compare"
    assert stale(cext._fastagg, "compiled datapath") is None


def test_a_build_of_several_sources_is_stale_when_any_of_them_changed(tmp_path):
    """The datapath is built from several files; a header edited alone changes no .c file."""
    files = {"_ext.c": b"#include \"_ext.h\"\n", "_ext_part.c": b"int y;\n", "_ext.h": b"int x;\n"}
    for name, text in files.items():
        (tmp_path / name).write_bytes(text)
    module = types.ModuleType("pkg._ext")
    module.__file__ = str(tmp_path / "_ext.cpython-311-x86_64-linux-gnu.so")
    module.SOURCE_FILES = " ".join(files)
    module.SOURCE_SHA256 = source_hash(files.values())
    assert stale(module, "thing") is None
    (tmp_path / "_ext.h").write_bytes(b"int x, z;\n")
    assert "another version of _ext.c, _ext_part.c, _ext.h" in stale(module, "thing")
    (tmp_path / "_ext.h").write_bytes(files["_ext.h"])
    (tmp_path / "_ext_part.c").rename(tmp_path / "_ext_other.c")   # a part renamed
    assert "(_ext_part.c no longer there)" in stale(module, "thing")
    (tmp_path / "_ext_other.c").rename(tmp_path / "_ext_part.c")
    (tmp_path / "_ext.c").write_bytes(files["_ext.c"] + b"int y;")   # text moved between
    (tmp_path / "_ext_part.c").write_bytes(b"\n")                   # files, the same bytes
    assert stale(module, "thing") is not None
    del module.SOURCE_FILES  # a build older than the list: its one source, _ext.c, changed
    module.SOURCE_SHA256 = hashlib.sha256(b"int x;\n").hexdigest()
    assert "another version of _ext.c" in stale(module, "thing")


def _refusal_with(monkeypatch, module, name: str, value) -> str:
    """cext's UNAVAILABLE, loaded again with ``module.name`` set to ``value``; then loaded
    as it was, which must leave the extension usable."""
    import importlib
    monkeypatch.setattr(importlib.import_module(module), name, value)
    try:
        importlib.reload(cext)
        refusal = cext.UNAVAILABLE
    finally:
        monkeypatch.undo()
        importlib.reload(cext)
    assert cext.UNAVAILABLE is None
    return refusal


def test_an_extension_built_for_another_worker_limit_is_not_used(monkeypatch):
    """The header layout, drop reasons and counters were compared with protocol.json, the
    workers a job takes (the C code's bitmaps and arrays) were not."""
    limit = cext._fastagg.MAX_WORKERS
    assert _refusal_with(monkeypatch, "thc.wire.protocol", "MAX_WORKERS", limit // 2).startswith(
        f"the compiled datapath takes {limit} workers a job, protocol.json {limit // 2}: "
        f"rebuild it")


@pytest.mark.parametrize("name", ["EPOCH_TAG_SHIFT", "SHARD_DETAIL_SHIFT"])
def test_an_extension_that_splits_epochs_or_shard_details_elsewhere_is_not_used(monkeypatch,
                                                                                name):
    """The configuration tag's bits in an epoch and a wrong_shard detail's shard count were
    written as 16 in C, beside protocol.py's constants, with nothing comparing them."""
    assert _refusal_with(monkeypatch, "thc.wire.protocol", name, 12).startswith(
        "the compiled datapath splits an epoch at bit 16 and a wrong_shard detail at bit 16")


@pytest.mark.parametrize("module, name", [("thc.net.server", "DATAGRAM_BYTES"),
                                          ("thc.net.window", "RECV_BYTES")])
def test_an_extension_that_reads_datagrams_to_another_length_is_not_used(monkeypatch, module,
                                                                         name):
    """The Python and compiled datapaths each cut a long datagram at their own buffer's
    length, written twice with nothing comparing them."""
    assert _refusal_with(monkeypatch, module, name, 1024).startswith(
        "the compiled datapath reads 2048 bytes of a datagram at an aggregator and 4096 at a "
        "client")


_MUTATING = """
import sys
import numpy as np
from thc.net import cext
from thc.wire import protocol as P

LOOP = 0x7F000001


class Clears:
    '''An item whose conversion empties the list it is in.'''

    def __init__(self, victim, value):
        self.victim, self.value = victim, value

    def __index__(self):
        self.victim.clear()
        return self.value

    def __hash__(self):
        return 1


class Cuts(Clears):
    '''An item whose conversion leaves only the first item of the list it names.'''

    def __index__(self):
        del self.victim[1:]
        return self.value


def dp(types=cext.TYPE_CODES):
    return cext._fastagg.Datapath(types, [int(P.DropReason[r]) for r in cext._fastagg.REASONS],
                                  P.MAX_LANES, P.SEQ_RESET, P.RUN_JUMP, 60.0, False, False)


case = sys.argv[1]
try:
    if case == "counters":
        d = dp()
        d.install(7, 1, 1, 16, 8, list(range(16)), [(LOOP, 40000)], False, 1, 0, 1 << 16)
        ids = [0, 7, 7, 7]
        ids[0] = Clears(ids, 0)
        d.counters(ids)
    elif case == "table":
        table = list(range(16))
        table[0] = Clears(table, 0)
        dp().install(7, 1, 1, 16, 8, table, [(LOOP, 40000)], False, 1, 0, 1 << 16)
    elif case == "addrs":
        addrs = [None, (LOOP, 40001)]
        addrs[0] = (LOOP + 1000, Clears(addrs, 40000))
        dp().install(7, 2, 1, 16, 8, list(range(16)), addrs, False, 1, 0, 1 << 16)
    elif case == "types":
        types = list(cext.TYPE_CODES)
        types[0] = Clears(types, types[0])
        dp(types)
    elif case.startswith("header-"):   # the header read after the lists' lengths
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        lists = {"aggs": [(LOOP, 9), (LOOP, 10)], "epochs": [None, None],
                 "srtt": [None, None], "rttvar": [0.0, 0.0]}
        header = (1, 3, 5, 4, 1, Cuts(lists[case[7:]], 0), 9, 4, 77, 0, 0, 16, 2, 8, 30, 1,
                  (0, 0xFFFF0000, 0), np.arange(16, dtype=np.uint32).tobytes(), False,
                  bytes([1]) * 183)
        print(cext._fastagg.stream(s.fileno(), header, np.zeros(16, np.uint8), 8,
                                   lists["aggs"], lists["epochs"], 2,
                                   (0.02, 0.05, 0.1, 3, 4, 3, 256), lists["srtt"],
                                   lists["rttvar"], np.zeros((2, 16), np.uint16), 2, 16,
                                   False, (b"", 0, 7, 0, 0, bytes(2)), np.full(2, 2, np.uint8),
                                   np.zeros(2, np.uint32))[0])
    else:
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        epochs = [None]
        header = (1, 3, 5, 4, 1, 0, 9, 4, 77, 0, 0, 16, 2, 8, 30, 1, (0, 0xFFFF0000, 0),
                  np.arange(16, dtype=np.uint32).tobytes(), False, bytes([1]) * 183)
        cext._fastagg.stream(s.fileno(), header, np.zeros(8, np.uint8), 8,
                             [(LOOP, Clears(epochs, 9))], epochs, 1,
                             (0.02, 0.05, 0.1, 3, 4, 3, 256), [None], [0.0],
                             np.zeros((1, 16), np.uint16), 2, 16, False,
                             (b"", 0, 7, 0, 0, bytes(1)), np.full(1, 2, np.uint8),
                             np.zeros(1, np.uint32))
except Exception as e:   # an error is an answer; a crash is not
    print(type(e).__name__, e)
"""


@pytest.mark.parametrize("case", ["counters", "table", "addrs", "types", "stream",
                                  "header-aggs", "header-epochs", "header-srtt",
                                  "header-rttvar"])
def test_a_list_emptied_while_its_items_are_read_is_no_crash(case):
    """The extension read a list's items in place (borrowed) while converting them ran the
    caller's code: an __index__ that empties the list left it reading freed or missing
    items (SIGSEGV). It reads a copy, so the call ends in a result or a Python error.
    ``header-*``: stream() took a shard list's length, then read the header, whose item
    cut the list: the length checked was no longer the copy's, and the copy was read past
    its end."""
    r = subprocess.run([sys.executable, "-c", _MUTATING, case], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    if case.startswith("header-"):   # a timeout (2); the epochs learnt have no list to go to
        assert r.stdout.split()[0] == ("IndexError" if case == "header-epochs" else "2"), \
            r.stdout
    elif case == "stream":   # the epoch learnt has no list item to go to
        assert r.stdout.split()[0] == "IndexError", r.stdout
    else:   # the copy read whole: the call succeeds, any error (a signature's) fails
        assert r.stdout == "", r.stdout


def test_the_load_generator_counts_only_its_aggregators_results():
    """drive() counted any datagram of the RESULT type with a seq it waits for: a forger on
    the host (or a reply of another job, worker or run) completed a benchmark that the
    aggregator never answered."""
    w, sink, forger = _udp(), _udp(), _udp()
    job_id, run, chunks = 3, 77, 4
    forged = [P.Header(P.PktType.RESULT, 0, job_id, s % 4, 0, 1, s, s * 16, 1, run, 5).pack()
              + bytes(16) for s in range(chunks)]
    from_aggregator = [P.Header(P.PktType.RESULT, wid, job, s % 4, 0, 1, s, s * 16, 1, r,
                                5).pack() + bytes(16)
                       for s in range(chunks) for wid, job, r in ((1, job_id, run),
                                                                  (0, job_id + 1, run),
                                                                  (0, job_id, run + 1))]

    def forge():
        for d in forged:
            forger.sendto(d, w.getsockname())
        for d in from_aggregator:
            sink.sendto(d, w.getsockname())
    timer = threading.Timer(0.05, forge)
    timer.start()
    try:
        seconds, results, sent, _, complete = cext._fastagg.drive(
            [(w.fileno(), 0)], LOOPBACK, sink.getsockname()[1], job_id, 4, 16, run, 0,
            chunks, 4, [bytes(8 * chunks)], cext.TYPE_CODES, 0.2, 1.0)
    finally:
        timer.join()
        for s in (w, sink, forger):
            s.close()
    assert (results, complete) == (0, False) and sent >= chunks


def test_the_load_generator_counts_only_chunks_in_flight():
    """RESULTs from the aggregator's address for chunks not yet sent (an earlier drive's late
    replies, or forged) each counted as done: 200 of 200 with 8 sent, "complete"."""
    w, sink = _udp(), _udp()
    w.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    job_id, run, chunks = 3, 9, 200
    for s in range(chunks):
        sink.sendto(P.Header(P.PktType.RESULT, 0, job_id, s % 8, (s // 8) & 1, 1, s, s * 256,
                             1, run, 5).pack() + bytes(256), w.getsockname())
    time.sleep(0.1)
    try:
        seconds, results, sent, _, complete = cext._fastagg.drive(
            [(w.fileno(), 0)], LOOPBACK, sink.getsockname()[1], job_id, 8, 256, run, 0,
            chunks, 8, [bytes(chunks * 128)], cext.TYPE_CODES, 0.05, 0.5)
    finally:
        for s in (w, sink):
            s.close()
    assert not complete and results < chunks, (results, sent)


def test_a_lane_count_whose_4_byte_chunk_size_wraps_is_refused():
    """4 * lanes in int: 2^30 + 1 lanes wrapped to a MAX chunk of 4 bytes, and passed."""
    s = _udp()
    lanes = (1 << 30) + 1
    header = (2, 4, 5, 3, 0, 0, 1, 16, 1, 0, 0, lanes, 2, 8, 2139095039, 5, (0, 0, 0),
              np.zeros(16, np.uint32).tobytes(), False, b"")
    try:
        with pytest.raises(ValueError, match="bad arguments"):
            cext._fastagg.stream(s.fileno(), header, np.zeros(4, np.uint8), 4,
                                 [(LOOPBACK, 9)], [None], 1, (0.01, 0.02, 0.05, 3, 4, 3, 64),
                                 [None], [0.0], np.zeros(2 * lanes, np.uint8), 2, lanes, False,
                                 *_no_dlcp(1))
    finally:
        s.close()
