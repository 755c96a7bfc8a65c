"""The in-memory switch (controller/testing/memswitch.py) answers as BMv2 does, so that the
controller's tests on it (tests/test_jobs_safety.py, test_jobs_install.py) hold on BMv2:
the same install leaves the same entries, groups and reset counts, and the same bad updates
are refused with the same codes."""
from __future__ import annotations

import itertools
import re
import time

import pytest

from thc.controller import counters, forwarding, installed, job_entries, jobs, program
from thc.controller.switch import SwitchError
from thc.controller.testing.memswitch import MemorySwitch
from tests.bmv2.harness import AGG_IP, AGG_MAC
from tests.test_memswitch import BAD_RESET_DROPS, BAD_UPDATES, bad_resets, raw_job_entry

pytestmark = pytest.mark.bmv2
_ids = itertools.count(800)


@pytest.fixture
def mem():
    s = MemorySwitch().connect()
    yield s
    s.close()


def job_state(sw, job) -> dict:
    """What ``job`` owns on a switch, as canonical bytes (the epoch left out)."""
    luts = installed.lut_tables(sw)
    state = {t: sorted(map(installed.canonical, installed.entries_of(sw, t, job.job_id)))
             for t in (program.WORKER_TABLE, program.ADDR_TABLE, luts[0], luts[-1])}
    cfg = dict(installed.installed_jobs(sw)[job.job_id])
    cfg.pop("epoch")
    routes = forwarding.routes(sw)
    return {**state, "job": cfg, "group": sw.multicast_groups()[job.mcast_grp],
            "routes": {w.mac: routes.get(w.mac) for w in job.workers},
            "resets": counters.resets(sw, cfg["job_index"])}


def test_an_install_leaves_the_same_state(bmv2, sw, mem):
    job = bmv2.make_job(next(_ids), 3, pool_size=4)
    agg = job_entries.AggAddress(AGG_IP, AGG_MAC)
    index = jobs.install_job(sw, job, agg, force=True)
    bmv2._installed[job.job_id] = index
    before = counters.resets(sw, index)
    jobs.install_job(sw, job, agg, force=True)              # a re-install resets the pool again
    jobs.install_job(mem, job, agg, job_index=index)
    jobs.install_job(mem, job, agg, force=True)
    real, fake = job_state(sw, job), job_state(mem, job)
    assert real.pop("resets") - before == 2 * job.pool_size
    assert fake.pop("resets") == 4 * job.pool_size
    assert real == fake
    assert installed.unchanged(sw, job, agg) and installed.unchanged(mem, job, agg)


def _code(error: SwitchError) -> str:
    return re.search(r"first: ([A-Z_]+)", str(error)).group(1)


@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_the_same_updates_are_refused_with_the_same_code(sw, mem, case):
    entity, code, _ = BAD_UPDATES[case]
    codes = []
    for s in (sw, mem):
        with pytest.raises(SwitchError) as e:
            s.write_entries("INSERT", [entity(s)])
        codes.append(_code(e.value))
    assert codes == [code, code]


def test_exists_and_not_found_answer_alike(sw, mem):
    codes = []
    for s in (sw, mem):
        entry = raw_job_entry(s, 4000)
        s.write_entries("INSERT", [entry])
        try:
            with pytest.raises(SwitchError) as twice:
                s.write_entries("INSERT", [entry])
            s.write_entries("DELETE", [entry])
            with pytest.raises(SwitchError) as gone:
                s.write_entries("DELETE", [entry])
            with pytest.raises(SwitchError) as modify:
                s.write_entries("MODIFY", [entry])
        finally:
            s.write_entries("DELETE", [entry], ignore=["NOT_FOUND"])
        codes.append([_code(e.value) for e in (twice, gone, modify)])
    assert codes[0] == codes[1] == ["ALREADY_EXISTS", "NOT_FOUND", "NOT_FOUND"]


def test_a_full_table_and_groups_out_of_range_are_refused_alike(sw, mem):
    """The fake answered a full table RESOURCE_EXHAUSTED, BMv2 UNKNOWN; a group id past the
    top INVALID_ARGUMENT, BMv2 OUT_OF_RANGE; and group 0 escaped the switch's errors (the
    shell's own UserError) on BMv2 alone."""
    from thc.wire import protocol as P
    said = []
    for s in (sw, mem):
        held = set(installed.installed_jobs(s))
        fill = [raw_job_entry(s, 5000 + j) for j in range(P.MAX_JOBS - len(held))]
        s.write_entries("INSERT", fill)
        try:
            with pytest.raises(SwitchError) as full:
                s.write_entries("INSERT", [raw_job_entry(s, 6000)])
        finally:
            s.write_entries("DELETE", fill, ignore=["NOT_FOUND"])
        groups = []
        for group in (40000, 0):
            with pytest.raises(SwitchError) as e:
                s.set_multicast_group(group, [(0, 1)])
            groups.append(str(e.value))
        said.append((_code(full.value), "OUT_OF_RANGE" in groups[0],
                     "0 is not a valid group_id" in groups[1]))
    assert said[0] == said[1] == ("UNKNOWN", True, True)


def test_bad_resets_are_counted_alike(bmv2, sw, mem):
    job = bmv2.make_job(next(_ids), 2, pool_size=4)
    agg = job_entries.AggAddress(AGG_IP, AGG_MAC)
    bmv2._installed[job.job_id] = jobs.install_job(sw, job, agg, force=True)
    jobs.install_job(mem, job, agg, force=True)
    got = []
    for s in (sw, mem):
        before = counters.drops(s)
        s.packet_out(bad_resets(job.job_id, job.job_id + 1, AGG_MAC, AGG_IP))
        deadline = time.monotonic() + 10   # BMv2 runs packet-outs after the write returns
        while True:
            after = counters.drops(s)
            delta = {k: after[k] - before[k] for k in after if after[k] != before[k]}
            if sum(delta.values()) >= sum(BAD_RESET_DROPS.values()) or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.05)
        got.append(delta)
    assert got == [BAD_RESET_DROPS, BAD_RESET_DROPS]
