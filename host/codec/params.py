"""THC parameters: one frozen object that every worker, the aggregator and the switch agree on.

All workers of a job must use the same parameters (and the same rotation seed): the integer
sums on the switch only mean something when every worker quantized onto the same table, with
the same truncation threshold and the same random rotation.
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np

from thc.codec.table import optimal_table, truncation_threshold, uniform_table

TABLE_KINDS = ("optimal", "uniform")
MAX_GRANULARITY = (1 << 31) - 1
MAX_OPTIMAL_GRANULARITY = 4096

MAX_SLICE_SIZE = 1 << 32
"""The compiled codec numbers a coordinate within its slice in 32 bits."""


P_RANGE = (1e-16, 1.0 - 2e-16)
"""The p a codec takes: t_p from 8.3 down to 2.8e-16."""


def _threshold_of(p: float) -> float | None:
    """t_p, or None outside P_RANGE or where float64 makes it infinite or zero."""
    if not P_RANGE[0] <= p <= P_RANGE[1]:
        return None
    try:
        t = truncation_threshold(p)
    except ValueError:     # statistics.StatisticsError
        return None
    return t if math.isfinite(t) and t > 0 else None


def fraction_value(text: str) -> float:
    """``1/32``, ``0.03125`` or ``3.125e-2`` as a float; ValueError for anything else, a
    value no float holds included. Its length and exponent are bounded first: Fraction
    builds 10**exponent, which for 1e1000000000 takes minutes."""
    text = text.strip()
    if len(text) > 64 or re.search(r"[eE][+-]?0*\d{4}", text):
        raise ValueError(f"{text[:40]!r} is too long or too large a number")
    try:
        value = float(Fraction(text))
    except (ZeroDivisionError, OverflowError):
        raise ValueError(f"{text!r} is no finite number") from None
    return value


def parse_fraction(text: str | float) -> float:
    """Accept ``1/32``, ``0.03125`` or ``3.125e-2`` (argparse ``type=`` helper)."""
    if isinstance(text, (int, float)):
        return float(text)
    try:
        return fraction_value(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or fraction: {text[:40]!r}") from None


@dataclass(frozen=True)
class THCParams:
    """Codec parameters shared by a job.

    ``bits``: index width b (2^b table entries); ``granularity``: g, the largest table value,
    so sums of n workers lie in [0, n*g]; ``p``: truncation probability (coordinates beyond
    ±t_p are clamped); ``seed``: shared seed of the random rotation; ``slice_size``: longest
    slice rotated as a whole (power of two; the authors cap at 2^23); ``table_kind``:
    ``optimal`` (THC's DP table) or ``uniform`` (UHC, equally spaced values).
    """

    bits: int = 4
    granularity: int = 30
    p: float = 1 / 32
    seed: int = 0
    slice_size: int = 2 ** 20
    table_kind: str = "optimal"

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, np.integer)) \
                or not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be an integer in 1..8, got {self.bits!r}")
        levels = (1 << int(self.bits)) - 1
        if isinstance(self.granularity, bool) or not isinstance(self.granularity,
                                                                (int, np.integer)) \
                or self.granularity < levels:
            raise ValueError(f"granularity must be an integer >= 2^bits - 1 = {levels} "
                             f"(the table needs 2^{self.bits} distinct values in 0..g), "
                             f"got {self.granularity!r}")
        if not (isinstance(self.p, (int, float, np.floating)) and not isinstance(self.p, bool)
                and 0.0 < float(self.p) < 1.0 and _threshold_of(float(self.p)) is not None):
            raise ValueError(f"p must lie between 0 and 1 and give a finite, positive "
                             f"truncation threshold t_p = -Phi^-1(p/2) in float64 (p from "
                             f"1e-16 to 1 - 2e-16), got {self.p!r}")
        if self.granularity > MAX_GRANULARITY:
            raise ValueError(f"granularity must be at most 2^31 - 1 (table values are int32), "
                             f"got {self.granularity!r}")
        if self.table_kind == "optimal" and self.granularity > MAX_OPTIMAL_GRANULARITY:
            raise ValueError(f"an optimal table's dynamic program holds (g + 1)^2 costs: its "
                             f"granularity must be at most {MAX_OPTIMAL_GRANULARITY} (seconds and "
                             f"0.7 GB there), got {self.granularity!r}; a larger g takes "
                             f"table_kind='uniform'")
        s = self.slice_size
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 or s & (s - 1) \
                or s > MAX_SLICE_SIZE:
            raise ValueError(f"slice_size must be a power of two in [1, 2^32], got {s!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) \
                or not 0 <= self.seed < 1 << 64:
            raise ValueError(f"seed must be an integer in [0, 2^64), got {self.seed!r}")
        if self.table_kind not in TABLE_KINDS:
            raise ValueError(f"table_kind must be one of {TABLE_KINDS}, got {self.table_kind!r}")
        object.__setattr__(self, "bits", int(self.bits))
        object.__setattr__(self, "granularity", int(self.granularity))
        object.__setattr__(self, "p", float(self.p))
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "slice_size", int(s))

    @property
    def levels(self) -> int:
        """Number of table entries, 2^bits."""
        return 1 << self.bits

    @property
    def t_p(self) -> float:
        return truncation_threshold(self.p)

    @property
    def table(self) -> np.ndarray:
        """The lookup table (a fresh copy of the cached one, so callers cannot corrupt it)."""
        if self.table_kind == "uniform":
            return uniform_table(self.bits, self.granularity).copy()
        return optimal_table(self.bits, self.granularity, self.p).copy()

    def replace(self, **changes) -> "THCParams":
        return replace(self, **changes)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, *, seed: bool = True) -> None:
        """``--bits --granularity --p [--seed]`` with the defaults above."""
        group = parser.add_argument_group("THC parameters")
        group.add_argument("--bits", type=int, default=4, help="index width b (default 4)")
        group.add_argument("--granularity", "-g", type=int, default=30,
                           help="largest table value g (default 30)")
        group.add_argument("--p", type=parse_fraction, default=1 / 32,
                           help="truncation probability, e.g. 1/32 or 0.03125 (default 1/32)")
        if seed:
            group.add_argument("--seed", type=int, default=0, help="shared rotation seed")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> "THCParams":
        kw = dict(bits=args.bits, granularity=args.granularity, p=args.p,
                  seed=getattr(args, "seed", 0))
        kw.update(overrides)
        return cls(**kw)

    def describe(self) -> str:
        frac = Fraction(self.p).limit_denominator(1 << 20)
        p_text = f"{frac}" if math.isclose(float(frac), self.p, rel_tol=1e-12) else f"{self.p:g}"
        return (f"b={self.bits} g={self.granularity} p={p_text} t_p={self.t_p:.4f} "
                f"table={self.table_kind}")
