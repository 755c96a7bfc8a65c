"""A pass lost on the Tofino's recirculation port (docs/switch.md, "What recirculation adds"):
the program's own text (tests/tna/) counts the worker in pass 0 and never adds its lanes, and
real clients on loopback get what it sends. Its last passes are counted (thc_passes), and
egress withholds the RESULT whose count that is not, and every copy answering a
retransmission (thc_lost_passes): neither worker takes a sum that lacks the other's values,
and both rounds end in a timeout. Then out-of-step workers that open a use while the passes of
the one before still go round, one pass lost: the guards that keep those passes from
counting, each shown failing. tests/tna/interleave.py's ``--lose`` loses passes at random
against the oracle."""
from __future__ import annotations

import shutil
import socket
import threading
import time

import numpy as np
import pytest

if shutil.which("cpp") is None:
    pytest.skip("cpp (the C preprocessor) is not installed: reading thc_tna.p4 needs it for "
                "its #includes and macros", allow_module_level=True)

from tests.tna.interleave import (FIRST_RUN, JOB_ID, TABLE, T, addr, lanes_of, make_job,
                                  nonce_of)
from tests.tna.interp import Program
from tests.tna.oracle import wrong_sum
from tests.tna.p4text import P4SRC, preprocess
from tests.tna.pass0 import TnaEngine
from thc.codec.packing import pack_bits
from thc.net.client import AggregationClient, AggregationTimeout
from thc.testing.clusters import free_port_block
from thc.wire import protocol as P
from thc.wire.jobs import Job
from tests.test_transport import datapath  # noqa: F401 (a fixture)


def _switch(engine: TnaEngine, job: Job, lose_first_of: int):
    """A UDP socket that runs every datagram through ``engine`` and sends its replies where
    they go; the passes after pass 0 of worker ``lose_first_of``'s first DATA are lost."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.05)
    stop, seen = threading.Event(), threading.Event()
    lost = job.worker(lose_first_of)

    def serve():
        while not stop.is_set():
            try:
                data, src = sock.recvfrom(4096)
            except socket.timeout:
                continue
            first = not seen.is_set() and src == (lost.ip, lost.port)
            engine.delay = 1 if first else 0      # its passes wait on the recirculation port
            replies, _ = engine.handle(data, src, time.monotonic())
            if first:
                engine.going_round.clear()          # ... and are lost there
                seen.set()
            for reply, dest in replies:
                sock.sendto(reply, dest)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return sock, stop, seen, thread


def test_a_lost_pass_withholds_the_sum(datapath):
    base = free_port_block(2)
    job = Job.from_dict({
        "job_id": 9, "pool_size": 4, "lanes": P.LANES, "table": list(TABLE), "granularity": 30,
        "workers": [{"id": w, "ip": "127.0.0.1", "port": base + w, "switch_port": 260 + w}
                    for w in range(2)]})
    engine = TnaEngine()
    engine.install(job, job.new_epoch(nonce=5), now=time.monotonic())
    rng = np.random.default_rng(3)
    idx = [rng.integers(1, 16, P.LANES, dtype=np.uint8) for _ in range(2)]
    sock, stop, seen, thread = _switch(engine, job, lose_first_of=0)
    out = {}

    def work(w):
        with AggregationClient(job, w, sock.getsockname(), run=7, deadline=4.0) as c:
            try:
                out[w] = c.reduce(pack_bits(idx[w], P.INDEX_BITS))
            except AggregationTimeout as e:
                out[w] = e
            out[w, "rejected"], out[w, "datapath"] = c.stats.rejected, c.datapath

    try:
        first = threading.Thread(target=work, args=(0,))
        first.start()
        assert seen.wait(10), "worker 0's DATA never reached the switch"
        work(1)
        first.join(30)
    finally:
        stop.set()
        thread.join()
        sock.close()
    assert (out[0, "datapath"], out[1, "datapath"]) == (datapath, datapath)
    # no RESULT left the switch: the one completing the use and those answering the
    # retransmissions of both workers, each counted
    for w in (0, 1):
        assert isinstance(out[w], AggregationTimeout), out[w]
        assert "withholding the chunk's result" in str(out[w]), out[w]   # named as a cause
        assert out[w, "rejected"] == 0
    assert engine.withheld() >= 2 + 2, engine.withheld()   # the multicast, a retransmission each


OUT_OF_STEP = {
    "the program": None,
    "a late ADD of the use before counted": (
        "(1, THC_OP_ADD, 0, 0): NoAction();", "(1, THC_OP_ADD, 0, 0): thc_passes_join();"),
    "a late opener's WRITE of the use before counted": (
        "(1, THC_OP_WRITE, 0, 0): NoAction();", "(1, THC_OP_WRITE, 0, 0): thc_passes_join();"),
}


@pytest.mark.parametrize("name", sorted(OUT_OF_STEP))
def test_a_use_opened_under_the_passes_of_the_one_before(name):
    """Out of step: right after an install (every use acknowledged) both workers send seq 0
    and then seq 2, the same slot version, while seq 0's passes still go round, and the pass
    of the packet that opened seq 2 is lost. The last passes of seq 0 must not count for
    seq 2 (thc_current_op): the program withholds seq 2's RESULT; a copy that counts either
    of them (thc_passes_op's entries for another use) sends a sum that lacks worker 0's
    lanes."""
    text = (P4SRC / "thc_tna.p4").read_text()
    if OUT_OF_STEP[name]:
        old, new = OUT_OF_STEP[name]
        assert text.count(old) == 1, f"{name}: the entry is no longer in the program"
        text = text.replace(old, new)
    engine = TnaEngine(Program(preprocess(text), raw=text), delay=100)
    job = make_job(2, 1)
    engine.install(job, job.new_epoch(nonce=5), now=1000.0)
    replies = []
    for seq in (0, 2):
        for w in (0, 1):
            d = P.Header(T["DATA"], w, JOB_ID, 0, seq % 2, 0, seq, seq * P.LANES,
                         job.config_tag, FIRST_RUN, nonce_of(w, FIRST_RUN)).pack() + lanes_of(
                "DATA", w, FIRST_RUN, seq)
            got, reason = engine.handle(d, addr(w), 1000.0)
            assert reason is None, (seq, w, reason)
            replies += got
    opener = next(i for i, (use, _) in enumerate(engine.going_round) if use[2] == 2)
    del engine.going_round[opener]   # seq 2's opener: its pass lost on the recirculation port
    replies += engine.settle()
    wrong = wrong_sum(job, replies, lanes_of)
    results = {P.Header.unpack(r).seq for r, _ in replies if r[0] == T["RESULT"]}
    if OUT_OF_STEP[name] is None:
        assert wrong is None, wrong
        # seq 0's too: its last passes come round after the workers moved past its use
        assert results == set() and engine.withheld() == 4, (results, engine.withheld())
    else:
        assert wrong is not None and "seq 2 " in wrong, (name, results, wrong)


def _packet(kind: str, seq: int, w: int) -> bytes:
    """Worker ``w``'s packet of ``seq`` to the job of two workers and a pool of one."""
    return P.Header(T[kind], w, JOB_ID, 0, seq % 2, 0, seq, seq * P.LANES,
                    make_job(2, 1).config_tag, FIRST_RUN, nonce_of(w, FIRST_RUN)).pack() + (
        lanes_of("DATA", w, FIRST_RUN, seq) if kind == "DATA" else b"")


# (kind, seq, worker) sent in order, the seq whose opener's pass is lost, the settles between
FLUSH_SCENARIOS = {
    # worker 0 opens seq 0 with a FLUSH (a blank use) and both send seq 2 over its passes
    "opened by a FLUSH": ([("FLUSH", 0, 0), ("DATA", 2, 0), ("DATA", 2, 1)], 2),
    # after seq 2 completes, worker 0 closes seq 4 blank, twice, and both send seq 6
    "a FLUSH resent": ([("DATA", 2, 0), ("DATA", 2, 1), "settle", ("DATA", 3, 1),
                        ("FLUSH", 4, 0), ("FLUSH", 4, 0), ("DATA", 6, 0), ("DATA", 6, 1)], 4),
}
FLUSH_OUT_OF_STEP = {
    ("the program", "opened by a FLUSH"): None,
    ("the program", "a FLUSH resent"): None,
    ("a late FLUSH opener's clearing pass counted", "opened by a FLUSH"): (
        "(1, THC_OP_WRITE, 1, 0): NoAction();", "(1, THC_OP_WRITE, 1, 0): thc_passes_join();"),
    ("a late FLUSH copy's READ looking at the next use's count", "a FLUSH resent"): (
        "(1, THC_OP_READ, 1, 0): NoAction();", "(1, THC_OP_READ, 1, 0): thc_passes_look();"),
}


@pytest.mark.parametrize("name,scenario", sorted(FLUSH_OUT_OF_STEP))
def test_a_blank_use_under_the_passes_of_the_one_after(name, scenario):
    """The blank passes of a use a FLUSH opened or answered must not count for the next use
    of the slot version once its opener's pass is lost (thc_passes_op's entries for a blank
    pass that is not current): counted, or read as their own, they make up for the lost
    pass, and the program sends a sum that lacks a worker's lanes, or a stale one."""
    text = (P4SRC / "thc_tna.p4").read_text()
    if FLUSH_OUT_OF_STEP[name, scenario]:
        old, new = FLUSH_OUT_OF_STEP[name, scenario]
        assert text.count(old) == 1, f"{name}: the entry is no longer in the program"
        text = text.replace(old, new)
    engine = TnaEngine(Program(preprocess(text), raw=text), delay=100)
    job = make_job(2, 1)
    engine.install(job, job.new_epoch(nonce=5), now=1000.0)
    plan, lost = FLUSH_SCENARIOS[scenario]
    replies = []
    for step in plan:
        if step == "settle":
            replies += engine.settle()
            continue
        kind, seq, w = step
        got, reason = engine.handle(_packet(kind, seq, w), addr(w), 1000.0)
        assert reason is None, (step, reason)
        replies += got
    opener = next(i for i, (use, _) in enumerate(engine.going_round) if use[2] == lost)
    del engine.going_round[opener]
    replies += engine.settle()
    wrong = wrong_sum(job, replies, lanes_of)
    if FLUSH_OUT_OF_STEP[name, scenario] is None:
        assert wrong is None, wrong
        assert engine.withheld() >= 1
    else:
        assert wrong is not None, (name, scenario)
