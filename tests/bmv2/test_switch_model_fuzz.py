"""The model-based fuzz (tests/model_fuzz.py) through BMv2, for each of its job shapes:
random interleavings of honest, out-of-step, replaying, spoofing, far-future,
second-incarnation and malformed packets go to the switch and to the reference model;
every worker must receive the model's datagrams, in order, and the switch's drop and job
counters must move as the model's. Pools of one, two and four slots; sequence numbers from 0
or just before the 2^32 wrap; up to two re-installs a case, the model given the epoch the
switch drew.

The clock is left out (the switch's runs on): tests/model_fuzz.py covers it against the
software engines. Without it no older run takes a job back, so a run that took the job by
its jump becomes the case's run."""
from __future__ import annotations

import itertools
import random

import pytest

from thc.controller import installed
from thc.wire import protocol as P
from thc.wire.model import Model
from tests import model_fuzz as F
from tests.bmv2.packets import exchange
from tests.bmv2.test_switch_trace import without_epoch

pytestmark = pytest.mark.bmv2
_ids = itertools.count(760)
WHOLE_USES = 4
"""Uses a case must complete with every worker's values (each replied to every worker): the
fuzz's bursts bring them together, where random single packets seldom do."""


@pytest.mark.parametrize("shape,seed,pool", [("thc", 1, 2), ("thc", 2, 2), ("vote", 3, 2),
                                             ("wide", 4, 2), ("alone", 5, 2), ("many", 6, 2),
                                             ("thc", 7, 1), ("wide", 8, 4)])
def test_switch_answers_every_interleaving_as_the_model(bmv2, monkeypatch, shape, seed, pool):
    """Each of the fuzz's job shapes: the default, a vote job, 16-bit sums, one worker, 32
    workers."""
    with F.shaped(shape):
        monkeypatch.setattr(F, "POOL", pool)
        assert _fuzz(bmv2, monkeypatch, seed) >= 1, "no re-install in the case"


def _fuzz(bmv2, monkeypatch, seed):
    monkeypatch.setattr(F, "LANES", bmv2.lanes())
    job_id = next(_ids)
    monkeypatch.setattr(F, "JOB_ID", job_id)
    # one switch port for every worker: BMv2 then handles the packets in send order
    job = bmv2.make_job(job_id, F.N_WORKERS, pool_size=F.POOL, ports=[0] * F.N_WORKERS,
                        table=list(F.TABLE), granularity=F.GRANULARITY,
                        aggregation=F.AGGREGATION)
    model = Model()

    def install():
        bmv2.install(job)
        model.install(job, installed.installed_jobs(bmv2.sw)[job.job_id]["epoch"])
    install()
    eps = {w: bmv2.endpoint(job, w) for w in range(F.N_WORKERS)}
    stranger = bmv2.stranger()
    addr_of = {w: (job.worker(w).ip, job.worker(w).port) for w in range(F.N_WORKERS)}
    worker_of = {a: w for w, a in addr_of.items()}
    ctx = F.Context(F.BASES[seed % 2], 1)
    want = {w: [] for w in range(F.N_WORKERS)}
    got = {w: [] for w in range(F.N_WORKERS)}
    before = bmv2.drops()
    steps, sent, installs = [], 0, 0

    def send():
        for w, ds in exchange(bmv2, steps, eps).items():
            got[w] += [without_epoch(d) for d in ds]
        steps.clear()
    for step in F.random_steps(random.Random(seed), 300):
        action = F.decode(step, ctx)
        if action[0] == "time" or (action[0] == "install" and installs == 2):
            continue
        if action[0] == "install":
            send()
            install()
            installs += 1
            continue
        for datagram, src in (action[1] if action[0] == "burst" else [action]):
            if src == F.STRANGER:
                ep, model_src = stranger, (stranger.ip, stranger.udp_port)
            else:
                w = int(src[1]) - F.BASE_PORT
                ep, model_src = eps[w], addr_of[w]
            replies, _ = model.handle(datagram, model_src, 0.0)
            for reply, dst in replies:
                want[worker_of[dst]].append(without_epoch(reply))
            steps.append((ep, datagram, [worker_of[dst] for _, dst in replies]))
            sent += 1
            # a run a jump ahead took the job: without the clock no older run takes it back,
            # so the case's own run follows it, or the rest of the case is refused stale_run
            live = model.jobs[job.job_id].thc_job_run
            if live and P.seq_newer(live, ctx.run):
                ctx.run = live
    send()
    assert sent > 200 and sum(map(len, want.values())) > 20
    replies = [P.Header.unpack(d) for ds in want.values() for d in ds]
    stale_runs = sum(h.pkt_type == P.PktType.REFUSED and h.count == P.DropReason.stale_run
                     for h in replies)
    assert stale_runs < len(replies) / 4, f"{stale_runs} of {len(replies)} replies refuse a run"
    whole = sum(h.pkt_type in (P.PktType.RESULT, P.PktType.MAX_RESULT)
                and h.count == F.N_WORKERS for h in replies)
    assert whole >= F.N_WORKERS * WHOLE_USES, f"{whole} replies carry every worker's values"
    for w in eps:
        assert got[w] == want[w], f"worker {w}: the switch's replies differ from the model's"
    after = bmv2.drops()
    assert {k: after[k] - before[k] for k in after} == dict(model.drops)
    assert bmv2.job_counters(job) == dict(model.jobs[job.job_id].counters)
    return installs
