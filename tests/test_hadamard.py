"""Fast Walsh–Hadamard transform, random diagonals and slice layout, numpy and torch."""
import math

import numpy as np
import pytest
import torch

from thc.codec.hadamard import (
    SliceLayout,
    fwht,
    hadamard_matrix,
    irht,
    next_pow2,
    random_signs,
    rht,
)


def _sylvester(n: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of order n, built here: the reference fwht and
    hadamard_matrix (which fwht uses for its small factors) are both checked against."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.kron(h, np.array([[1.0, 1.0], [1.0, -1.0]]))
    return h


@pytest.mark.parametrize("n", [1, 2, 4, 8, 32, 64, 512, 2048])
def test_fwht_matches_dense_matrix(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((3, n)).astype(np.float32)
    assert np.array_equal(hadamard_matrix(int(math.log2(n))), _sylvester(n))
    dense = x.astype(np.float64) @ _sylvester(n) / math.sqrt(n)
    assert np.allclose(fwht(x), dense, atol=1e-4)
    assert np.allclose(fwht(torch.from_numpy(x)).numpy(), dense, atol=1e-4)


def test_fwht_is_orthonormal_and_leaves_input_alone():
    x = np.random.default_rng(0).standard_normal(1 << 14).astype(np.float32)
    keep = x.copy()
    y = fwht(x)
    assert np.array_equal(x, keep)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-5)
    assert np.allclose(fwht(y), x, atol=1e-5)
    t = torch.from_numpy(x)
    fwht(t)
    assert np.array_equal(t.numpy(), keep)


def test_numpy_and_torch_bit_identical_on_exact_inputs():
    """Small integers and n = 4^k make every partial sum exact, so the two backends must agree
    bit for bit: the same factorization, not merely the same result."""
    x = np.random.default_rng(1).integers(-8, 9, size=(2, 4 ** 7)).astype(np.float32)
    a = fwht(x)
    b = fwht(torch.from_numpy(x)).numpy()
    assert np.array_equal(a, b)
    assert np.array_equal(rht(x[0], 3, 1, 2), rht(torch.from_numpy(x[0]), 3, 1, 2).numpy())


def test_fwht_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(np.zeros(12, np.float32))


def test_random_signs_shared_across_backends_and_keys():
    a = random_signs(1000, seed=5, round=2, slice_index=3)
    b = random_signs(1000, seed=5, round=2, slice_index=3, like=torch.zeros(1))
    assert a.dtype == np.float32 and set(np.unique(a)) == {-1.0, 1.0}
    assert np.array_equal(a, b.numpy())
    assert np.array_equal(a, random_signs(1000, 5, 2, 3))
    for other in [(6, 2, 3), (5, 3, 3), (5, 2, 4)]:
        assert not np.array_equal(a, random_signs(1000, *other))
    many = random_signs(64, 5, 2, [3, 4])
    assert np.array_equal(many[0], random_signs(64, 5, 2, 3))
    assert np.array_equal(many[1], random_signs(64, 5, 2, 4))
    big = random_signs(1 << 16, 0, 0, 0)
    assert abs(big.mean()) < 5 / math.sqrt(1 << 16)


@pytest.mark.parametrize("n", [1, 3, 5, 1000, 1024, 4097])
def test_rht_round_trip_with_padding(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    y = rht(x, seed=1, round=4, slice_index=0)
    assert y.shape == (next_pow2(n),)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-5)
    assert np.allclose(irht(y, 1, 4, 0, n=n), x, atol=1e-5)
    yt = rht(torch.from_numpy(x), 1, 4, 0)
    assert np.allclose(yt.numpy(), y, atol=1e-5)
    assert np.allclose(irht(yt, 1, 4, 0, n=n).numpy(), x, atol=1e-5)


def test_rht_rows_use_consecutive_slices():
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    y = rht(x, 9, 0, 5)
    for r in range(3):
        assert np.allclose(y[r], rht(x[r], 9, 0, 5 + r), atol=1e-6)


def test_rht_spreads_a_spike():
    """After rotation a one-hot vector becomes flat: the reason THC can use one scale."""
    x = np.zeros(4096, np.float32)
    x[17] = 1.0
    y = rht(x, 0)
    assert np.allclose(np.abs(y), 1 / 64, atol=1e-7)


def test_slice_layout():
    lay = SliceLayout(3 * 1024 + 5, 1024)
    assert lay.n_slices == 4 and lay.lengths == (1024, 1024, 1024, 5)
    assert lay.padded == (1024, 1024, 1024, 8) and lay.total_padded == 3 * 1024 + 8
    groups = list(lay.groups(2048))
    assert [(g.first, g.count, g.padded) for g in groups] == [(0, 2, 1024), (2, 1, 1024),
                                                              (3, 1, 8)]
    assert SliceLayout(0, 1024).total_padded == 0 and list(SliceLayout(0, 1024).groups()) == []
    assert SliceLayout(2048, 1024).tail == 0 and SliceLayout(2048, 1024).n_slices == 2
    assert SliceLayout(7, 1024).total_padded == 8
    with pytest.raises(ValueError):
        SliceLayout(10, 1000)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    x = torch.randn(3, 1 << 12)
    assert torch.allclose(fwht(x.cuda()).cpu(), fwht(x), atol=1e-5)
    assert torch.equal(random_signs(100, 1, 2, 3, like=x.cuda()).cpu(),
                       random_signs(100, 1, 2, 3, like=x))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_float64_input_keeps_float64s_precision(backend):
    """The scale was rounded to float32 for every input: a float64 slice came back from
    irht(rht(x)) off by 5e-8 (the codec's float32 path keeps its float32 scale)."""
    x = np.random.default_rng(1).standard_normal(32)
    x = torch.from_numpy(x) if backend == "torch" else x
    back = irht(rht(x, 1), 1)
    assert float(abs(back - x).max()) < 1e-12
