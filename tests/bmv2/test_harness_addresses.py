"""The BMv2 harness hands each worker an address that is neither another worker's nor the
switch's (no switch needed)."""
from __future__ import annotations

import itertools
import types

import pytest

from tests.bmv2.harness import AGG_IP, AGG_MAC, BMv2Harness


def test_worker_addresses_skip_the_switchs_own():
    """Port 0's 254th address would be the switch's MAC, 02:00:00:00:00:fe."""
    h = types.SimpleNamespace(_addr=itertools.count(250))
    got = [BMv2Harness._new_address(h, 0) for _ in range(10)]
    assert AGG_MAC not in [mac for mac, _, _ in got]
    assert AGG_IP not in [ip for _, ip, _ in got]
    assert len({mac for mac, _, _ in got}) == len({ip for _, ip, _ in got}) == 10
    assert [port for *_, port in got] == [20000 + k for k in range(250, 261) if k != 254]


def test_the_addresses_end_before_the_udp_ports_do():
    h = types.SimpleNamespace(_addr=itertools.count(0xFFFF - 20000))
    assert BMv2Harness._new_address(h, 1)[2] == 0xFFFF
    with pytest.raises(RuntimeError, match="every worker address"):
        BMv2Harness._new_address(h, 1)
