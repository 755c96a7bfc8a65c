"""One BMv2 switch for every test in tests/bmv2 (started once: pushing the pipeline takes seconds).

Package scope, so it is gone before tests/conformance starts its own (p4runtime-shell allows
one P4Runtime session per process).
"""
from __future__ import annotations

import pytest

from tests.bmv2.harness import bmv2_available


@pytest.fixture(scope="package")
def bmv2():
    ok, reason = bmv2_available()
    if not ok:
        pytest.skip(f"BMv2 tests skipped: {reason}")
    from tests.bmv2.harness import BMv2Harness
    h = BMv2Harness()
    yield h
    h.close()


@pytest.fixture
def sw(bmv2):
    return bmv2.sw
