"""THC all-reduces that workers must agree on before a round: sizes, tables, backends,
generators, reducers and their groups, rounds taken in unlike orders or from two threads.
A refusal reaches every worker at once, and they stay in step."""
from __future__ import annotations

import functools
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from thc.codec.params import THCParams
from thc.codec.thc import table_values
from thc.collective import agreement
from thc.collective.allreduce import THCAllReduce
from thc.net.aggregator import Aggregator
from thc.net.client import AggregationClient, AggregationTimeout
from thc.testing.clusters import free_port_block, free_tcp_port, local_job
from tests.allreduce_cases import PARAMS, _threads_on_one_group_worker, assert_each_round_its_own
from tests.procs import gloo_pair
from tests.test_graphed import _Peer, join_gloo


def _two_workers_calling(calls_of, deadline: float) -> dict:
    """Two workers (threads) through a software aggregator, worker w calling each tensor of
    ``calls_of(w)``: per worker, each call's mean (None for an empty result) or the error
    it raised, then the reducer's round count."""
    p = THCParams(slice_size=256, seed=7)
    job = local_job(1, 2, free_port_block(2), pool_size=32, table=p.table)
    out = {0: [], 1: []}
    with Aggregator([job]) as agg:
        addr = agg.start()

        def work(w):
            with AggregationClient(job, w, addr, run=1, deadline=deadline) as c:
                ar = THCAllReduce.through_aggregator(c, p, generator=w, error_feedback=False)
                for x in calls_of(w):
                    try:
                        y = ar(x)
                        out[w].append(float(y.mean()) if y.numel() else None)
                    except (RuntimeError, AggregationTimeout) as e:
                        out[w].append(e)
                out[w].append(ar.round)

        ts = [threading.Thread(target=work, args=(w,)) for w in range(2)]
        [t.start() for t in ts]
        [t.join(60) for t in ts]
    return out


@pytest.mark.parametrize("odd", ["empty", "new size"])
def test_a_call_one_worker_makes_alone_is_refused_by_both_and_they_stay_in_step(odd):
    """Worker 0 hands in an empty tensor, or a size new to it where worker 1 calls a size it
    knows (each one MAX chunk). Both refuse that call; the agreement took no round number on
    one worker while its peer's MAX round took one, so every later round was refused as
    'different rounds'."""
    a = torch.full((1024,), 0.01)
    other = torch.empty(0) if odd == "empty" else torch.full((2048,), 0.01)
    out = _two_workers_calling(lambda w: (a, other if w == 0 else a, a, a), deadline=2.0)
    for w in (0, 1):
        first, refused, *later, rounds = out[w]
        assert "differ in their THC parameters" in str(refused), out
        assert all(r == pytest.approx(0.01, abs=0.002) for r in [first] + later), out
        assert rounds == 4, out


def test_workers_calling_known_sizes_in_different_orders_refuse_through_an_aggregator():
    """Both workers know 4- and 8-slice tensors; then worker 0 calls the short one while
    worker 1 calls the long one. The tag lanes sat after the norms, so each read them from a
    different lane: worker 0 took a mean of the two calls' tensors without an error."""
    # norms below the round lanes: read as tags, they passed as the peer's
    short, long_ = torch.full((1024,), 0.01), torch.full((2048,), 0.1)
    out = _two_workers_calling(lambda w: (short, long_, short if w == 0 else long_),
                               deadline=1.0)
    for w in (0, 1):
        assert out[w][0] == pytest.approx(0.01, abs=0.002), out
        assert out[w][1] == pytest.approx(0.1, abs=0.02), out
    assert "differ in their THC parameters" in str(out[0][2]), out
    assert isinstance(out[1][2], (RuntimeError, AggregationTimeout)), out


@pytest.mark.parametrize("pipeline_elements", [0, -(1 << 20), 1.5 * (1 << 20)])
def test_a_pipeline_length_that_cuts_nothing_is_refused_when_built(pipeline_elements):
    """0 and negative multiples of the slice size passed the check, then failed the first
    call with range()'s or an index error, before any collective: peers waited."""
    with pytest.raises(ValueError, match="pipeline_elements .* positive multiple"):
        THCAllReduce(object(), params=THCParams(slice_size=1 << 10),
                     pipeline_elements=pipeline_elements)
    ar = THCAllReduce(_Peer(None), params=THCParams(slice_size=1 << 10),
                      pipeline_elements=np.int64(1 << 20))
    assert ar.pipeline_elements == 1 << 20 and type(ar.pipeline_elements) is int


@pytest.mark.parametrize("kind", ["eager", "graphed"])
def test_a_table_that_cannot_be_made_fails_the_reducers_build_not_a_round(monkeypatch, kind):
    """A codec's lookup table is made on first use: on a transport that compares none, in
    round 0's fingerprint, before its MAX round. A failure there (out of memory) left the
    worker's peers waiting in a round it owed them, and its next call paired with theirs:
    every later round refused as out of step, the failure unnamed. Made when the reducer
    is built, it fails there, before any round."""
    import thc.codec.params as params_module
    from thc.collective.graphed import GraphedAllReduce

    def no_memory(*args):
        raise MemoryError("out of memory making the table")
    monkeypatch.setattr(params_module, "optimal_table", no_memory)
    build = THCAllReduce if kind == "eager" else GraphedAllReduce
    with pytest.raises(MemoryError, match="making the table"):
        build(_Peer(None), params=THCParams(slice_size=1 << 10))


def test_a_reducer_whose_error_feedback_would_diverge_is_refused_when_built():
    from thc.collective.graphed import GraphedAllReduce
    params = THCParams(bits=1, slice_size=1 << 10)
    for build in (THCAllReduce, GraphedAllReduce):
        with pytest.raises(ValueError, match="error_feedback=False"):
            build(_Peer(None), params=params)
        assert build(_Peer(None), params=params, error_feedback=False).params.bits == 1


def test_mismatched_table_is_refused():
    job = local_job(1, 2, free_port_block(2), table=list(range(0, 32, 2)))
    with AggregationClient(job, 0, ("127.0.0.1", 9), run=1) as c:
        with pytest.raises(ValueError, match="lookup table"):
            THCAllReduce.through_aggregator(c, PARAMS)


def _outsider_worker(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3)
    group = dist.new_group([0, 2])
    try:
        ar = THCAllReduce.through_torch_distributed(group=group, params=PARAMS)
        out = float(ar(torch.ones(1024)).mean())
    except ValueError as e:
        out = str(e)
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_reducer_built_outside_its_group_is_refused_naming_that():
    """A process outside the group took torch's rank -1 and world size -1 there, and failed
    on "Invalid process group specified", which did not say whose."""
    res = gloo_pair(_outsider_worker, world=3)
    assert res[0] == res[2] == pytest.approx(1.0, abs=0.05), res
    assert "not a member of the process group" in res[1], res


def _unlike_worker(rank, port, q):
    """Rounds whose workers differ in one thing each, then one where they agree."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    f32, half = torch.float32, (torch.float16, torch.bfloat16)
    cases = [(THCParams(slice_size=256, seed=rank), 1024, f32),                # the rotation
             (THCParams(slice_size=256, granularity=30 + 30 * rank), 1024, f32),  # the table
             (THCParams(slice_size=256), 1000 + 24 * rank, f32),               # the length
             (THCParams(slice_size=256), 1024 + 1024 * rank, f32),             # slice count
             (THCParams(slice_size=256), 1024, half[0] if rank else f32),      # the dtype: a
             (THCParams(slice_size=256), 1024, half[1] if rank else f32),      # cast apart
             (THCParams(slice_size=256), 1024, torch.float8_e4m3fn if rank else f32),
             (THCParams(slice_size=256), 1024, f32)]                           # alike
    out = []
    for params, numel, dtype in cases:
        ar = THCAllReduce.through_torch_distributed(params=params, generator=rank)
        try:
            out.append(float(ar(torch.ones(numel, dtype=dtype)).mean()))
        except RuntimeError as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_torch_distributed_workers_with_unlike_rounds_all_refuse():
    """Two workers that differ in seed, granularity or tensor length, unchecked, would decode
    each other's indices as their own: a wrong mean, different on each worker, and no error;
    with different slice counts Gloo would abort a process on MAX rounds of different
    lengths. Workers whose tensors differ in dtype would cast the same estimate apart
    (float16 held to 65504, bfloat16 rounded, float8 both): gradients that differ without an
    error."""
    res = gloo_pair(_unlike_worker)
    for rank in (0, 1):
        *refused, alike = res[rank]
        assert all("differ in their THC parameters" in r for r in refused), refused
        assert alike == pytest.approx(1.0, abs=0.1)


def _sized_calls(sizes, rank, port, q, every_round=True):
    """Call k's tensor is k + 1 everywhere (so is its mean), of ``sizes[rank][k]``
    elements; ``every_round=False``: rounds not agreed each time, as on NCCL."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256),
                                                generator=rank, error_feedback=False)
    ar.transport.agree_each_round = every_round
    out = []
    for k, numel in enumerate(sizes[rank]):
        try:
            out.append(float(ar(torch.full((numel,), k + 1.0)).mean()))
        except RuntimeError as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_workers_out_of_step_in_their_sizes_all_refuse():
    """An empty tensor took no round: the peer's round then paired with the worker's next
    call, a mean of two calls' tensors and no error. A size new to one worker but known to
    the other paired the agreement round with a MAX round, and Gloo aborted a process."""
    # worker 0 first hands in an empty tensor, and later a size it knows where worker 1
    # calls one new to it
    res = gloo_pair(functools.partial(_sized_calls, [[0, 1024, 2048, 1024, 1024],
                                                     [1024, 1024, 2048, 4096, 1024]]))
    for rank in (0, 1):
        out = res[rank]
        assert isinstance(out[0], str) and "differ in their THC parameters" in out[0], out
        # THC's estimate of a constant tensor's mean is 3% low (the clipping at t_p, p = 1/32)
        # with a standard deviation of 0.7%; a mean of two calls is at least 10% off
        assert out[1] == pytest.approx(2.0, rel=0.06) and out[2] == pytest.approx(3.0, rel=0.06)
        assert "differ in their THC parameters" in out[3], out
        assert out[4] == pytest.approx(5.0, rel=0.06), out


def test_a_size_new_to_every_worker_is_agreed_where_rounds_are_not():
    """Where rounds are not agreed each time (NCCL), a size new to a worker is: two sizes
    new to both workers ran MAX rounds of unlike lengths (Gloo aborted a process; NCCL
    hangs or sums garbage). Both refuse, and the next round runs."""
    res = gloo_pair(functools.partial(_sized_calls, [[1024, 2048, 1024], [1024, 4096, 1024]],
                                      every_round=False))
    for rank in (0, 1):
        out = res[rank]
        assert out[0] == pytest.approx(1.0, abs=0.2), out
        assert isinstance(out[1], str) and "differ in their THC parameters" in out[1], out
        assert out[2] == pytest.approx(3.0, abs=0.2), out


def _option_worker(option: str, values: tuple, rank, port, q):
    """One round whose reducer takes ``option`` as ``values[rank]``: its mean, or the error."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256),
                                                generator=rank, **{option: values[rank]})
    try:
        q.put((rank, float(ar(torch.ones(1024)).mean())))
    except RuntimeError as e:
        q.put((rank, str(e)))
    dist.destroy_process_group()


def test_workers_unlike_in_their_nonfinite_mode_are_told_so():
    """Their rounds' fingerprints differ: the refusal named every cause but that one."""
    res = gloo_pair(functools.partial(_option_worker, "nonfinite", ("raise", "propagate")))
    assert all("their nonfinite mode" in str(res[r]) for r in (0, 1)), res


def _missing_backend_worker(rank, port, q):
    import os
    from datetime import timedelta
    os.environ.pop("TRITON_INTERPRET", None)   # worker 0's backend cannot run its tensor
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256),
                                                generator=rank,
                                                backend="compiled" if rank else "triton")
    t0 = time.monotonic()
    try:
        ar(torch.ones(1024))
        q.put((rank, ("returned", time.monotonic() - t0)))
    except RuntimeError as e:
        q.put((rank, (str(e), time.monotonic() - t0)))
    dist.destroy_process_group()


def test_a_worker_whose_backend_cannot_run_fails_at_once_and_so_does_its_peer():
    """Naming the backend in the fingerprint raised before anything was sent on the worker
    that lacks its backend: its peer waited out the process group's timeout."""
    res = gloo_pair(_missing_backend_worker)
    (own, t_own), (peer, t_peer) = res[0], res[1]
    assert "triton" in own and "codec backend" in peer, res
    assert t_own < 20 and t_peer < 20, res


def test_workers_decoding_on_different_backends_refuse():
    """The compiled and the reference decode differ in their last bits: workers on different
    backends returned different means of the same sums, and DDP's replicas drifted apart."""
    res = gloo_pair(functools.partial(_option_worker, "backend", ("compiled", "reference")))
    assert all("their codec backend" in str(res[r]) for r in (0, 1)), res


def _skipping_worker(rank, port, q, kind):
    """Two like-sized reducers, A and B, called in turn; worker 1 skipped A's first call, so
    each of its calls meets the other reducer's on worker 0."""
    from thc.collective.marsit import MarsitAllReduce
    join_gloo(rank, port)
    if kind.startswith("thc"):
        # "thc-named": A named 0, B by its build order, the first on the group: 0 as well;
        # "thc-one-name": both given one name
        names = {"thc-named": {"a": 0}, "thc-one-name": {"a": "g", "b": "g"}}.get(kind, {})
        a, b = (THCAllReduce.through_torch_distributed(
            params=THCParams(slice_size=256), generator=rank,
            **({"name": names[r]} if r in names else {})) for r in "ab")
    else:
        a, b = (MarsitAllReduce(None, compensation=False) for _ in "ab")
    calls = [(a, torch.full((256,), 1.0 + rank)), (b, torch.full((256,), -100.0 - rank))] * 3
    if rank == 1:
        calls = calls[1:] + calls[:1]
    out = []
    for reducer, x in calls:
        try:
            out.append(float(reducer(x).mean()))
        except RuntimeError as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["thc", "marsit", "thc-named", "thc-one-name"])
def test_a_round_of_one_reducer_never_pairs_with_anothers(kind):
    """Round numbers count per reducer: A's call k on one worker and B's call k on another
    carried the same tags, and every worker took the sum of the two (THC's means near -48
    for true means 1.5 and -100.5). Each reducer's build order is now in its fingerprint,
    a name given is kept apart from the build orders (``name=0`` was the first unnamed
    reducer's), and a name given twice counts its uses (the two summed into each other)."""
    res = gloo_pair(functools.partial(_skipping_worker, kind=kind))
    for rank in (0, 1):
        assert all(isinstance(r, str) and "which reducer it is" in r for r in res[rank]), res


def _named_worker(rank, port, q):
    """Reducers named alike but built in another order on each rank, and one built before
    the default group was made again."""
    join_gloo(rank, port)
    params = THCParams(slice_size=256)
    stale = THCAllReduce.through_torch_distributed(params=params, generator=rank)
    again = [free_tcp_port()]
    dist.broadcast_object_list(again)
    dist.destroy_process_group()
    join_gloo(rank, again[0])
    order = ["w1", "w2"] if rank == 0 else ["w2", "w1"]
    named = {n: THCAllReduce.through_torch_distributed(params=params, generator=rank, name=n)
             for n in order}
    out = [float(named[n](torch.full((256,), 1.0 + rank)).mean()) for n in ("w1", "w2")]
    try:
        stale(torch.ones(256))
        out.append("the stale reducer ran")
    except RuntimeError as e:
        out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_named_reducers_pair_by_name_and_a_replaced_group_is_refused():
    """By build order alone, ranks that built their per-parameter reducers in another order
    refused every round; and a reducer built before the default group was made again took
    the same place in the order as the first one built after, and their rounds paired."""
    res = gloo_pair(_named_worker)
    for rank in (0, 1):
        *means, stale = res[rank]
        assert means == [pytest.approx(1.5, abs=0.1)] * 2, res
        assert "the process group this reducer was built on was replaced" in stale, res


@pytest.mark.parametrize("generator, error", [(-1, ValueError), (1 << 64, ValueError),
                                              (1.5, TypeError), (True, TypeError)])
def test_a_generator_the_codec_refuses_is_refused_before_any_round(generator, error):
    from thc.collective.graphed import GraphedAllReduce

    class Transport:
        packed, lanes, stream_ordered = False, None, True

        def check(self, params):
            pass

    with pytest.raises(error, match="generator"):
        THCAllReduce(Transport(), PARAMS, generator=generator)
    with pytest.raises(error, match="generator"):
        GraphedAllReduce(Transport(), PARAMS, generator=generator)


class _CudaGenerator(torch.Generator):
    """A generator that says it lives on a GPU (as torch.Generator("cuda") does), beside CPU
    tensors: the codec refuses it in encode, after the MAX round had left."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _misplaced_generator_worker(rank, port, q):
    join_gloo(rank, port)
    gen = _CudaGenerator() if rank == 0 else torch.Generator().manual_seed(rank)
    ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=gen,
                                                backend="reference")
    t0 = time.monotonic()
    try:
        ar(torch.randn(1024, generator=torch.Generator().manual_seed(rank)))
        q.put((rank, ("returned", 0.0)))
    except Exception as e:  # noqa: BLE001 - the test reads what each worker raised
        q.put((rank, (str(e), time.monotonic() - t0)))
        time.sleep(2)   # alive while the peer finishes: its collectives must not need it


def test_a_generator_on_another_device_fails_both_workers_at_once():
    """The worker whose generator is elsewhere raised after its MAX round, in encode, and
    abandoned the group: its peer waited in the sum until the group's timeout. Refused as
    input is, its round goes out marked and both raise at once."""
    res = gloo_pair(_misplaced_generator_worker)
    assert "the torch generator is on cuda:0" in res[0][0], res
    assert "mark of a worker" in res[1][0] and res[1][1] < 20, res


@pytest.mark.parametrize("other", [(5 + (1 << 20), 77), (5 + (1 << 39), 77),
                                   (5, 77 + (1 << 24)), (5, 77 + (1 << 47))])
def test_rounds_or_fingerprints_that_differ_only_in_high_bits_are_refused(other):
    """Rounds travelled modulo 2^20 and fingerprints (crc32) modulo 2^24: a worker 2^20
    rounds off its peer, or one whose fingerprint differed only above, passed the check and
    decoded its peer's indices under another rotation. Both now travel as two parts."""
    from thc.collective import agreement
    norms = torch.ones(3)
    mine = agreement.tagged(norms, 5, 77)
    theirs = agreement.tagged(norms, *other)
    _, tags = agreement.untag(torch.maximum(mine, theirs))
    assert not agreement.agreed(tags.tolist()) and not bool(agreement.in_step(tags))
    with pytest.raises(RuntimeError, match="different rounds" if other[1] == 77 else "differ in"):
        agreement.check_rounds(tags)
    _, same = agreement.untag(torch.maximum(mine, agreement.tagged(norms, 5, 77)))
    assert agreement.agreed(same.tolist()) and bool(agreement.in_step(same))
    rnd = torch.tensor([other[0]])   # a graphed round's number, on the device
    assert torch.equal(agreement.tagged(norms, rnd, other[1]), theirs)


class _Recorder:
    """A one-worker transport of a given rank that keeps the indices it is asked to sum."""
    packed, lanes, short_chunks, n_workers = False, None, None, 1

    def __init__(self, rank):
        self.rank, self.bytes_sent, self.summed = rank, 0, []

    def check(self, params):
        pass

    def max(self, vector):
        return vector

    def sum(self, indices, count, params, classes=None):
        self.summed.append(indices.clone())
        return table_values(indices, params).to(torch.int32), None


def test_workers_without_a_generator_draw_unlike_roundings_though_seeded_alike():
    """Training scripts seed torch alike on every rank: with no generator, every worker drew
    its rounding key from torch's global generator, the same on all, so their rounding errors
    were one error n times and the mean's did not shrink. The default key holds the rank."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    reducers = [THCAllReduce(_Recorder(rank), PARAMS, error_feedback=False) for rank in (0, 1)]
    for ar in reducers:
        torch.manual_seed(0)
        ar(x)
    wires = [ar.transport.summed[0] for ar in reducers]
    assert (wires[0] != wires[1]).float().mean() > 0.05
    assert [ar.generator for ar in reducers] == [agreement.rounding_key(ar.transport, ar.name)
                                                 for ar in reducers]


def test_reducers_of_one_worker_draw_unlike_roundings():
    """Keyed by the rank alone, every reducer of a worker drew alike in a round: a DDP hook's
    buckets took one set of rounding uniforms, equal inputs came out equal and the errors of
    unlike ones correlated. The default key holds the reducer's name too."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    worker = _Recorder(0)
    a, b = (THCAllReduce(worker, PARAMS, error_feedback=False) for _ in range(2))
    a(x)
    b(x)
    assert (worker.summed[0] != worker.summed[1]).float().mean() > 0.05
    assert a.generator != b.generator
    same = THCAllReduce(_Recorder(0), PARAMS, error_feedback=False, generator=a.generator)
    same(x)
    assert torch.equal(same.transport.summed[0], worker.summed[0])


def _two_groups_and_two_hooks_worker(rank, port, q):
    """The first reducers of two groups, and two hooks on two copies of one model, each pair
    given the same input: whether each pair's results are equal."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import THCHook
    join_gloo(rank, port)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3 + rank))
    a, b = (THCAllReduce.through_torch_distributed(dist.new_group([0, 1]), PARAMS,
                                                   error_feedback=False) for _ in range(2))
    groups = torch.equal(a(x), b(x))
    torch.manual_seed(0)
    base = torch.nn.Linear(256, 256)
    grads = []
    for _ in range(2):
        model = copy.deepcopy(base)
        ddp = DDP(model)
        THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
            group, PARAMS, error_feedback=False)).register(ddp)
        ddp(x[:1024].view(4, 256)).square().sum().backward()
        grads.append(model.weight.grad.clone())
    q.put((rank, (groups, torch.equal(*grads))))
    dist.destroy_process_group()


def test_reducers_of_two_groups_and_two_hooks_draw_unlike_roundings():
    """A reducer's name is its build order on its group, and a hook renames its buckets'
    reducers once built: keyed by rank and build order, the first reducers of two groups drew
    alike, and so did two hooks' buckets."""
    res = gloo_pair(_two_groups_and_two_hooks_worker)
    assert res == {0: (False, False), 1: (False, False)}, res


def test_two_threads_reducers_on_one_client_never_take_each_others_sums():
    """Two reducers share one client on each of two workers, each driven by a thread of its
    own (two hooks' threads, say). The client took one exchange at a time, so a round's
    exchanges could interleave with the other reducer's: here both workers' size agreements
    and MAX rounds ran A's then B's, then worker 0 sent A's DATA first and worker 1 B's, and
    each took a sum of A's tensor and B's that passed every check. A reducer now holds the
    client for its whole round: the schedule asked for cannot happen (each step of it waits
    a moment, then goes), and every sum returned is its own reducer's."""
    job = local_job(1, 2, free_port_block(2), pool_size=32)
    params = THCParams(seed=3, slice_size=256)
    order = {0: ["A max", "A max", "B max", "B max", "A sum", "B sum"],
             1: ["A max", "A max", "B max", "B max", "B sum", "A sum"]}
    turn = threading.Condition()
    done = {0: 0, 1: 0}

    def gated(w, step, call):
        def run(*a, **k):
            with turn:   # its turn in the schedule, or on after a moment
                turn.wait_for(lambda: order[w][done[w]:done[w] + 1] == [step], timeout=1.0)
            try:
                return call(*a, **k)
            finally:
                with turn:
                    done[w] = min(done[w] + 1, len(order[w]) - 1)
                    turn.notify_all()
        return run

    g = torch.Generator().manual_seed(0)
    xs = {(w, n): torch.randn(1024, generator=g) * (1 if n == "A" else 100)
          for w in (0, 1) for n in "AB"}
    out: dict = {}
    with Aggregator([job]) as agg:
        addr = agg.start()
        clients = [AggregationClient(job, w, addr, run=5, deadline=10.0) for w in (0, 1)]
        reducers = {}
        for w in (0, 1):
            for n in "AB":
                ar = THCAllReduce.through_aggregator(clients[w], params, generator=w,
                                                     error_feedback=False)
                ar.transport.max = gated(w, f"{n} max", ar.transport.max)
                ar.transport.sum = gated(w, f"{n} sum", ar.transport.sum)
                reducers[w, n] = ar

        def work(key):
            try:
                out[key] = reducers[key](xs[key])
            except Exception as e:  # noqa: BLE001 - a refusal is an outcome, a wrong sum not
                out[key] = e
        ts = [threading.Thread(target=work, args=(k,)) for k in reducers]
        [t.start() for t in ts]
        [t.join(60) for t in ts]
        [c.close() for c in clients]
    assert not any(t.is_alive() for t in ts) and set(out) == set(reducers), out
    for (w, n), got in out.items():
        if isinstance(got, Exception):
            assert "different" in str(got), got   # rounds paired unlike: refused
            continue
        mean = (xs[0, n] + xs[1, n]) / 2
        assert float((got - mean).norm() / mean.norm()) < 0.3, (w, n)


def _threads_on_one_client_worker(job, addr, rank, port, q):
    """Two threads on each of two ranks, each with a reducer on a process group of its own,
    all sharing one client; rank 0 starts A's round first, rank 1 B's: how long each thread's
    round took, and how it ended."""
    from datetime import timedelta
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    groups = {n: dist.new_group() for n in "AB"}
    client = AggregationClient(job, rank, addr, run=7, deadline=5.0)
    ars = {n: THCAllReduce.through_aggregator(client, THCParams(seed=3, slice_size=256),
                                              groups[n], generator=rank) for n in "AB"}
    out = {}

    def work(n):
        start = time.monotonic()
        try:
            ars[n](torch.ones(1024))
            got = "ok"
        except RuntimeError as e:
            got = str(e)
        out[n] = (time.monotonic() - start, got)
    first, second = ("A", "B") if rank == 0 else ("B", "A")
    ts = [threading.Thread(target=work, args=(n,)) for n in (first, second)]
    ts[0].start()
    time.sleep(0.5)
    ts[1].start()
    [t.join() for t in ts]
    q.put((rank, out))


def test_rounds_on_one_client_in_unlike_orders_are_refused_at_once():
    """Each rank holds its client for a round's whole length, and its transport agreed the
    run over its group when it was built: rounds that the ranks start in unlike orders meet
    at their MAX rounds and are refused at once. (Agreed inside the round instead, each
    rank's first round held the client in an all-gather whose peer waited for its own
    client: both waited out the group's timeout, naming nothing.)"""
    job = local_job(1, 2, free_port_block(2), pool_size=32)
    with Aggregator([job]) as agg:
        res = gloo_pair(functools.partial(_threads_on_one_client_worker, job, agg.start()))
    for rank in (0, 1):
        for took, got in res[rank].values():
            assert took < 10 and "the workers' rounds differ" in got, res


@pytest.mark.parametrize("kind", ["thc", "marsit"])
def test_two_threads_reducers_on_one_process_group_never_take_each_others_sums(kind):
    """THC's integer sums and Marsit's scales and ring carry no tag of their round: a
    reducer on another thread whose exchange went first on one rank paired its tensors with
    this reducer's on the other, and both decoded a wrong mean (THC: relative error about 1),
    unlike on each rank, with no error. A reducer holds the group for its whole round, as
    one over an aggregator holds its client."""
    assert_each_round_its_own(gloo_pair(functools.partial(_threads_on_one_group_worker,
                                                          kind=kind)))


def test_a_reducer_rebuilt_under_its_name_is_its_names_next_use(alone):
    """Told apart by its uses of the name, not by whether the first still lives (a queued
    piece of its last round, or an error's frames, may hold it a while): a rebuild is never
    refused, and never pairs with the reducer it replaces."""
    make = lambda: THCAllReduce.through_torch_distributed(  # noqa: E731
        params=THCParams(slice_size=256), name="w")
    first = make()
    again = make()
    assert (first.name, again.name) == (("named", "w", 0), ("named", "w", 1))
    assert again(torch.ones(256)).shape == (256,)


def _shaped_worker(rank, port, q, kind):
    """One tensor of 256 elements, (2, 128) on rank 0 and (128, 2) on rank 1, then alike."""
    from thc.collective.marsit import MarsitAllReduce
    join_gloo(rank, port)
    ar = (THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256),
                                                 generator=rank, error_feedback=False)
          if kind == "thc" else MarsitAllReduce(None, compensation=False))
    x = torch.arange(256.0).reshape(2, 128)
    out = []
    for t in (x if rank == 0 else x.t().contiguous(), x):
        try:
            out.append(tuple(ar(t).shape))
        except RuntimeError as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["thc", "marsit"])
def test_tensors_of_one_length_in_unlike_shapes_are_refused(kind):
    """(2, 128) on one rank and (128, 2) on the other summed one's rows with the other's
    columns, and each rank read the mean back in its own shape: the same parameter left
    different on each, without an error. The shape is in the round's fingerprint."""
    res = gloo_pair(functools.partial(_shaped_worker, kind=kind))
    for rank in (0, 1):
        refused, alike = res[rank]
        assert isinstance(refused, str) and "shape" in refused, refused
        assert alike == (2, 128), res
