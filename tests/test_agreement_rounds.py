"""The MAX round's tag lanes (agreement.tagged, check_rounds) and the refusals around them,
played in-process: every worker's lanes are what its peers' maxima are read from, so a lane
that drops part of the round or the fingerprint lets unlike workers sum each other's rounds."""
from __future__ import annotations

import pytest
import torch

from thc.codec.common import NORM_MARK, OVERFLOW_MARK, NonFiniteInput
from thc.codec.params import THCParams
from thc.collective import agreement
from thc.collective.transports import DistTransport, paired, ring_bytes

P = THCParams(seed=7, slice_size=256)


def _maxima(*vectors: torch.Tensor) -> torch.Tensor:
    """A MAX all-reduce of the workers' vectors."""
    return torch.stack(vectors).max(dim=0).values


def _tags_of(*rounds_keys) -> torch.Tensor:
    return agreement.untag(_maxima(*(agreement.tagged(torch.zeros(0), r, k)
                                     for r, k in rounds_keys)))[1]


def test_rounds_apart_in_their_high_part_alone_are_refused():
    """A worker 2^20 rounds behind has the same low 20 bits: only the high part tells."""
    tags = _tags_of((5, 1), (5 + agreement.ROUND_SPAN, 1))
    assert not agreement.agreed(tags.tolist())
    assert not bool(agreement.in_step(tags))
    with pytest.raises(RuntimeError, match="different rounds"):
        agreement.check_rounds(tags)


def test_rounds_2_to_the_38_apart_are_refused():
    """The round lanes carry 40 bits: workers whose rounds differ below 2^40 are told."""
    tags = _tags_of((3, 1), (3 + (1 << 38), 1))
    with pytest.raises(RuntimeError, match="different rounds"):
        agreement.check_rounds(tags)


@pytest.mark.parametrize("bit", [0, 23, 24, 47])
def test_fingerprints_apart_in_one_bit_are_refused(bit):
    """A fingerprint's high 24 bits travel in their own pair: keys that differ there alone
    (unlike codecs) are told apart as surely as keys that differ in their low bits."""
    tags = _tags_of((2, 1 << 30), (2, (1 << 30) ^ (1 << bit)))
    assert not agreement.agreed(tags.tolist())
    assert not bool(agreement.in_step(tags))
    with pytest.raises(RuntimeError, match="differ in"):
        agreement.check_rounds(tags)
    assert not agreement.overflowed(torch.tensor([OVERFLOW_MARK]), tags, 1.0)


def test_workers_in_one_round_with_one_fingerprint_agree():
    tags = _tags_of((7, 99), (7, 99))
    assert agreement.agreed(tags.tolist()) and bool(agreement.in_step(tags))
    agreement.check_rounds(tags)


def test_an_infinite_norm_is_marked_as_an_overflow():
    """+Inf as well as NaN: a MAX round passing Inf on would read as a finite, huge norm."""
    marked, _ = agreement.untag(agreement.tagged(
        torch.tensor([1.0, float("inf"), float("nan")]), 0, 0))
    assert marked.tolist() == [1.0, OVERFLOW_MARK, OVERFLOW_MARK]


def test_a_max_norm_at_the_limit_is_an_overflow():
    """``norm_limit`` is the first norm THC refuses: every worker reads it as an overflow."""
    tags = _tags_of((1, 1))
    top = torch.tensor([2.0, 8.0])
    assert agreement.overflowed(top, tags, 8.0)
    assert bool(agreement.overflowed_on_device(top, tags, 8.0))


def test_nan_among_max_norms_is_marked_and_a_failures_mark_is_not_an_overflow():
    assert agreement.first_marked(torch.tensor([1.0, float("nan")])) == 1
    with pytest.raises(ValueError, match="failed before its sums"):
        agreement.refuse_marked(torch.zeros(2), torch.tensor([0.0, NORM_MARK]), P)
    with pytest.raises(NonFiniteInput):
        agreement.refuse_marked(torch.zeros(2), torch.tensor([0.0, OVERFLOW_MARK]), P)


def test_float64_and_float32_inputs_share_a_fingerprint():
    """Their estimates are the same numbers: workers holding either may sum together, while
    a half type (rounded otherwise) is told apart."""
    assert agreement.half_type(torch.float64) == ""
    keys = {agreement.fingerprint(P, 1024, dtype=d) for d in (None, torch.float32,
                                                               torch.float64)}
    assert len(keys) == 1
    assert agreement.fingerprint(P, 1024, dtype=torch.float16) not in keys


class _Alone:
    """A transport of one worker: its MAX round is its own vector."""

    def __init__(self):
        self.abandoned = None

    def max(self, v):
        return v

    def abandon(self, why, summed=False):
        self.abandoned = why


def test_an_empty_rounds_refusal_is_raised_after_the_agreement():
    """The agreement went well (every worker refused alike): this worker still raises its own
    refusal instead of returning an empty sum as if its input were taken."""
    refusal = TypeError("not a tensor")
    with pytest.raises(TypeError, match="not a tensor"):
        agreement.empty_round(_Alone(), 3, 5, "cpu", refusal)
    agreement.empty_round(_Alone(), 3, 5, "cpu", None)


def test_a_worker_whose_agreement_cannot_go_out_abandons_its_transport():
    """Its peers wait in the agreement: its next round would pair with theirs."""
    t = _Alone()
    with pytest.raises(TypeError):
        agreement.agree(t, "three", 5, "cpu")
    assert t.abandoned is not None and "agreement" in t.abandoned


def test_a_name_given_twice_names_two_reducers():
    """Two reducers given one name are told apart (the name's first and second)."""
    domain = _Alone()
    first, second = agreement.identify(domain, "x"), agreement.identify(domain, "x")
    assert first != second and agreement.given_name(first) == "x"


def test_a_replaced_group_is_refused():
    group, other = _Alone(), _Alone()
    agreement.check_domain(group, group)
    with pytest.raises(RuntimeError, match="replaced"):
        agreement.check_domain(group, other)


def test_a_failed_peers_mark_refuses_the_round_on_a_worker_that_did_not_fail(monkeypatch):
    """``together``: a peer that failed sends NORM_MARK; this worker, in step and alike, must
    raise rather than go on to collectives its peer skips (a wait, or a sum paired with the
    peer's next call)."""
    def with_peer(out, op=None, group=None):
        out.copy_(torch.maximum(out, agreement.tagged(torch.tensor([NORM_MARK]), 3, 9)))
    monkeypatch.setattr(agreement.dist, "all_reduce", with_peer)
    monkeypatch.setattr(agreement.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(agreement.DistTransport, "check_group", lambda group: None)
    with pytest.raises(RuntimeError, match="a worker failed"):
        agreement.together(None, 3, 9, torch.device("cpu"))


def test_a_failed_worker_sends_the_failure_mark_not_an_overflow(monkeypatch):
    """Its own failure (not an overflow) must reach its peers as NORM_MARK."""
    sent = []

    def all_reduce(out, op=None, group=None):
        sent.append(float(out[agreement.TAG_LANES]))
    monkeypatch.setattr(agreement.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(agreement.DistTransport, "check_group", lambda group: None)
    with pytest.raises(KeyError):
        agreement.together(None, 3, 9, torch.device("cpu"), KeyError("mine"))
    assert sent == [NORM_MARK]


def test_an_abandoned_group_keeps_its_first_reason_and_refuses_every_round():
    group = _Alone()
    DistTransport.abandon_group(group, "first")
    DistTransport.abandon_group(group, "second")
    with pytest.raises(RuntimeError, match="any more: first;"):
        DistTransport.check_group(group)


def test_an_odd_count_of_16_bit_sums_is_padded_into_whole_words():
    vals = torch.tensor([1, 2, 3], dtype=torch.int16)
    words = paired(vals)
    assert words.dtype == torch.int32 and words.numel() == 2
    assert words.view(torch.int16)[:3].tolist() == [1, 2, 3]


def test_ring_bytes_are_two_p_minus_one_over_p():
    assert ring_bytes(torch.zeros(8), 4) == 2 * 3 * 8 * 4 // 4
    assert ring_bytes(torch.zeros(8), 1) == 0


def test_an_empty_round_whose_input_was_refused_has_its_own_fingerprint():
    """An empty round has no slice to mark: only its key tells its peers that this worker
    refused its input, so that every worker raises, not this one alone."""
    assert agreement.fingerprint(P, 0, refused=True) != agreement.fingerprint(P, 0)
    tags = _tags_of((4, agreement.fingerprint(P, 0, refused=True)),
                    (4, agreement.fingerprint(P, 0)))
    with pytest.raises(RuntimeError, match="refused its input"):
        agreement.check_rounds(tags)


@pytest.mark.parametrize("unlike", [dict(backend="triton"), dict(steps="sum"),
                                    dict(nonfinite="propagate"), dict(reducer=1),
                                    dict(dtype=torch.bfloat16), dict(refused=True)])
def test_each_part_of_a_rounds_fingerprint_tells_workers_apart(unlike):
    """Workers whose sums would mean different things (another backend's estimate, a round
    that sums where its peer's stops, another reducer...) must hold different keys."""
    base = dict(backend="torch", steps="check")
    assert agreement.fingerprint(P, 1024, **base) != \
        agreement.fingerprint(P, 1024, **{**base, **unlike})


class _NoDist:
    """torch.distributed's all-reduce of one worker: the tensor as it is."""

    class ReduceOp:
        MAX = "max"

    @staticmethod
    def all_reduce(t, op=None, group=None):
        return None


def _dist_transport(group, workers=2) -> DistTransport:
    t = DistTransport.__new__(DistTransport)
    t.dist, t.group, t.n_workers, t.bytes_sent = _NoDist, group, workers, 0
    return t


def test_16_bit_sums_of_an_odd_count_come_back_that_long():
    """The pad lane that fills the last int32 word is not a coordinate of the tensor."""
    indices = torch.tensor([0, 1, 2], dtype=torch.uint8)
    sums, short = _dist_transport(_Alone(), workers=100).sum(indices, 3, P)   # int16 sums
    assert sums.dtype == torch.int16 and sums.numel() == 3 and short is None


def test_an_abandoned_groups_transport_sends_nothing():
    """Its MAX round and its sum are both refused: either would pair with a peer's pending
    collective of another round."""
    group = _Alone()
    t = _dist_transport(group)
    DistTransport.abandon_group(group, "gone")
    with pytest.raises(RuntimeError, match="gone"):
        t.max(torch.zeros(2))
    with pytest.raises(RuntimeError, match="gone"):
        t.sum(torch.zeros(3, dtype=torch.uint8), 3, P)


def test_a_skip_never_takes_a_round_back():
    """Each round draws its own rotation and rounding: a round taken again reuses them."""
    assert agreement.skipped_to(10, 3) == 10
    assert agreement.skipped_to(10, 10 + agreement.ROUNDS - 1) == 10 + agreement.ROUNDS - 1
    for bad in (10 + agreement.ROUNDS, True):
        with pytest.raises(ValueError, match="skip_to"):
            agreement.skipped_to(10, bad)


def test_workers_drawing_by_unlike_key_schedules_are_told_apart(monkeypatch):
    """A worker of an older release rotates by another generator: its indices summed with
    its peers' would decode to a wrong mean with no error."""
    from thc.codec import rng
    now = agreement.fingerprint(P, 1024)
    monkeypatch.setattr(rng, "SCHEDULE", rng.SCHEDULE - 1)
    assert agreement.fingerprint(P, 1024) != now
