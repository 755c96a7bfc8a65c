"""One BMv2 switch running a variant of thc.p4 with a short run idle time, for this package.

Package scope, like tests/bmv2's switch, which is closed before this one starts
(p4runtime-shell allows one P4Runtime session per process). The variant differs from the
committed program in THC_RUN_IDLE_US alone: the generator writes both from the same code, so
the committed program's minute is the same comparison on another constant
(``gen_p4.py --check`` ties that constant to protocol.json)."""
from __future__ import annotations

import pytest

from thc.controller import toolchain
from tests.bmv2.harness import bmv2_available

IDLE_S = 4.0
"""The variant's run idle time."""


@pytest.fixture(scope="package")
def idle_switch(tmp_path_factory):
    ok, reason = bmv2_available()
    if not ok:
        pytest.skip(f"BMv2 tests skipped: {reason}")
    why = toolchain.p4c_missing()
    if why:
        pytest.skip(f"the idle rule's BMv2 tests build a variant of thc.p4: {why}")
    from thc.controller.testing.variant import build_variant
    from tests.bmv2.harness import BMv2Harness
    build = tmp_path_factory.mktemp("idle-variant")
    build_variant(build, run_idle_s=IDLE_S)
    h = BMv2Harness(build_dir=build)
    yield h
    h.close()
