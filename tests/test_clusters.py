"""Port blocks of local jobs: pytest-xdist's processes draw from disjoint shares of the ports
below the ephemeral range, so a block one process found free and closed again cannot be
taken by another's block before its workers bind it."""
from __future__ import annotations

import pytest

from thc.testing.clusters import _below_ephemeral, free_port_block


def _blocks(n: int = 16, draws: int = 60) -> set[int]:
    return {free_port_block(n) for _ in range(draws)}


@pytest.mark.parametrize("count", [2, 3])
def test_each_process_draws_from_its_own_share(monkeypatch, count):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
    shares = []
    for k in range(count):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{k}")
        shares.append(_blocks())
    for lower, upper in zip(shares, shares[1:]):
        assert max(lower) + 16 <= min(upper), (max(lower), min(upper))


def test_one_process_draws_below_the_ephemeral_range(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    blocks = _blocks()
    assert min(blocks) >= 10000 and max(blocks) + 16 <= _below_ephemeral()


def test_a_block_handed_out_is_not_handed_out_again_while_it_may_be_unbound(monkeypatch):
    """A job's 16 ports, then its aggregator's: the second block once fell inside the first
    (closed again until the workers bind it), and a worker found its port taken. Drawn from
    40 free ports, a single port lands in the 16 four times in ten."""
    import collections

    from thc.testing import clusters
    low = clusters.free_port_block(40)
    monkeypatch.setattr(clusters, "_GIVEN", collections.deque(maxlen=64))
    monkeypatch.setattr(clusters, "_block_range", lambda n: (low, low + 40 - n))
    first = clusters.free_port_block(16)
    later = [clusters.free_port_block(1) for _ in range(20)]
    assert not any(first <= p < first + 16 for p in later), (first, later)


def test_tcp_ports_are_never_handed_out_twice_nor_by_two_processes(monkeypatch):
    """A switch's gRPC and Thrift ports, two probes in a row: the kernel gave the second the
    port the first had just closed, and simple_switch_grpc could not bind its Thrift server
    (a Mininet testbed of the suite, once); another process's probe may draw it too. TCP
    ports now come from the process's share, as blocks do, each free for TCP when drawn."""
    import socket

    from thc.testing.clusters import free_tcp_port
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    shares = []
    for k in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{k}")
        shares.append([free_tcp_port() for _ in range(40)])
    for ports in shares:
        assert len(set(ports)) == len(ports), ports
    for lower, upper in zip(shares, shares[1:]):
        assert max(lower) < min(upper), (max(lower), min(upper))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", shares[0][-1]))
