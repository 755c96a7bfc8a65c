"""Counters of the THC program, by the names protocol.json gives them.

  thc_drops          index = drop reason code (protocol.json ``drop_reasons``)
  thc_job_counters   index = job_index * len(job_counters) + job_counters[name]; the switch
                     counts each packet once, so its "packets" cell holds only packets that
                     got no reply: job_counters() adds the reply cells to report every
                     aggregated packet, as the software aggregator does
  thc_resets         index = job_index: RESET packet-outs applied (the controller waits on it)
  l2_misses          index 0: non-THC frames without an l2_forward entry
  thc_dscp_unknown   index 0: IPv4 packets whose DSCP is neither 0 nor a priority class
                     (protocol.json ``priority_dscp``): forwarded best effort
  thc_lost_passes    index 0 (Tofino): copies of a RESULT that egress withheld: a pass of
                     its use was lost on the recirculation port, or the RESULT is a late
                     pass's of a use that another opening replaced
"""
from __future__ import annotations

from thc.controller.program import DROPS, JOB_COUNTERS, JOB_TABLE, L2_MISSES, RESETS
from thc.controller.switch import Switch
from thc.wire import protocol as P

DSCP_UNKNOWN = "thc_dscp_unknown"
LOST_PASSES = "thc_lost_passes"


def drops(sw: Switch) -> dict[str, int]:
    """Dropped THC packets by reason name."""
    cells = sw.read_counter(DROPS)
    return {name: cells.get(code, 0) for name, code in P.DropReason.__members__.items()}


def job_counter_index(job_index: int, name: str) -> int:
    return job_index * len(P.JOB_COUNTERS) + P.JOB_COUNTERS[name]


def _events(cells: dict[int, int], job_index: int) -> dict[str, int]:
    out = {name: cells.get(job_counter_index(job_index, name), 0) for name in P.JOB_COUNTERS}
    out["packets"] = sum(out.values())
    return out


def job_counters(sw: Switch, job_index: int) -> dict[str, int]:
    """Per-job events (packets, completions, retransmissions, pending) of one job index."""
    return _events(sw.read_counter(JOB_COUNTERS), job_index)


def all_job_counters(sw: Switch, installed: dict[int, dict]) -> dict[int, dict[str, int]]:
    """{job_id: counters} of the ``installed`` jobs ({job_id: {"job_index": ...}}, as
    thc.controller.installed.installed_jobs reads them)."""
    cells = sw.read_counter(JOB_COUNTERS)
    return {jid: _events(cells, cfg["job_index"]) for jid, cfg in installed.items()}


def clear_job_counters(sw: Switch, job_index: int) -> bool:
    """Zero one job index's counters; False if the switch cannot write counters (a refused
    write raises SwitchError)."""
    return sw.reset_counter(JOB_COUNTERS, [job_counter_index(job_index, n)
                                           for n in P.JOB_COUNTERS])


def resets(sw: Switch, job_index: int) -> int:
    return sw.read_counter(RESETS).get(job_index, 0)


def l2_misses(sw: Switch) -> int:
    return sw.read_counter(L2_MISSES).get(0, 0)


def dscp_unknown(sw: Switch) -> int:
    return sw.read_counter(DSCP_UNKNOWN).get(0, 0)


def snapshot(sw: Switch, installed: dict[int, dict] | None = None) -> dict:
    """Everything, JSON-ready (``thc controller counters``); per-job counters of ``installed``."""
    out = {"l2_misses": l2_misses(sw)}
    if sw.has_table(JOB_TABLE):      # the THC program (l2.p4 has only l2_misses)
        out["drops"] = drops(sw)
        if DSCP_UNKNOWN in sw.counters:
            out["dscp_unknown"] = dscp_unknown(sw)
        if LOST_PASSES in sw.counters:
            out["lost_passes"] = sw.read_counter(LOST_PASSES).get(0, 0)
        out["jobs"] = {str(k): v for k, v in all_job_counters(sw, installed or {}).items()}
    return out
