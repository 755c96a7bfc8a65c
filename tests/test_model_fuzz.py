"""The model-based fuzz (tests/model_fuzz.py) in short: hypothesis draws interleavings of
honest, out-of-step, replaying, spoofing and far-future packets, re-installs and clock
jumps; the compiled aggregator must answer each exactly as the reference model, and no
result may differ from the oracle's exact sum. ``make fuzz`` runs a million steps."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thc.net import fastagg
from thc.wire import model
from tests import model_fuzz as F

small = st.integers(0, 63)
steps = st.lists(st.builds(F.Step, small, small, small, small, small),
                 min_size=40, max_size=160)   # shorter ones rarely complete a chunk


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(steps, st.sampled_from(F.BASES), st.booleans())
def test_engines_agree_with_the_model_and_every_result_is_exact(steps, base, sharded):
    F.run_steps(steps, base, sharded=sharded)


def test_fifty_thousand_random_steps():
    rng = random.Random(24)
    for case in range(250):
        F.run_steps(F.random_steps(rng, 200), F.BASES[case % 2], sharded=case % 4 >= 2)


@pytest.mark.parametrize("shape", [s for s in F.SHAPES if s != "thc"])
def test_other_job_shapes_agree_with_the_model(shape):
    """A vote job, 16-bit sums, one worker, 32 workers: the compiled engine's answers and
    every result, as for the default shape."""
    rng = random.Random(len(shape))
    most = 0
    with F.shaped(shape):
        job = F.make_job()
        for case in range(12 if shape == "many" else 60):   # 32 workers: 10x the packets
            engines = F.run_steps(F.random_steps(rng, 200), F.BASES[case % 2],
                                  sharded=case % 4 >= 2)
            most = max([most] + [c[2] for c in engines.uses.first.values()])
    assert most == job.n_workers, "no result of every worker"
    assert (job.aggregation, job.sum_bits, job.n_workers) == {
        "vote": ("vote", 8, 3), "wide": ("thc", 16, 3), "alone": ("thc", 8, 1),
        "many": ("thc", 16, 32)}[shape]


def test_the_fuzz_exercises_every_rule():
    """The interleavings reach every drop the fuzz aims at, held uses and completions."""
    rng = random.Random(5)
    drops, jobs = {}, {}
    for case in range(40):
        counters = F.run_steps(F.random_steps(rng, 200), F.BASES[case % 2]).ref.counters()
        for k, v in counters["drops"].items():
            drops[k] = drops.get(k, 0) + v
        for k, v in counters["jobs"][F.JOB_ID].items():
            jobs[k] = jobs.get(k, 0) + v
    for reason in ("stale_run", "stale", "wrong_use", "wrong_slot", "unknown_worker",
                   "reused_run", "malformed", "bad_lanes", "worker_outside_job", "unknown_job",
                   "wrong_config"):
        assert drops[reason] > 0, reason
    for counter in ("completions", "held", "retransmissions", "pending"):
        assert jobs[counter] > 0, counter


def _find_violation() -> str:
    rng = random.Random(3)
    for case in range(200):
        try:
            F.run_steps(F.random_steps(rng, 200), F.BASES[case % 2], compiled=False)
        except F.Violation as e:
            return str(e)
    return ""


def test_a_model_that_gives_a_use_the_wrong_op_is_caught(monkeypatch):
    """One rule flipped (a FLUSH opens a MAX use): the oracle sees a MAX_RESULT closed
    short."""
    monkeypatch.setitem(model.OP_OF, model.FLUSH, model.MAX)
    assert "closed short" in _find_violation()


def test_a_model_that_adds_onto_the_previous_use_is_caught(monkeypatch):
    real = model.Model._accumulate
    monkeypatch.setattr(model.Model, "_accumulate", staticmethod(
        lambda st, op, i, payload, first: real(st, op, i, payload, False)))
    assert "wrong RESULT" in _find_violation()


def test_a_model_whose_closed_use_takes_a_late_worker_is_caught(monkeypatch):
    """A FLUSH-closed use not frozen (a late DATA still added): each result matched its own
    bitmap, so the oracle alone passed it, though workers of one chunk decoded different
    sums."""
    real = model.Model.handle

    def unfrozen(self, datagram, src, now):
        for job in self.jobs.values():
            job.thc_closed[:] = [0] * len(job.thc_closed)
        return real(self, datagram, src, now)
    monkeypatch.setattr(model.Model, "handle", unfrozen)
    assert "a closed use must be frozen" in _find_violation()


def test_a_model_that_completes_a_sum_short_of_a_worker_is_caught(monkeypatch):
    """A sum sent out at n - 1 workers with no FLUSH: a short sum taken for a full one."""
    real = model.Model.handle

    def early(self, datagram, src, now):
        data = datagram[0] == model.DATA
        for job in self.jobs.values():
            job.n = F.N_WORKERS - 1 if data else F.N_WORKERS
        try:
            return real(self, datagram, src, now)
        finally:
            for job in self.jobs.values():
                job.n = F.N_WORKERS
    monkeypatch.setattr(model.Model, "handle", early)
    assert "which no FLUSH closed" in _find_violation()


@pytest.mark.skipif(not fastagg.available(), reason=f"compiled: {fastagg.UNAVAILABLE}")
def test_the_comparison_sees_an_engine_that_differs(monkeypatch):
    """The compiled engine against a model with the idle-run rule flipped: caught."""
    monkeypatch.setattr(F.Engines, "__init__", _engines_with_short_idle)
    rng = random.Random(9)
    with pytest.raises(F.Violation, match="compiled"):
        for case in range(200):
            F.run_steps(F.random_steps(rng, 200), F.BASES[case % 2])


def _engines_with_short_idle(self, compiled=True, sharded=False):
    from thc.net.aggregator import Aggregator
    self.job, self.nonce, self.now, self.uses = F.make_job(), 0x1000, 1000.0, F.Uses()
    self.ref = Aggregator([self.job], nonce=self.nonce, run_idle=0.0005)
    self.others = [("compiled", fastagg.FastAggregator([self.job], nonce=self.nonce))]
