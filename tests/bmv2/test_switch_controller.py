"""Controller against a real BMv2: idempotent install, complete removal, counters, CLI."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from thc.controller import counters, forwarding, installed, jobs, program
from thc.controller.targets import bmv2 as bmv2_target
from thc.controller.switch import SwitchError
from thc.wire import protocol as P
from thc.wire.jobs import ConfigError
from tests.bmv2.packets import check_round, data, random_indices, round_trip

pytestmark = pytest.mark.bmv2
_ids = itertools.count(500)


def snapshot(sw) -> dict:
    """Table entries as text: every table but thc_job and thc_install (their epoch is new at
    every install) and the lookup tables, of which those of the first and the last lane
    group (the installer writes all groups alike)."""
    last = sw.lanes // bmv2_target.GROUP_LANES - 1
    keep = {bmv2_target.LUT_TABLE.format(g, b) for g in (0, last)
            for b in range(bmv2_target.GROUP_BYTES)}
    state = {}
    for t in sw.p4info.tables:
        name = t.preamble.name
        if name.rsplit(".", 1)[-1] in (program.JOB_TABLE, program.INSTALL_TABLE) or (
                ".thc_lut_" in name and name not in keep):
            continue
        entries = sw.read_table(t.preamble.name)
        state[t.preamble.name] = sorted(e.SerializeToString(deterministic=True)
                                        for e in entries)
    return state


def test_install_is_idempotent(bmv2, sw):
    job = bmv2.make_job(next(_ids), 3, pool_size=4)
    bmv2.install(job)
    first, cfg = snapshot(sw), installed.installed_jobs(sw)[job.job_id]
    bmv2.install(job)
    assert snapshot(sw) == first
    again = installed.installed_jobs(sw)[job.job_id]
    assert installed.install_epochs(sw, job.job_id) == [again["epoch"]]
    assert again.pop("epoch") not in (0, cfg.pop("epoch")), "every install draws a new epoch"
    assert again == cfg
    for group in (0, sw.lanes // bmv2_target.GROUP_LANES - 1):
        for b in range(bmv2_target.GROUP_BYTES):
            table = bmv2_target.LUT_TABLE.format(group, b)
            assert len(installed.entries_of(sw, table, job.job_id)) == 256
    # and it still aggregates, from reset slots
    check_round(bmv2, job, 0, np.random.default_rng(0))


def test_reinstall_with_fewer_workers_drops_their_entries(bmv2, sw):
    job = bmv2.make_job(next(_ids), 3, pool_size=4)
    bmv2.install(job)
    smaller = replace(job, workers=job.workers[:2])
    bmv2.install(smaller)
    workers = [e for e in installed.entries_of(sw, program.WORKER_TABLE, job.job_id)]
    addrs = [e for e in installed.entries_of(sw, program.ADDR_TABLE, job.job_id)]
    assert len(workers) == len(addrs) == 2
    assert job.workers[2].mac not in forwarding.routes(sw)
    assert installed.installed_jobs(sw)[job.job_id]["n_workers"] == 2
    # worker 2 is now outside the job
    before = counters.drops(sw)["worker_outside_job"]
    bmv2.endpoint(job, 2).send(data(job, 2, 0, np.zeros(job.lanes, np.uint8)))
    bmv2.endpoint(job, 2).recv_all()
    assert counters.drops(sw)["worker_outside_job"] == before + 1


def test_remove_deletes_everything(bmv2, sw):
    job = bmv2.make_job(next(_ids), 2, pool_size=4)   # may evict an earlier test's job
    before = snapshot(sw)
    bmv2.install(job)
    assert snapshot(sw) != before
    bmv2.remove(job.job_id)
    assert snapshot(sw) == before
    with pytest.raises(jobs.JobNotInstalled):
        jobs.remove_job(sw, job.job_id)
    # its packets are now unknown_job
    drops = counters.drops(sw)["unknown_job"]
    bmv2.endpoint(job, 0).send(data(job, 0, 0, np.zeros(job.lanes, np.uint8)))
    assert bmv2.endpoint(job, 0).recv_all() == []
    assert counters.drops(sw)["unknown_job"] == drops + 1


def test_counters_by_name(bmv2, sw):
    job = bmv2.make_job(next(_ids), 2, pool_size=4)
    bmv2.install(job)
    d = counters.drops(sw)
    assert set(d) == set(P.DropReason.__members__)
    c = bmv2.job_counters(job)
    assert c == {name: 0 for name in P.JOB_COUNTERS}, "install zeroes the job's counters"
    rng = np.random.default_rng(1)
    idxs = [random_indices(rng, job) for _ in range(2)]
    round_trip(bmv2, job, 0, idxs)
    bmv2.endpoint(job, 0).send(data(job, 0, 0, idxs[0]))          # retransmission
    bmv2.endpoint(job, 0).recv_all()
    bmv2.endpoint(job, 0).send(data(job, 0, 1, idxs[0]))          # first of seq 1
    bmv2.endpoint(job, 0).send(data(job, 0, 1, idxs[0]))          # pending
    bmv2.endpoint(job, 0).recv_all()
    assert bmv2.job_counters(job) == {"packets": 5, "completions": 1, "retransmissions": 1,
                                      "pending": 1, "held": 0}
    snap = counters.snapshot(sw, installed.installed_jobs(sw))
    assert snap["jobs"][str(job.job_id)]["packets"] == 5


def test_bad_config_is_rejected_before_touching_the_switch(bmv2, sw):
    job = bmv2.make_job(next(_ids), 2, pool_size=4)
    before, held = snapshot(sw), installed.installed_jobs(sw)
    with pytest.raises(ConfigError, match="lanes"):
        jobs.install_job(sw, replace(job, lanes=job.lanes // 2))
    with pytest.raises(ConfigError, match="slots"):
        jobs.install_job(sw, replace(job, pool_base=P.SWITCH_SLOTS - 2))
    with pytest.raises(ConfigError, match="table values must lie in 0..30"):
        jobs.install_job(sw, replace(job, table=(31,) + job.table[1:]))
    with pytest.raises(ConfigError, match="overflows even 16-bit sums"):
        jobs.install_job(sw, replace(job, granularity=40000))
    with pytest.raises(jobs.JobNotInstalled, match=f"job {job.job_id} is not installed"):
        jobs.remove_job(sw, job.job_id)
    assert snapshot(sw) == before
    assert installed.installed_jobs(sw) == held


def test_second_session_in_one_process_is_refused(bmv2):
    from thc.controller.switch import Switch
    with pytest.raises(SwitchError, match="already open"):
        Switch(bmv2.switch.grpc_addr).connect(program=None)


def test_cli_reads_counters_and_reports_errors(bmv2, tmp_path):
    addr = bmv2.switch.grpc_addr
    base = [sys.executable, "-m", "thc.cli", "controller", "--grpc-addr", addr,
            "--election-id", "0,1"]
    r = subprocess.run(base + ["counters", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)["drops"]) == set(P.DropReason.__members__)
    r = subprocess.run(base + ["remove", "--job", "9999"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "thc controller:" in r.stderr
    r = subprocess.run([sys.executable, "-m", "thc.cli", "controller", "--grpc-addr",
                        "127.0.0.1:1", "--timeout", "0.5", "counters"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no P4Runtime server" in r.stderr
