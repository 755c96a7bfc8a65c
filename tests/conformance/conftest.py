"""Run every conformance test against every aggregator implementation."""
from __future__ import annotations

import pytest


def _software():
    from tests.conformance.software import SoftwareHarness
    return SoftwareHarness()


def _compiled():
    from host.net import fastagg
    if not fastagg.available():
        pytest.skip(f"compiled aggregator skipped: {fastagg.UNAVAILABLE}")
    from tests.conformance.software import SoftwareHarness
    return SoftwareHarness(compiled=True)


def _bmv2():
    try:
        from tests.bmv2.harness import BMv2Harness, bmv2_available
    except ImportError as e:
        pytest.skip(f"BMv2 harness not importable: {e}")
    ok, reason = bmv2_available()
    if not ok:
        pytest.skip(f"BMv2 conformance skipped: {reason}")
    return BMv2Harness()


@pytest.fixture(scope="module", params=["software", "compiled", "bmv2"])
def harness(request):
    h = {"software": _software, "compiled": _compiled, "bmv2": _bmv2}[request.param]()
    yield h
    h.close()
