"""The Tofino program's idle take within one recirculation (docs/switch.md, "The run jump and
idle rules"): a packet that takes an idle or fresh job marks it taken in its pass 0, so a
packet of another run before that packet's pass 1 meets the job's new run, as in the model.
A straggler of the run before is refused (stale_run), the first run's use opens once, and a
lost pass gives a withheld result, never a wrong sum. Where pass 1 alone marked the job,
the straggler took it, the first run took it back and opened its use a second time: a late
pass of the first opening counted in the second (a wrong sum where a pass of the second was
lost, a chunk withheld for good where none was). A pass going round across an install does
not mark the new install heard."""
from __future__ import annotations

import re
import shutil

import pytest

if shutil.which("cpp") is None:
    pytest.skip("cpp (the C preprocessor) is not installed: reading thc_tna.p4 needs it for "
                "its #includes and macros", allow_module_level=True)

from tests.tna.interleave import JOB_ID, T, addr, lanes_of, make_job, nonce_of
from tests.tna.interp import Program
from tests.tna.oracle import wrong_sum
from tests.tna.p4text import P4SRC, preprocess
from tests.tna.pass0 import TnaEngine
from thc.wire import protocol as P
from thc.wire.model import Model

NEW, OLD = 1003, 1000
"""The job's new run, and a straggler of the run before it (older: the model refuses it)."""


def _packet(worker: int, run: int) -> bytes:
    """Worker ``worker``'s DATA of seq 0 to the job of two workers and a pool of one."""
    return P.Header(T["DATA"], worker, JOB_ID, 0, 0, 0, 0, 0, make_job(2, 1).config_tag, run,
                    nonce_of(worker, run)).pack() + lanes_of("DATA", worker, run, 0)


def _installed(text: str | None):
    """A TNA engine whose passes after pass 0 wait (until settled), a fresh job of two
    workers and a pool of one installed on it, and that install's epoch."""
    engine = TnaEngine(Program(preprocess(text), raw=text), delay=100)
    job = make_job(2, 1)
    epoch = job.new_epoch(nonce=5)
    engine.install(job, epoch, now=1000.0)
    return engine, job, epoch


def _window(lose: int | None = None, idle: bool = False, text: str | None = None):
    """A fresh job (or, with ``idle``, one idle since the run before): worker 0 of the new
    run, worker 1's straggler of the old run, worker 1 of the new run, all three within one
    recirculation (``lose``: the pass after pass 0 of the ``lose``-th packet going round is
    lost); then worker 0 sends its chunk again (``text``: another copy of the program).
    Returns the job, the engine, the verdicts of the three packets beside the model's, and
    the replies."""
    engine, job, epoch = _installed(text)
    model = Model()
    model.install(job, epoch)
    start = 1000.0
    if idle:
        for worker in (0, 1):
            engine.handle(_packet(worker, OLD), addr(worker), start)
            model.handle(_packet(worker, OLD), addr(worker), start)
        engine.settle()
        start += P.RUN_IDLE_S + 5
    got, want = [], []
    for worker, run in [(0, NEW), (1, OLD), (1, NEW)]:
        got.append(engine.handle(_packet(worker, run), addr(worker), start)[1])
        want.append(model.handle(_packet(worker, run), addr(worker), start)[1])
    if lose is not None:
        del engine.going_round[lose]
    replies = engine.settle()
    replies += engine.handle(_packet(0, NEW), addr(0), start + 0.001)[0] + engine.settle()
    return job, engine, (got, want), replies


@pytest.mark.parametrize("idle", [False, True], ids=["fresh job", "idle job"])
def test_a_straggler_in_the_window_is_refused_as_the_model_refuses_it(idle):
    _, engine, (got, want), _ = _window(idle=idle)
    assert want == [None, "stale_run", None], "the model refuses the straggler alone"
    assert got == want
    assert not engine.reopened, "a use opened twice while a pass of it went round"


@pytest.mark.parametrize("idle", [False, True], ids=["fresh job", "idle job"])
def test_the_chunk_completes_once_with_the_right_sum(idle):
    job, engine, _, replies = _window(idle=idle)
    assert engine.withheld() == 0
    results = [r for r, _ in replies if r[0] == T["RESULT"]]
    assert results and wrong_sum(job, replies, lanes_of) is None
    hdr = P.Header.unpack(results[0])
    assert (hdr.run, hdr.count, hdr.bitmap) == (NEW, 2, 0b11)


@pytest.mark.parametrize("lose", [0, 1], ids=["worker 0's", "worker 1's"])
def test_a_lost_pass_in_the_window_gives_no_wrong_sum(lose):
    """Whichever new-run packet's pass goes missing, what comes back is right or withheld."""
    job, _, _, replies = _window(lose=lose)
    assert wrong_sum(job, replies, lanes_of) is None


def test_the_window_is_open_where_pass_1_alone_marks_the_job():
    """These tests can fail: on a copy whose pass 0 only reads the job's last-heard time,
    the straggler takes the job, the use opens twice, and a lost pass gives a wrong sum."""
    text, k = re.subn(r"^ *value = meta\.now;\n(\s*idle = 1;)", r"\1",
                      (P4SRC / "thc_tna.p4").read_text(), flags=re.M)
    assert k == 1, "the pattern no longer matches the program"
    _, engine, (got, want), _ = _window(text=text)
    assert got != want and engine.reopened
    job, _, _, replies = _window(lose=2, text=text)   # the second opening's pass
    assert wrong_sum(job, replies, lanes_of) is not None


def _late_pass_across_an_install(text: str | None = None):
    """A packet of the old run takes a fresh job; the job is installed again (its RESETs)
    while that packet's pass after pass 0 goes round; the pass comes back after them. Then a
    packet of a clock-derived run id (far from 0): its verdict on the program and the
    model."""
    engine, job, _ = _installed(text)
    engine.handle(_packet(0, OLD), addr(0), 1000.0)
    late = list(engine.going_round)
    engine.going_round.clear()
    epoch = job.new_epoch(nonce=6)
    engine.install(job, epoch, now=1000.0)
    engine.going_round.extend(late)
    engine.settle()
    model = Model()
    model.install(job, epoch)
    far = OLD + P.RUN_JUMP + 5
    return (engine.handle(_packet(1, far), addr(1), 1000.001)[1],
            model.handle(_packet(1, far), addr(1), 1000.001)[1])


def test_a_pass_going_round_across_an_install_leaves_the_job_without_a_run():
    """The new install has no run: any run id takes it, as in the model. A copy whose
    passes after pass 0 refresh the job's time whatever it holds marks the new install
    heard, with run 0, and refuses clock-derived run ids (stale_run) for 60 s."""
    assert _late_pass_across_an_install() == (None, None)
    text, k = re.subn(r"if \(value != 0\) \{\n\s*value = meta\.now;\n\s*\}",
                      "value = meta.now;", (P4SRC / "thc_tna.p4").read_text())
    assert k == 1, "the pattern no longer matches the program"
    assert _late_pass_across_an_install(text) == ("stale_run", None)
