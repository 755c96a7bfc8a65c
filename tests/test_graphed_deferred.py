"""Graphed THC rounds with deferred checks (``GraphedAllReduce(deferred_checks=True)``): the
same estimates as rounds waited for; a refused round returns zeros, keeps the residual and is
raised by the next call (which takes no round) or by ``check()``; a round that outlasts its
deadline is raised there too. The watchdog ends a process whose round outlasts it. Eager under
Triton's interpreter on the CPU (tests/test_graphed_gpu.py replays them on a GPU)."""
import functools
import gc
import subprocess
import sys
import time
import warnings
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.test_codec_kernels import DEV, kernels
from tests.test_graphed import (P, _Peer, gloo_inputs, gloo_pair, join_gloo, one_round_worker,
                                tagged)
from thc.collective import agreement, graphed, watchdog
from thc.collective.ddp import THCHook
from thc.collective.graphed import GraphedAllReduce
from thc.emu.base import REPO_ROOT
from thc.testing.clusters import free_tcp_port


def _pair(key=5):
    """A reducer that waits and one that defers, each with its own peer."""
    return [GraphedAllReduce(_Peer(None), P, generator=key, capture=False,
                             deferred_checks=d) for d in (False, True)]


def _peers_say(reducers, r, norms=0.0):
    for ar in reducers:
        ar.transport.other = tagged(torch.full((4,), norms, device=DEV), r,
                                    deferred=ar.deferred_checks)


def _x(seed):
    return torch.randn(1024, generator=torch.Generator().manual_seed(seed)).to(DEV)


@kernels
def test_deferred_rounds_equal_the_waited_ones():
    waited, deferred = _pair()
    for r in range(3):
        _peers_say((waited, deferred), r)
        assert torch.equal(waited(_x(r)), deferred(_x(r))), r
    deferred.check()
    assert deferred.round == 3 and deferred._pending is None
    assert torch.equal(waited._bufs.residual, deferred._bufs.residual)


@kernels
def test_a_refused_round_returns_zeros_and_the_next_call_raises_it():
    """A peer's mark in round 1: the waiting reducer raises at once; the deferring one
    returns zeros, keeps its residual, and raises at its next call, which takes no round;
    from then on the two are equal again."""
    waited, deferred = _pair()
    _peers_say((waited, deferred), 0)
    assert torch.equal(waited(_x(0)), deferred(_x(0)))
    kept = deferred._bufs.residual.clone()
    _peers_say((waited, deferred), 1, norms=3.4028234663852886e38)   # a worker's mark
    with pytest.raises(ValueError, match="max norms must be finite"):
        waited(_x(1))
    assert not deferred(_x(1)).any()
    assert torch.equal(deferred._bufs.residual, kept)
    _peers_say((waited, deferred), 2)
    n = len(deferred.transport.sent)
    with pytest.raises(ValueError, match="max norms must be finite"):
        deferred(_x(2))
    assert len(deferred.transport.sent) == n and deferred.round == 2
    assert torch.equal(waited(_x(2)), deferred(_x(2)))
    assert torch.equal(waited._bufs.residual, deferred._bufs.residual)


@kernels
def test_a_worker_that_fails_before_its_max_round_does_what_its_peers_do():
    """Its peers return zeros for the round its failure refused and raise at their next call;
    so does it (its own error), taking no round either, and the next rounds pair up again."""
    _, deferred = _pair()
    _peers_say([deferred], 0)
    deferred(_x(7))
    short = deferred(_x(7)[:-1])                  # round 1, owed: marked MAX, zero sum
    assert short.shape == (1023,) and not short.any()
    assert (agreement.untag(deferred.transport.sent[-1])[0] > 1e38).all()
    n = len(deferred.transport.sent)
    with pytest.raises(RuntimeError, match="round 1 was refused by every worker: .*"
                                           "ValueError: a graphed all-reduce serves one"):
        deferred(_x(7))
    assert len(deferred.transport.sent) == n and deferred.round == 2
    _peers_say([deferred], 2)
    assert deferred(_x(7)).any()
    deferred.check()


@kernels
def test_a_failure_it_could_not_owe_is_raised_at_once_and_only_once():
    """Its owed round did not go out (the transport failed too): nothing was refused by the
    peers, so the worker raises its own error at once and its next call claims no refusal."""
    _, deferred = _pair()
    _peers_say([deferred], 0)
    deferred(_x(9))
    real_prepare, real_max = deferred.codec.prepare, deferred.transport.max
    deferred.codec.prepare = lambda *a, **k: (_ for _ in ()).throw(MemoryError("oom"))
    deferred.transport.max = lambda v: (_ for _ in ()).throw(ConnectionError("peer gone"))
    with pytest.raises(MemoryError):
        deferred(_x(9))
    assert "owed MAX round may have left" in deferred.transport.abandoned
    deferred.codec.prepare, deferred.transport.max = real_prepare, real_max
    _peers_say([deferred], 2)
    assert deferred(_x(9)).any()


def test_an_owed_round_that_could_not_be_built_abandons_the_transport(monkeypatch):
    """Its owed MAX round could not even be built (out of memory for the marks): its peers
    waited in the round, and its next call's size agreement paired with it (Gloo aborted a
    process: 12 lanes against 8). The transport is abandoned, naming the failure."""
    _, deferred = _pair()
    _peers_say([deferred], 0)
    deferred(_x(9))
    deferred.codec.prepare = lambda *a, **k: (_ for _ in ()).throw(MemoryError("oom"))
    monkeypatch.setattr(agreement, "tagged",
                        lambda *a: (_ for _ in ()).throw(MemoryError("no room for marks")))
    with pytest.raises(MemoryError, match="oom"):
        deferred(_x(9))
    assert ("round 1 failed before its owed MAX round went out (MemoryError: no room for "
            "marks)") in (deferred.transport.abandoned or ""), deferred.transport.abandoned


@kernels
def test_an_index_outside_the_table_refuses_the_round_on_the_device():
    """The worker's own indices, decoded for its residual, are read before the round's flags:
    an index outside the table gives zeros and keeps the residual."""
    _, deferred = _pair()
    _peers_say([deferred], 0)
    deferred(_x(8))
    kept = deferred._bufs.residual.clone()
    real = deferred.codec.encode_prepared

    def bad_index(*a, **k):
        wire = real(*a, **k)
        wire[3] = 200
        return wire
    deferred.codec.encode_prepared = bad_index
    deferred.transport.sum = lambda idx, count, params, classes=None: (
        2 * torch.ones(idx.numel(), dtype=torch.int32, device=DEV), None)
    _peers_say([deferred], 1)
    assert not deferred(_x(8)).any()
    assert torch.equal(deferred._bufs.residual, kept)
    with pytest.raises(ValueError, match="index 200 outside"):
        deferred.check()


@kernels
def test_check_raises_what_the_last_round_refused():
    _, deferred = _pair()
    _peers_say([deferred], 1)                       # this worker is in round 0
    assert not deferred(_x(3)).any()
    with pytest.raises(RuntimeError, match="different rounds"):
        deferred.check()
    deferred.check()                                # raised once, then forgotten


@kernels
def test_a_deferred_round_past_its_deadline_raises_and_abandons():
    _, deferred = _pair()
    _peers_say([deferred], 0)
    deferred(_x(4))

    class Stuck:
        def query(self):
            return False
    deferred.timeout = 0.05
    deferred._pending.done = Stuck()
    with pytest.raises(TimeoutError, match="round 0 replayed from a CUDA graph did not finish"):
        deferred(_x(4))
    assert "round 0" in deferred.transport.abandoned


@kernels
def test_a_round_nothing_read_is_told_when_the_process_ends(monkeypatch):
    """The last step's round, with no check() after it: the reader at exit warns of its
    refusal, and of a round not finished (without waiting for it); of a clean round, of one
    already raised, and of a reducer that waits, nothing."""
    monkeypatch.setattr(graphed, "_DEFERRING", weakref.WeakSet())
    waited, deferred = _pair()
    _peers_say((waited, deferred), 0)
    waited(_x(0))
    deferred(_x(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphed._read_at_exit()
    assert list(graphed._DEFERRING) == [deferred] and deferred._pending is None
    _peers_say([deferred], 1, norms=3.4028234663852886e38)   # a worker's mark
    assert not deferred(_x(1)).any()
    with pytest.warns(RuntimeWarning, match=r"round 1 of graphed reducer \S+ was refused "
                                            r"\(ValueError: max norms must be finite"):
        graphed._read_at_exit()
    assert deferred._pending is None

    class Stuck:
        def query(self):
            return False
    _peers_say([deferred], 2)
    deferred(_x(2))
    deferred._pending.done = Stuck()
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="round 2 of graphed reducer \\S+ had not finished"):
        graphed._read_at_exit()
    assert time.monotonic() - start < 1


@kernels
def test_a_refusal_nothing_read_is_told_when_its_reducer_is_dropped(monkeypatch):
    """A reducer dropped before the process ends (its hook freed, the model wrapped anew)
    left the reader at exit nothing to read: its last round's refusal went untold."""
    monkeypatch.setattr(graphed, "_DEFERRING", weakref.WeakSet())
    _, deferred = _pair()
    _peers_say([deferred], 0, norms=3.4028234663852886e38)   # a worker's mark
    assert not deferred(_x(0)).any() and deferred._pending is not None
    with pytest.warns(RuntimeWarning, match=r"round 0 of graphed reducer \S+ was refused "
                                            r"\(ValueError: max norms must be finite.* when "
                                            r"its reducer was dropped"):
        del deferred
        gc.collect()
    _, clean = _pair()
    _peers_say([clean], 0)
    clean(_x(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del clean
        gc.collect()


@kernels
def test_a_round_whose_event_cannot_be_read_is_told_once(monkeypatch):
    """An event whose query fails (a device error) was told at exit and again when its
    reducer was dropped."""
    monkeypatch.setattr(graphed, "_DEFERRING", weakref.WeakSet())
    _, deferred = _pair()
    _peers_say([deferred], 0)
    deferred(_x(0))

    class Broken:
        def query(self):
            raise RuntimeError("device error")
    deferred._pending.done = Broken()
    with pytest.warns(RuntimeWarning, match=r"round 0 .* was refused \(RuntimeError: device"):
        graphed._read_at_exit()
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        del deferred
        gc.collect()
    assert not told, [str(w.message) for w in told]


@kernels
def test_the_reader_at_exit_tells_every_round_where_warnings_are_errors(monkeypatch, capsys):
    """Under ``-W error`` a warning raises: the first reducer's stopped the reader, and the
    second reducer's refusal went untold."""
    monkeypatch.setattr(graphed, "_DEFERRING", weakref.WeakSet())
    reducers = _pair(), _pair()
    deferring = [pair[1] for pair in reducers]
    _peers_say(deferring, 0, norms=3.4028234663852886e38)
    for ar in deferring:
        assert not ar(_x(0)).any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphed._read_at_exit()
    told = capsys.readouterr().err
    assert told.count("RuntimeWarning: round 0 of graphed reducer") == 2, told


@kernels
def test_a_refusal_nothing_read_reaches_stderr_as_the_process_ends():
    code = ("from tests.test_graphed_deferred import _pair, _peers_say, _x\n"
            "_, deferred = _pair()\n"
            "_peers_say([deferred], 0, norms=3.4028234663852886e38)\n"
            "assert not deferred(_x(0)).any()\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "RuntimeWarning: round 0 of graphed reducer 0 was refused (ValueError: max " \
           "norms must be finite" in run.stderr, run.stderr[-2000:]


@kernels
def test_the_hook_raises_a_refusal_its_reducers_hold():
    """``THCHook.check`` after the last step, and before a new reducer (DDP rebuilt its
    buckets) takes over from the old ones."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        hook = THCHook(torch.nn.Linear(4, 4), lambda group: _pair()[1], overlap=False)
        old = hook.reducers[(0, 1024)] = _pair()[1]
        _peers_say([old], 1)
        old(_x(5))
        with pytest.raises(RuntimeError, match="different rounds"):
            hook.check()
        _peers_say([old], 2)
        old(_x(5))   # raised above, so this one takes its round 1 (and is refused again)
        with pytest.raises(RuntimeError, match="different rounds"):
            hook.reduce(1, _x(6), [1024])
        assert len(hook.reducers) == 1
        other = hook.reducers[(1, 1024)] = _pair()[1]
        for ar in (old, other):
            _peers_say([ar], 5)
            ar(_x(7))
        with pytest.raises(RuntimeError, match="2 buckets' rounds were refused: .*rounds"):
            hook.check()
        hook.check()                                 # both were read
    finally:
        dist.destroy_process_group()


@kernels
def test_a_steps_refusal_is_raised_with_every_buckets_at_once():
    """Every bucket of a step refused (a NaN reaches them all): the first bucket of the next
    step raised its own refusal, DDP left that step's later buckets alone, and each raised
    its own one step later: one bad step cost a step a bucket. The first now raises them
    all, and the step after is clean."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        hook = THCHook(torch.nn.Linear(4, 4), lambda group: _pair()[1], overlap=False)
        buckets = [_pair()[1] for _ in range(3)]
        for b, ar in enumerate(buckets):
            hook.reducers[(b, 1024)] = ar
            _peers_say([ar], 3)   # another round's tags: refused, the refusal deferred
            ar(_x(5))
        assert all(ar.owes_check for ar in buckets)
        with pytest.raises(RuntimeError, match="3 buckets' rounds were refused"):
            hook.reduce(0, _x(6), [1024])
        assert not any(ar.owes_check for ar in buckets)
        for b, ar in enumerate(buckets):
            _peers_say([ar], ar.round)
            assert hook.reduce(b, _x(7), [1024]).abs().sum() > 0
        hook.check()
    finally:
        dist.destroy_process_group()


def _gloo_worker(rank, port, q):
    join_gloo(rank, port)
    ar = GraphedAllReduce.through_torch_distributed(params=P, generator=rank,
                                                    deferred_checks=True)
    out = []
    for x in gloo_inputs(rank, 4):
        try:
            out.append(ar(x).cpu().numpy())   # memory that outlives this process
        except ValueError as e:
            out.append(str(e))
    q.put((rank, (out, ar.round)))
    dist.destroy_process_group()


@kernels
def test_two_gloo_workers_defer_a_refusal_alike():
    """Two processes: an Inf on one worker gives both zeros, both raise at their next call
    (taking no round), and the next round's estimates agree."""
    res = gloo_pair(_gloo_worker)
    (a, ra), (b, rb) = res[0], res[1]
    np.testing.assert_array_equal(a[0], b[0])
    assert not a[1].any() and not b[1].any()
    assert "NaN or Inf" in a[2] and "mark of a worker" in b[2]
    np.testing.assert_array_equal(a[3], b[3])
    assert a[3].any() and ra == rb == 3


def _deferring_or_waiting(rank):
    return GraphedAllReduce.through_torch_distributed(params=P, generator=rank,
                                                      deferred_checks=rank == 0)


@kernels
def test_a_deferring_worker_and_a_waiting_one_refuse_each_other():
    """After a refused round a worker that defers raises at its next call, taking no round,
    while one that waits goes on to the next: the two paired different steps (a clean sum of
    one worker's step 2 and the other's step 3). Their fingerprints differ now."""
    res = gloo_pair(functools.partial(one_round_worker, make=_deferring_or_waiting))
    assert all("raises its refusal a call later" in str(res[r]) for r in (0, 1)), res


def test_the_watchdog_expires_only_what_outlasts_its_deadline():
    expired = []
    dog = watchdog.Watchdog(expire=expired.append, interval=0.01)

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done
    dog.watch(Event(True), time.monotonic() - 1, "done, though late")
    late = Event(False)
    dog.watch(late, time.monotonic() + 0.05, "round 7 late")
    dog.watch(Event(False), time.monotonic() + 60, "round 8 in time")
    deadline = time.monotonic() + 5
    while not expired and time.monotonic() < deadline:
        time.sleep(0.01)
    assert expired == ["round 7 late"] and dog.watched == 1


def test_the_watchdog_outlives_a_failing_query_and_a_failing_action():
    expired = []

    def expire(what):
        expired.append(what)
        raise RuntimeError("the action failed")
    dog = watchdog.Watchdog(expire=expire, interval=0.01)

    class Broken:
        def query(self):
            raise RuntimeError("an illegal memory access was encountered")

    class Stuck:
        def query(self):
            return False
    dog.watch(Broken(), time.monotonic() + 60, "round 1")
    deadline = time.monotonic() + 5
    while not expired and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.watch(Stuck(), time.monotonic(), "round 2")
    while len(expired) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert expired[0].startswith("round 1 (and querying it raised RuntimeError: an illegal")
    assert expired[1:] == ["round 2"]


def test_a_round_waited_for_past_its_deadline_is_watched(monkeypatch):
    """Without deferred checks the wait raised TimeoutError and nothing watched the stuck
    stream: a loop that caught the error went on to wait on it for ever. (The CUDA event
    and stream stand in: this runs where no GPU is.)"""
    from thc.collective import replay

    class Stuck:
        def record(self, stream):
            pass

        def query(self):
            return False
    monkeypatch.setattr(torch.cuda, "Event", Stuck)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: None)
    watched = []
    monkeypatch.setattr(watchdog.SHARED, "watch", lambda *a: watched.append(a))
    with pytest.raises(TimeoutError, match="round 4 replayed from a CUDA graph did not finish"):
        replay.await_stream(torch.device("cuda"), 4, 0.01)
    ((event, deadline, what),) = watched
    assert isinstance(event, replay.OnDevice) and deadline > time.monotonic()
    assert what == replay.late(4, 0.01)


def test_the_watchdog_ends_the_process_with_the_rounds_name():
    code = ("import time\nfrom thc.collective import watchdog\n"
            "class E:\n    query = lambda self: False\n"
            "watchdog.SHARED.watch(E(), 0, 'round 3 replayed from a CUDA graph did not "
            "finish')\ntime.sleep(30)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == watchdog.EXIT_CODE
    assert "thc: round 3 replayed from a CUDA graph did not finish; ending" in run.stderr
