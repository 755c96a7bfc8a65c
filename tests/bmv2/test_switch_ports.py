"""thc.p4 knows a worker by its switch port as well as its addresses: a host on another port
that sends with a worker's MAC, IP and UDP port is no worker of the job (``unknown_worker``),
so its values never enter a sum and no reply goes back out of its port. The software
aggregator has no ports; docs/protocol.md, "What the protocol does not defend against"."""
from __future__ import annotations

import numpy as np
import pytest

from thc.controller.frames import udp_frame
from thc.wire import protocol as P
from tests.bmv2.harness import AGG_IP, AGG_MAC
from tests.conformance.rounds import (assert_result, data, drops_delta, indices, new_job,
                                      run_round)

pytestmark = pytest.mark.bmv2


def test_a_worker_forged_from_another_port_is_not_summed(bmv2):
    job = new_job(bmv2, n_workers=2, pool_size=4)
    w0 = job.worker(0)
    assert w0.switch_port != bmv2.stranger_port
    rng = np.random.default_rng(5)
    idxs = [indices(rng, job) for _ in range(2)]
    forged = (idxs[0] + 1) % 16
    before = bmv2.drops()
    for seq in (0, 1):   # ahead of worker 0, and again after its round closed
        bmv2.switch.send(bmv2.stranger_port, udp_frame(
            w0.mac, AGG_MAC, w0.ip, AGG_IP, w0.port, P.UDP_PORT, data(job, 0, seq, forged)))
        assert bmv2.endpoint(job, 0).recv_all() == []   # a reply to the forger lands here
        assert drops_delta(before, bmv2.drops()) == {"unknown_worker": seq + 1}
        got = run_round(bmv2, job, seq, idxs)
        for w in range(2):
            assert_result(got[w], job, seq, idxs, w)
