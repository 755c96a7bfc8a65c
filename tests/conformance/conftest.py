"""Run every conformance test against every aggregator implementation."""
from __future__ import annotations

import pytest


def _software():
    from tests.conformance.software import SoftwareHarness
    return SoftwareHarness()


def _sharded():
    from tests.conformance.software import ShardedSoftwareHarness
    return ShardedSoftwareHarness(n_shards=2)


def _need_compiled():
    from thc.net import fastagg
    if not fastagg.available():
        pytest.skip(f"compiled aggregator skipped: {fastagg.UNAVAILABLE}")


def _compiled():
    _need_compiled()
    from tests.conformance.software import SoftwareHarness
    return SoftwareHarness(compiled=True)


def _sharded_compiled():
    _need_compiled()
    from tests.conformance.software import ShardedSoftwareHarness
    return ShardedSoftwareHarness(n_shards=2, compiled=True)


def _bmv2():
    for name in ("grpc", "p4runtime_sh"):   # a project module's import error fails
        pytest.importorskip(name, reason=f"the BMv2 harness needs {name}")
    from tests.bmv2.harness import BMv2Harness, bmv2_available
    ok, reason = bmv2_available()
    if not ok:
        pytest.skip(f"BMv2 conformance skipped: {reason}")
    return BMv2Harness()


HARNESSES = {"software": _software, "compiled": _compiled, "sharded": _sharded,
             "sharded-compiled": _sharded_compiled, "bmv2": _bmv2}


@pytest.fixture(scope="module", params=list(HARNESSES))
def harness(request):
    h = HARNESSES[request.param]()
    yield h
    h.close()
