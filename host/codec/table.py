"""THC's lookup table: 2^b integers in {0..g} chosen offline to minimise quantization variance.

After rotation and scaling, coordinates are close to N(0, 1); truncated to ±t_p and mapped onto
u in [0, g], each is rounded stochastically to its neighbouring table values a <= u <= b, which
costs variance (u - a)(b - u). The table minimises the expected cost under the truncated normal
(a 1001-point grid, as in the authors' code). Values are integers so that the switch adds
integers; the table is symmetric about g/2 so that the decoder's zero point is g/2.

``thc table`` (host/app/table.py) prints the table for given (bits, granularity, p).
"""
from __future__ import annotations

from functools import lru_cache
from statistics import NormalDist

import numpy as np

GRID_POINTS = 1001


def truncation_threshold(p: float) -> float:
    """Two-sided normal quantile t_p with P(|Z| > t_p) = p: the lower tail's quantile, which
    keeps p's digits where 1 - p/2 loses them (at p = 3e-16 that tail held 0.74 p)."""
    return -NormalDist().inv_cdf(p / 2.0)


def _check(bits: int, granularity: int, p: float | None = None) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if granularity < (1 << bits) - 1:
        raise ValueError(f"granularity {granularity} is too small for {bits} bits: 2^{bits} "
                         f"distinct integer values need granularity >= {(1 << bits) - 1}")
    if p is not None and not 0.0 < p < 1.0:
        raise ValueError(f"p must lie strictly between 0 and 1, got {p}")


@lru_cache(maxsize=64)
def _grid(granularity: int, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Grid points u in [0, g] and their weights (truncated normal density, summing to 1)."""
    t = truncation_threshold(p)
    z = np.linspace(-t, t, GRID_POINTS)
    w = np.exp(-0.5 * z * z)
    w /= w.sum()
    u = (z + t) * (granularity / (2.0 * t))
    return u, w


def table_objective(table, p: float, granularity: int) -> float:
    """Sum over the grid of w(u)(u - a)(b - u): expected rounding variance in u units."""
    table = np.asarray(table, dtype=np.float64)
    u, w = _grid(int(granularity), float(p))
    j = np.clip(np.searchsorted(table, u, side="right") - 1, 0, table.size - 2)
    lo, hi = table[j], table[j + 1]
    return float(np.sum(w * (u - lo) * (hi - u)))


def expected_variance(table, p: float, granularity: int) -> float:
    """Per-coordinate variance of stochastic rounding in the rotated, scaled (z) domain,
    given that the coordinate was not truncated."""
    t = truncation_threshold(p)
    return table_objective(table, p, granularity) * (2.0 * t / granularity) ** 2


def truncation_mse(p: float) -> float:
    """E[(|Z| - t_p)^2; |Z| > t_p] for Z ~ N(0, 1): the error clamping adds per coordinate."""
    t = truncation_threshold(p)
    nd = NormalDist()
    return 2.0 * ((1.0 + t * t) * (p / 2.0) - t * nd.pdf(t))


def expected_nmse(table, p: float, granularity: int) -> float:
    """Model of one worker's NMSE on a Gaussian-like rotated vector: rounding variance of the
    untruncated coordinates plus the truncation error. n workers give about this over n."""
    return (1.0 - p) * expected_variance(table, p, granularity) + truncation_mse(p)


def _interval_costs(granularity: int, p: float) -> np.ndarray:
    """C[a, b] = sum over grid u in [a, b] of w(u)(u - a)(b - u), for integers 0 <= a < b <= g."""
    u, w = _grid(granularity, p)
    p0 = np.concatenate(([0.0], np.cumsum(w)))
    p1 = np.concatenate(([0.0], np.cumsum(w * u)))
    p2 = np.concatenate(([0.0], np.cumsum(w * u * u)))
    pts = np.arange(granularity + 1, dtype=np.float64)
    lo = np.searchsorted(u, pts, side="left")
    hi = np.searchsorted(u, pts, side="right")
    a = pts[:, None]
    b = pts[None, :]
    s0 = p0[hi][None, :] - p0[lo][:, None]
    s1 = p1[hi][None, :] - p1[lo][:, None]
    s2 = p2[hi][None, :] - p2[lo][:, None]
    cost = -s2 + (a + b) * s1 - a * b * s0
    cost = np.maximum(cost, 0.0)
    cost[np.tril_indices(granularity + 1)] = np.inf
    return cost


@lru_cache(maxsize=256)
def _optimal_table(bits: int, granularity: int, p: float) -> np.ndarray:
    g = granularity
    half = 1 << (bits - 1)
    m_max = (g - 1) // 2
    cost = _interval_costs(g, p)
    idx = np.arange(m_max + 1)
    # cost of interval [a, v] in the lower half plus its mirror [g - v, g - a]
    pair = cost[np.ix_(idx, idx)] + cost[np.ix_(g - idx, g - idx)].T
    f = np.full(m_max + 1, np.inf)
    f[0] = 0.0
    back = []
    for _ in range(half - 1):
        total = f[:, None] + pair
        arg = np.argmin(total, axis=0)
        f = total[arg, idx]
        back.append(arg)
    middle = cost[idx, g - idx]
    m = int(np.argmin(f + middle))
    lower = [m]
    for arg in reversed(back):
        lower.append(int(arg[lower[-1]]))
    lower = np.array(lower[::-1], dtype=np.int64)
    table = np.concatenate((lower, g - lower[::-1]))
    table.setflags(write=False)
    return table


def optimal_table(bits: int = 4, granularity: int = 30, p: float = 1 / 32) -> np.ndarray:
    """The symmetric integer table minimising :func:`table_objective`, by dynamic programming.

    The DP runs over the lower half (values 0 = T[0] < ... < T[2^(b-1) - 1] <= (g-1)/2), each
    interval paying its own cost and its mirror's; the middle interval [m, g - m] closes it.
    Cost O(2^b g^2): fine up to g of a few thousand. Returns a read-only int64 array.
    """
    bits, granularity, p = int(bits), int(granularity), float(p)
    _check(bits, granularity, p)
    return _optimal_table(bits, granularity, p)


@lru_cache(maxsize=256)
def _uniform_table(bits: int, granularity: int) -> np.ndarray:
    n = 1 << bits
    half = n // 2
    lower = np.floor(np.arange(half) * (granularity / (n - 1)) + 0.5).astype(np.int64)
    table = np.concatenate((lower, granularity - lower[::-1]))
    table.setflags(write=False)
    return table


def uniform_table(bits: int = 4, granularity: int = 30) -> np.ndarray:
    """UHC's table: 2^b values as evenly spaced as integers allow.

    Lower half round(i*g/(2^b - 1)) (halves rounded up), upper half mirrored, so the table is
    symmetric and strictly increasing; exactly equally spaced when (2^b - 1) divides g (b=4,
    g=30 gives 0, 2, ..., 30).
    """
    bits, granularity = int(bits), int(granularity)
    _check(bits, granularity)
    return _uniform_table(bits, granularity)
