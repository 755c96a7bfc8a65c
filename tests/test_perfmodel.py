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


def test_marsit_moves_a_bit_per_coordinate():
    s = Setup(params=8e6, workers=4, bandwidth_gbps=1.0, latency_us=0.0, compute_s=0.0)
    t = iteration_s(s)
    assert t["marsit_ring"] == pytest.approx(ring_allreduce_s(1e6, s))
    assert t["fp32_ring"] == pytest.approx(32 * t["marsit_ring"])


def test_calibration_recovers_alpha_and_efficiency_and_predicts_the_rest():
    """A report made by the model itself (alpha 5 ms, efficiency 0.8): the fit finds both
    from FP32 and Marsit, predicts THC over all-reduce exactly, and a slower run shows."""
    from host.app.perfmodel import FIT_MODES, calibrate, ddp_buckets, fit

    params, steps = 1_200_000, 100
    truth = Setup(params=params, workers=4, bandwidth_gbps=0.1, latency_us=5000.0,
                  compute_s=0.04, overlap=1.0, efficiency=0.8, buckets=ddp_buckets(params),
                  lanes=1444, agg_pps=86e3, agg_bw_factor=4, codec_mbps=4 * params / 0.1 / 1e6)
    t = iteration_s(truth)

    def run(mode, scheme, factor=1.0, codec=None):
        exposed = (t[scheme] - truth.compute_s) * steps
        return {"mode": mode, "params": params, "testbed": "mininet",
                "train_seconds": factor * t[scheme] * steps,
                "history": [{"steps": steps, "exposed_comm_seconds": exposed,
                             "codec_seconds": codec}]}

    report = {"args": {"workers": 4, "bw": 100.0, "software_lanes": 1444},
              "runs": [run("fp32", "fp32_ring"), run("marsit", "marsit_ring"),
                       run("thc-dist", "thc_allreduce", codec=0.1 * steps),
                       run("topk", "topk_allgather", factor=1.5)]}
    alpha, eff = fit(report)
    assert alpha == pytest.approx(0.005, rel=1e-6) and eff == pytest.approx(0.8, rel=1e-6)
    rows = {r["mode"]: r for r in calibrate(report)}
    assert {m for m, r in rows.items() if r["fitted"]} == set(FIT_MODES)
    assert rows["thc-dist"]["error"] == pytest.approx(0.0, abs=1e-6)
    assert rows["topk"]["error"] == pytest.approx(1 / 1.5 - 1, rel=1e-6)
    again = {r["mode"]: r for r in calibrate(report, alpha, eff)}
    assert not any(r["fitted"] for r in again.values())
    with pytest.raises(ValueError, match="marsit"):
        fit({**report, "runs": report["runs"][:1] + report["runs"][2:]})


def test_vote_moves_a_bit_up_and_an_8_bit_count_down():
    from host.app.perfmodel import vote_wire_bytes
    s = Setup(params=2048 * 1000, workers=4, bandwidth_gbps=1.0, latency_us=0.0, compute_s=0.0,
              lanes=2048)
    up, down = vote_wire_bytes(s)
    per_packet = 14 + 20 + 8 + 28
    assert up == pytest.approx(1000 * (per_packet + 256))
    assert down == pytest.approx(1000 * (per_packet + 2048))
    assert iteration_s(s)["marsit_vote"] == pytest.approx(down / s.bw)


def test_software_aggregator_rate_and_its_link_bound_a_round():
    fast = Setup(params=1e6, workers=4, bandwidth_gbps=0.1, latency_us=0.0, compute_s=0.0)
    slow = Setup(**{**fast.__dict__, "agg_pps": 1e3})
    assert iteration_s(slow)["thc_switch"] > 10 * iteration_s(fast)["thc_switch"]
    thin = Setup(**{**fast.__dict__, "agg_bw_factor": 1.0})
    assert iteration_s(thin)["thc_switch"] > 3 * iteration_s(fast)["thc_switch"]


def test_dlcp_loss_bound_saves_the_retransmissions_and_the_timeout():
    s = Setup(params=1e6, workers=4, bandwidth_gbps=0.1, latency_us=0.0, compute_s=0.0)
    clean = iteration_s(s)
    lossy = iteration_s(Setup(**{**s.__dict__, "loss": 0.02, "loss_bound": 0.05}))
    assert clean["thc_switch_dlcp"] == pytest.approx(clean["thc_switch"])
    assert lossy["thc_switch"] > lossy["thc_switch_dlcp"] + 0.9 * s.rto_s
    assert lossy["thc_switch_dlcp"] == pytest.approx(clean["thc_switch"])
    tight = iteration_s(Setup(**{**s.__dict__, "loss": 0.02, "loss_bound": 0.01}))
    assert lossy["thc_switch_dlcp"] < tight["thc_switch_dlcp"] < lossy["thc_switch"]
