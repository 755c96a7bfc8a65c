"""The performance model reproduces the qualitative findings it is built on."""
from __future__ import annotations

import pytest

from host.app.perfmodel import Setup, break_even_gbps, iteration_s, ring_allreduce_s


def test_ring_cost_formula():
    s = Setup(workers=4, bandwidth_gbps=8.0, latency_us=0.0)
    # 2 b (p-1) / (p BW): 1 GB over 1 GB/s with p=4 -> 1.5 s.
    assert ring_allreduce_s(1e9, s) == pytest.approx(1.5)


def test_compression_does_not_pay_when_compute_hides_communication():
    s = Setup(params=1e6, bandwidth_gbps=100.0, compute_s=0.5)
    t = iteration_s(s)
    assert t["fp32_ring"] < t["thc_switch"]


def test_compression_pays_on_slow_links():
    s = Setup(params=25e6, bandwidth_gbps=0.1, compute_s=0.05)
    t = iteration_s(s)
    assert t["fp32_ring"] / t["thc_switch"] > 3


def test_break_even_separates_the_two_regimes():
    s = Setup(params=25e6, compute_s=0.05)
    be = break_even_gbps(s)
    assert be is not None and 0.001 < be < 1e4
    below = iteration_s(Setup(**{**s.__dict__, "bandwidth_gbps": be / 2}))
    above = iteration_s(Setup(**{**s.__dict__, "bandwidth_gbps": be * 2}))
    assert below["thc_switch"] < below["fp32_ring"]
    assert above["thc_switch"] >= above["fp32_ring"]
