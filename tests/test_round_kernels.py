"""A graphed round's own kernels (thc.collective.round_kernels) against the torch steps of
thc.collective.agreement they stand for, bit for bit, on vectors drawn to hit every branch:
NaN, infinities, the marks, norms at the limit, tag pairs off by one or NaN, flags set. A
graphed worker and an eager one may be peers, so the MAX round's vector must be the same,
and a round's verdict must be what the host's checks say."""
import numpy as np
import pytest
import torch

from tests.test_codec_kernels import DEV, kernels
from thc.codec.common import NORM_MARK, OVERFLOW_MARK, STATUS_WORDS, norm_limit
from thc.codec.params import THCParams
from thc.collective import agreement

LIMIT = norm_limit(THCParams(slice_size=256))
SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, OVERFLOW_MARK, NORM_MARK, LIMIT,
           float(np.nextafter(np.float32(LIMIT), np.float32(0))), 1e-30]


def _norms(rng, n):
    v = torch.from_numpy(rng.lognormal(0, 4, n).astype(np.float32))
    for i in rng.choice(n, size=min(n, int(rng.integers(0, 4))), replace=False):
        v[i] = SPECIAL[rng.integers(len(SPECIAL))]
    return v.to(DEV)


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int64)


@kernels
def test_the_max_rounds_vector_is_agreements():
    from thc.collective import round_kernels
    rng = np.random.default_rng(1)
    for case in range(40):
        n = int(rng.choice([0, 1, 3, 255, 1024, 1025, 2600]))
        norms = _norms(rng, n)
        rnd = int(rng.integers(0, 1 << 45)) if case % 3 else int(rng.integers(0, 3))
        key = int(rng.integers(0, 1 << 62)) if case % 5 else int(rng.integers(0, 3))
        want = agreement.tagged(norms, rnd, key)
        got = round_kernels.tagged(norms, torch.tensor([rnd], device=DEV), key)
        assert torch.equal(_bits(got), _bits(want)), (case, n, rnd, key)


def _maxima(rng, n):
    """A MAX round's result: tags of one round and fingerprint, or of several (a pair off by
    one, or NaN), then max norms (a NaN among them: a collective that passes NaN on)."""
    key = int(rng.integers(0, 1 << 48))
    v = agreement.tagged(_norms(rng, n), int(rng.integers(0, 1 << 40)), key)
    kind = rng.integers(4)
    lane = int(rng.integers(agreement.TAG_LANES))
    if kind == 1:
        v[lane] += 1.0
    elif kind == 2:
        v[lane] = float("nan")
    if n and rng.integers(3) == 0:
        v[agreement.TAG_LANES + int(rng.integers(n))] = float("nan")
        if rng.integers(2):
            v[agreement.TAG_LANES + int(rng.integers(n))] = OVERFLOW_MARK
    return v


@kernels
def test_a_rounds_verdict_is_what_agreement_says():
    from thc.collective import round_kernels
    rng = np.random.default_rng(2)
    seen = set()
    for case in range(60):
        n = int(rng.choice([0, 1, 4, 1024, 1500]))
        maxima = _maxima(rng, n)
        word = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=DEV)
        if rng.integers(3) == 0:
            word[0] = int(rng.choice([1, 2, 4, 8]))
            word[1:] = torch.from_numpy(rng.integers(0, 1 << 20, STATUS_WORDS - 1))
        max_norms, tags = agreement.untag(maxima)
        clean = (word[0] == 0) & agreement.in_step(tags)
        over = agreement.overflowed_on_device(max_norms, tags, LIMIT)
        want = torch.cat([word.double(), tags.double(), over.double().reshape(1)])
        start = int(rng.integers(0, 1 << 40)) if case % 4 else (1 << 40) - 1
        rnd = torch.tensor([start], device=DEV)
        b_clean = torch.zeros((), dtype=torch.bool, device=DEV)
        b_over = torch.ones((), dtype=torch.bool, device=DEV)
        report = torch.full((STATUS_WORDS + agreement.TAG_LANES + 1,), -7.0,
                            dtype=torch.float64, device=DEV)
        round_kernels.settle(word, maxima, b_clean, b_over, report, rnd, LIMIT)
        assert bool(b_clean) == bool(clean) and bool(b_over) == bool(over), case
        torch.testing.assert_close(report, want, rtol=0, atol=0, equal_nan=True)
        assert int(rnd) == agreement.round_draw(start + 1)   # 2^40 - 1 moves on to 0
        seen.add((bool(clean), bool(over)))
    assert seen == {(True, False), (False, False), (True, True), (False, True)}


@pytest.mark.parametrize("n", [0, 1])
@kernels
def test_small_vectors(n):
    """No slice and one slice: the grids' edges."""
    from thc.collective import round_kernels
    norms = torch.full((n,), 2.5, device=DEV)
    got = round_kernels.tagged(norms, torch.tensor([7], device=DEV), 9)
    assert torch.equal(got, agreement.tagged(norms, 7, 9))


@kernels
def test_the_verdict_reads_max_norms_past_the_first_block():
    """A bucket of more slices than one block of the kernel: the overflow and the NaN that
    vetoes it sit past it."""
    from thc.collective import round_kernels
    for nan, want in ((False, True), (True, False)):
        norms = torch.full((1500,), 2.0, device=DEV)
        norms[1300] = OVERFLOW_MARK
        maxima = agreement.tagged(norms, 5, 6)
        if nan:
            maxima[agreement.TAG_LANES + 1400] = float("nan")
        word = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=DEV)
        clean = torch.zeros((), dtype=torch.bool, device=DEV)
        over = torch.zeros((), dtype=torch.bool, device=DEV)
        report = torch.zeros(STATUS_WORDS + agreement.TAG_LANES + 1, dtype=torch.float64,
                             device=DEV)
        round_kernels.settle(word, maxima, clean, over, report, torch.tensor([5], device=DEV),
                             LIMIT)
        assert bool(over) is want is bool(agreement.overflowed_on_device(
            *agreement.untag(maxima), LIMIT))


@kernels
def test_the_residual_is_torchs_where():
    from thc.collective import round_kernels
    rng = np.random.default_rng(3)
    for n in (256, 1024, 5000):
        y = _norms(rng, n) * torch.from_numpy(rng.choice([-1.0, 1.0], n).astype(np.float32)).to(DEV)
        own = _norms(rng, n)
        for clean in (True, False):
            c = torch.tensor(clean, device=DEV)
            res = _norms(rng, n)
            want = torch.where(c, y - own, res)
            round_kernels.keep_residual(y, own, c, res)
            assert torch.equal(_bits(res), _bits(want)), (n, clean)
