"""DLCP on the switch: a packet of every class aggregates (each priority has its queue) and
an unknown DSCP is counted. Which priority each DSCP sets is read from the compiled program
(tests/test_p4_build.py): BMv2 does not say which queue a packet took."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from thc.controller import counters
from thc.controller.frames import udp_frame
from thc.wire import protocol as P
from tests.bmv2.packets import check_result, data, random_indices

pytestmark = pytest.mark.bmv2
_ids = itertools.count(900)


def send_with_tos(bmv2, job, worker, datagram, tos):
    ep = bmv2.endpoint(job, worker)
    ep.switch.send(ep.port, udp_frame(ep.mac, ep.agg_mac, ep.ip, ep.agg_ip, ep.udp_port,
                                      P.UDP_PORT, datagram, ident=1, tos=tos))


@pytest.mark.parametrize("dscp,known", [(0, True)] + [(d, True) for d in P.PRIORITY_DSCP]
                         + [(5, False), (63, False)])
def test_every_class_aggregates_and_unknown_dscps_are_counted(bmv2, sw, dscp, known):
    """Each class has a queue (BMv2 would drop a priority without one: started with
    --priority-queues P.PRIORITY_QUEUES); unknown DSCPs go best effort and are counted."""
    job = bmv2.make_job(next(_ids), 2, pool_size=4)
    bmv2.install(job)
    rng = np.random.default_rng(dscp)
    idxs = [random_indices(rng, job) for _ in range(2)]
    before = counters.dscp_unknown(sw)
    for w in range(2):
        send_with_tos(bmv2, job, w, data(job, w, 0, idxs[w]), dscp << 2 | 1)   # ECN bit set
    got = bmv2.recv_each({w: bmv2.endpoint(job, w) for w in range(2)})
    for w in range(2):
        check_result(got[w], job, 0, idxs, w)
    assert counters.dscp_unknown(sw) - before == (0 if known else 2)
