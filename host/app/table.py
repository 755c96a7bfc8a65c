"""``thc table``: print the optimal THC lookup table for (bits, granularity, p)."""
from __future__ import annotations

import argparse
import sys

import numpy as np

from thc.bench import add_common, emit_json
from thc.codec.params import THCParams
from thc.codec.table import (
    expected_nmse,
    expected_variance,
    optimal_table,
    table_objective,
    truncation_mse,
    uniform_table,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    THCParams.add_arguments(parser, seed=False)
    parser.add_argument("--uniform", action="store_true",
                        help="also print the uniform (UHC) table for comparison")
    add_common(parser, quick=False)


def _summary(table: np.ndarray, p: float, g: int) -> dict:
    return {"table": [int(v) for v in table],
            "objective": table_objective(table, p, g),
            "expected_variance": expected_variance(table, p, g),
            "expected_nmse_one_worker": expected_nmse(table, p, g)}


def run(args: argparse.Namespace) -> int:
    try:
        params = THCParams(bits=args.bits, granularity=args.granularity, p=args.p)
        table = optimal_table(params.bits, params.granularity, params.p)
    except ValueError as e:
        print(f"thc table: {e}", file=sys.stderr)
        return 2
    g, p = params.granularity, params.p
    result = {"bits": params.bits, "granularity": g, "p": p, "t_p": params.t_p,
              "truncation_mse": truncation_mse(p), "optimal": _summary(table, p, g)}
    uni = uniform_table(params.bits, g)
    result["uniform"] = _summary(uni, p, g)
    if args.json != "-":
        print(f"THC table for {params.describe()}")
        print(" ".join(str(int(v)) for v in table))
        o = result["optimal"]
        print(f"t_p = {params.t_p:.4f}  (P(|Z| > t_p) = {p:g})")
        print(f"expected rounding variance per coordinate (z units): {o['expected_variance']:.5f}")
        print(f"expected NMSE, one Gaussian worker: {o['expected_nmse_one_worker']:.5f} "
              f"(truncation part {result['truncation_mse']:.5f})")
        if args.uniform:
            u = result["uniform"]
            print(f"uniform table: {' '.join(str(int(v)) for v in uni)}")
            print(f"  expected variance {u['expected_variance']:.5f}, "
                  f"expected NMSE {u['expected_nmse_one_worker']:.5f}")
    emit_json(args, result)
    return 0
