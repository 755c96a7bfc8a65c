"""Names that both THC programs (p4src/thc.p4 for BMv2, p4src/thc_tna.p4 for Tofino) give the
tables, actions and counters the controller uses.

Names are short (the part after the last dot): the programs may place them under different
controls, and controller/switch.py resolves a short name that is unique in the P4Info. Only
the lookup tables differ between the programs; their names are in controller/targets/.
tests/test_p4info_shared.py checks that both committed P4Infos agree on everything listed
here: key names and widths, action parameter names and widths, counter sizes.
"""
from __future__ import annotations

JOB_TABLE = "thc_job"
WORKER_TABLE = "thc_worker"
INSTALL_TABLE = "thc_install"
ADDR_TABLE = "thc_worker_addr"
L2_TABLE = "l2_forward"
DSCP_TABLE = "thc_dscp"

WORKER_PORT_KEY = "ingress_port"
"""The worker table's key on the switch port a worker's packets come in at: the controller
writes each worker's ``switch_port`` there, so a host on another port is no worker."""

SET_JOB = "set_job"
SET_WORKER = "set_worker"
SET_INSTALL = "set_install"
SET_WORKER_ADDR = "set_worker_addr"
L2_SET_PORT = "l2_set_port"
L2_MISS = "l2_miss"

TABLE_ACTIONS = {
    JOB_TABLE: (SET_JOB,),
    WORKER_TABLE: (SET_WORKER,),
    INSTALL_TABLE: (SET_INSTALL,),
    ADDR_TABLE: (SET_WORKER_ADDR,),
    L2_TABLE: (L2_SET_PORT, L2_MISS),
    DSCP_TABLE: ("thc_set_priority", "thc_dscp_miss"),
}
"""Each shared table and the actions of it that the controller writes or relies on."""

DROPS = "thc_drops"
JOB_COUNTERS = "thc_job_counters"
RESETS = "thc_resets"
L2_MISSES = "l2_misses"

COUNTERS = (DROPS, JOB_COUNTERS, RESETS, L2_MISSES)
"""The counters the controller reads in both programs (indexed alike: controller/counters.py)."""


def short_name(name: str) -> str:
    return name.rsplit(".", 1)[-1]
