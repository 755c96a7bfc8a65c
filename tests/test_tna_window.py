"""The Tofino program's idle take within one recirculation (docs/switch.md, "The run jump and
idle rules"): a packet that takes an idle or fresh job marks it taken in its pass 0, so a
packet of another run before that packet's pass 1 meets the job's new run, as in the model.
A straggler of the run before is refused (stale_run), the first run's use opens once, and a
lost pass gives a withheld result, never a wrong sum. Where pass 1 alone marked the job,
the straggler took it, the first run took it back and opened its use a second time: a late
pass of the first opening counted in the second (a wrong sum where a pass of the second was
lost, a chunk withheld for good where none was). A pass going round across an install does
not mark the new install heard. At the idle edge, a live run's packet whose pass 0 comes a
tick before the job would read idle holds off any take until its passes are back; seeded
cases on the edge's ticks (which the interleavings step over) check it with passes late and
lost."""
from __future__ import annotations

import random
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


def _packet(worker: int, run: int, seq: int = 0) -> bytes:
    """Worker ``worker``'s DATA of ``seq`` to the job of two workers and a pool of one."""
    return P.Header(T["DATA"], worker, JOB_ID, 0, seq & 1, 0, seq, 0, make_job(2, 1).config_tag,
                    run, nonce_of(worker, run)).pack() + lanes_of("DATA", worker, run, seq)


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
    """These tests can fail: on a copy whose pass 0 only reads the job's clock where it
    takes the job (pass 1 alone marks it heard and held off), the straggler takes the job,
    the use opens twice, and a lost pass gives a wrong sum."""
    text, k = re.subn(r"^ *value\.heard = meta\.now;\n\s*value\.until = meta\.now \+ "
                      r"THC_TNA_EDGE;\n(\s*\})", r"\1",
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
    passes after pass 0 refresh the job whatever pass 0 read marks the new install heard,
    with run 0, and refuses clock-derived run ids (stale_run) for 60 s."""
    assert _late_pass_across_an_install() == (None, None)
    text, k = re.subn(r"if \(\(int<32>\)\(value\.until - meta\.now\) > 0\) \{\n"
                      r"\s*value\.heard = meta\.now;\n\s*\}", "value.heard = meta.now;",
                      (P4SRC / "thc_tna.p4").read_text())
    assert k == 1, "the pattern no longer matches the program"
    assert _late_pass_across_an_install(text) == ("stale_run", None)


TICK_S = 65536e-9
"""The TNA clock's tick (ingress timestamp bits 47..16)."""


def _edge(lose: int | None = None, text: str | None = None):
    """The live run NEW completes seq 0; the job then hears nothing until one tick before it
    would read idle, when worker 0 of NEW sends seq 1 (pass 0 reads it live, its passes go
    round); within that recirculation, on the edge's tick, a straggler of OLD at worker 1's
    address and worker 1 of NEW send seq 1 (``lose``: the pass of the ``lose``-th packet
    going round is lost); then both workers resend seq 1. Returns the job, the engine, the
    two edge packets' verdicts, and every reply."""
    engine, job, _ = _installed(text)
    for worker in (0, 1):
        engine.handle(_packet(worker, NEW), addr(worker), 1000.0)
    replies = engine.settle()
    idle_ticks = engine.p.consts["THC_TNA_IDLE"][0]
    edge = ((int(1000.0 * 1e9) >> 16) + idle_ticks) * TICK_S + TICK_S / 2
    engine.clock = edge - TICK_S      # a pass takes microseconds: these stay going round
    replies += engine.handle(_packet(0, NEW, 1), addr(0), edge - TICK_S)[0]
    engine.clock = edge
    verdicts = []
    for worker, run in ((1, OLD), (1, NEW)):
        sent, verdict = engine.handle(_packet(worker, run, 1), addr(worker), edge)
        replies += sent
        verdicts.append(verdict)
    if lose is not None:
        del engine.going_round[lose]
    replies += engine.settle()
    for k in (1, 2):
        for worker in (0, 1):
            replies += engine.handle(_packet(worker, NEW, 1), addr(worker), edge + 0.001 * k)[0]
        replies += engine.settle()
    return job, engine, verdicts, replies


@pytest.mark.parametrize("lose", [None, 0], ids=["no pass lost", "the live packet's lost"])
def test_at_the_idle_edge_a_live_read_holds_off_the_take(lose):
    """Neither edge packet takes the job (each waits, unanswered, as stale_run: only the
    live packet's passes go round), no use opens twice, and the chunk completes with the
    right sum (withheld where the live packet's pass was lost, as any lost opening is)."""
    job, engine, verdicts, replies = _edge(lose)
    assert verdicts == ["stale_run", "stale_run"] and not engine.reopened
    results = [r for r, _ in replies if r[0] == T["RESULT"] and P.Header.unpack(r).seq == 1]
    assert wrong_sum(job, replies, lanes_of) is None
    assert bool(results) == (lose is None)


def test_the_idle_edge_is_open_where_a_live_read_holds_nothing_off():
    """A copy whose live reads leave the hold-off as it was: the straggler takes the job,
    NEW takes it back and opens its use a second time, and the loss of that opening's pass
    gives a wrong sum (the straggler's lanes in NEW's result)."""
    text, k = re.subn(r"(< 0\) \{\n)\s*value\.until = meta\.now \+ THC_TNA_EDGE;\n", r"\1",
                      (P4SRC / "thc_tna.p4").read_text())
    assert k == 1, "the pattern no longer matches the program"
    _, engine, verdicts, _ = _edge(text=text)
    assert verdicts == [None, None] and engine.reopened
    job, _, _, replies = _edge(lose=2, text=text)
    assert wrong_sum(job, replies, lanes_of) is not None


def _after_silence(ticks: int, run: int | None) -> str | None:
    """The verdict on worker 0's seq 1 of ``run`` (None: NEW) after NEW completed seq 0 and
    the job then heard nothing for ``ticks`` (None: taken), and whether a refusal was
    answered."""
    engine, _, _ = _installed(None)
    for worker in (0, 1):
        engine.handle(_packet(worker, NEW), addr(worker), 1000.0)
    engine.settle()
    sent, verdict = engine.handle(_packet(0, NEW if run is None else run, 1), addr(0),
                                  1000.0 + ticks * TICK_S)
    answered = bool(sent + engine.settle())
    return verdict if verdict is None or answered else f"{verdict}, unanswered"


def test_past_half_the_clocks_wrap_a_silent_job_waits_then_reads_live():
    """What docs/switch.md says of a job silent for 39 hours (the 32-bit clock's half wrap):
    for 60 s its packets wait (its hold-off reads as the future), then it reads live, its own
    run taking it and a run beyond the jump refused; before the half wrap it reads idle. An
    install unused for as long reads live too, with no run."""
    idle = _installed(None)[0].p.consts["THC_TNA_IDLE"][0]
    far = NEW + P.RUN_JUMP + 5
    assert [_after_silence(2**31 - 1000, run) for run in (None, far)] == [None, None]
    assert [_after_silence(2**31 + idle // 2, run) for run in (None, far)] == [
        "stale_run, unanswered"] * 2
    assert [_after_silence(2**31 + idle + 1000, run) for run in (None, far)] == [
        None, "stale_run"]
    # an install unused as long reads live with no run: a run beyond the jump from 0 refused
    engine, _, _ = _installed(None)
    late = 1000.0 + (2**31 + idle + 1000) * TICK_S
    assert engine.handle(_packet(0, far), addr(0), late)[1] == "stale_run"
    assert _installed(None)[0].handle(_packet(0, far), addr(0), 1000.0 + 1000 * TICK_S)[1] is None


EDGE_CASES = 100


def _edge_fuzz(seed: int, prog: Program, hold_ticks: int) -> str | None:
    """One seeded case around the idle edge: NEW completes seq 0; 3-13 packets then come on
    ticks from 4 before the edge to 40 after it, or closer (DATA, FLUSH, MAX of NEW, a newer run, an
    older one and one beyond the jump, from either worker's address, seqs 1 and 2), each
    one's passes after pass 0 coming round up to ``hold_ticks`` later and a pass lost at
    random; then both workers of the newest run send seqs 1 to 3. What went wrong, or None."""
    rng = random.Random(seed)
    job = make_job(2, 1, sum_bits=rng.choice([0, 16]))
    engine = TnaEngine(prog, delay=100)
    engine.install(job, job.new_epoch(nonce=5), now=1000.0)

    def data(worker, run, seq, kind="DATA"):
        return (P.Header(T[kind], worker, JOB_ID, 0, seq & 1, 0, seq, 0, job.config_tag, run,
                         nonce_of(worker, run)).pack() + lanes_of(kind, worker, run, seq))

    replies = []
    for worker in (0, 1):
        replies += engine.handle(data(worker, NEW, 0), addr(worker), 1000.0)[0]
    replies += engine.settle()
    idle_ticks = prog.consts["THC_TNA_IDLE"][0]
    edge = ((int(1000.0 * 1e9) >> 16) + idle_ticks) * TICK_S + TICK_S / 2
    hold = rng.randrange(hold_ticks) * TICK_S
    engine.lose, engine.loss_rng = rng.choice([0, 0.2, 0.5]), random.Random(seed)
    sent_at, runs_taken = [], set()
    lo, hi = rng.choice([(-4, 40), (-2, 4), (-2, 2), (-1, 18)])
    for k in sorted(rng.randrange(lo, hi) for _ in range(rng.randrange(3, 14))):
        t = edge + k * TICK_S
        while sent_at and sent_at[0] <= t - hold - 1e-12:
            sent_at.pop(0)
            replies += engine.come_round()
        run = rng.choice([NEW, NEW, OLD, OLD, NEW + 1, NEW + P.RUN_JUMP + 9])
        kind = "DATA" if run == NEW + 1 else rng.choice(["DATA", "DATA", "DATA", "FLUSH", "MAX"])
        before = len(engine.going_round)
        engine.clock = t
        worker = rng.randrange(2)
        got, verdict = engine.handle(data(worker, run, rng.choice([1, 1, 2]), kind),
                                     addr(worker), t)
        replies += got
        sent_at += [t] * (len(engine.going_round) - before)
        if verdict is None:
            runs_taken.add(run)
    replies += engine.settle()
    engine.lose = 0
    last = max(r for r in runs_taken | {NEW} if r <= NEW + 1)
    t = edge + 0.03     # past any hold-off
    for seq in (1, 2, 3):
        for _ in range(2):
            for worker in (0, 1):
                replies += engine.handle(data(worker, last, seq), addr(worker), t)[0]
            replies += engine.settle()
            t += 0.001
    if engine.reopened:
        return f"seed {seed}: uses opened twice {sorted(engine.reopened)}"
    if wrong := wrong_sum(job, replies, lanes_of):
        return f"seed {seed}: {wrong}"
    done = any(P.Header.unpack(r).seq == 3 and P.Header.unpack(r).run == last
               for r, _ in replies if r[0] == T["RESULT"])
    if not done and max(runs_taken) <= NEW + 1:
        return f"seed {seed}: run {last}'s seq 3 never completed"
    return None


@pytest.mark.parametrize("hold_ticks", [14, 250], ids=["passes back in 1 ms", "in 16 ms"])
def test_around_the_idle_edge_no_sum_is_wrong_and_the_chunks_go_on(hold_ticks):
    """Seeded cases on the edge's ticks (the interleavings step over them): no use opens
    twice, no RESULT holds a wrong sum, and the newest run's chunks then complete, while
    passes come round within the hold-off."""
    assert not _edge_problems(None, hold_ticks)


def test_the_edge_cases_catch_a_program_without_the_hold_off():
    text, k = re.subn(r"(< 0\) \{\n)\s*value\.until = meta\.now \+ THC_TNA_EDGE;\n", r"\1",
                      (P4SRC / "thc_tna.p4").read_text())
    assert k == 1, "the pattern no longer matches the program"
    problems = _edge_problems(text, 14)
    assert any("opened twice" in p for p in problems), problems


def _edge_problems(text: str | None, hold_ticks: int) -> list[str]:
    prog = Program(preprocess(text), raw=text)
    return [p for seed in range(EDGE_CASES)
            if (p := _edge_fuzz(seed + 1000 * hold_ticks, prog, hold_ticks))]
