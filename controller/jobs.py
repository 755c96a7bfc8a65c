"""Install and remove THC jobs: every table entry, group and slot a job owns on the switch.

A job (host/wire/jobs.py ``Job``) becomes

  thc_job          job_id -> set_job(job_index, n_workers, pool_base, pool_size,
                                     full_bitmap, mcast_grp, sum_bits, epoch,
                                     aggregation)
                   epoch: the job's configuration tag and a fresh nonce at every install,
                   returned in every reply (host/wire/protocol.py EPOCH_TAG_SHIFT)
  thc_worker       (job_id, worker_id, src_ip, src_port) -> set_worker(worker_bit)
  thc_worker_addr  (job_id, worker_id) -> set_worker_addr(worker_mac, worker_ip,
                                                          worker_port, agg_mac, agg_ip)  [egress]
  lookup tables    (job_id, byte) -> two lanes' table values: the target's own tables
                   (controller/targets/, e.g. 32768 entries a job on BMv2, 16384 on Tofino)
  multicast group  job.mcast_grp: one replica per worker (its switch_port, instance worker_id + 1)
  l2_forward       worker MAC -> switch_port
  RESET x 2 x pool packet-outs that clear the job's slot versions in the data plane,
                   because BMv2's P4Runtime server cannot write registers

Safety (issue 8): the ``thc_worker`` entries are what let a worker's packets touch the slots,
so they go in last, after the pool was reset, and come out first on a re-install. A job is
*live* when its packet counter moves while the controller watches it for ``live_window``
seconds; re-installing or removing a live job is refused (:class:`JobLive`) unless forced.
The switch is the only record: a restarted controller reads what is installed, and
``install_cluster`` leaves jobs whose entries already match the config untouched. Every
check (controller/job_checks.py) runs before the first write, so bad input changes nothing
installed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from thc.controller import counters, forwarding, p4rt
from thc.controller.frames import mac_str, reset_frame
from thc.controller.job_checks import check_agg, check_job, config_of, free_index, target_of
from thc.controller.program import (ADDR_TABLE, JOB_TABLE, SET_JOB, SET_WORKER, SET_WORKER_ADDR,
                                WORKER_TABLE)
from thc.controller.switch import Switch, SwitchError
from thc.wire import protocol as P
from thc.wire.jobs import SWITCH_AGG_IP, SWITCH_AGG_MAC, Cluster, ConfigError, Job

LIVE_WINDOW = 0.5
"""Seconds the controller watches a job's packet counter before changing it: a job whose
workers send at least one packet per round trip moves it well within that."""


class JobNotInstalled(SwitchError):
    """Remove (or change) of a job the switch does not hold."""


class JobLive(SwitchError):
    """Re-install or remove of a job whose workers are sending; pass force to do it anyway."""


@dataclass(frozen=True)
class AggAddress:
    """Where results come from: the aggregator's (switch's) address, named as the
    ``set_worker_addr`` parameters and the Cluster fields are."""
    agg_ip: str = SWITCH_AGG_IP
    agg_mac: str = SWITCH_AGG_MAC

    @classmethod
    def of(cls, cluster: Cluster) -> "AggAddress":
        return cls(cluster.agg_ip, cluster.agg_mac)


# ---- reading what is installed ------------------------------------------------------------

def installed_jobs(sw: Switch) -> dict[int, dict]:
    """{job_id: set_job parameters} of the jobs on the switch."""
    fid = sw.field_id(JOB_TABLE, "job_id")
    return {sw.match_values(e)[fid]: sw.param_values(e) for e in sw.read_table(JOB_TABLE)}


def worker_entries_of(sw: Switch, job_id: int) -> list:
    """The job's thc_worker entries: all n_workers of them once an install finished."""
    return _job_entries(sw, WORKER_TABLE, job_id)


def _job_entries(sw: Switch, table: str, job_id: int, field: str = "job_id") -> list:
    """The entries of ``table`` whose ``field`` (the job id, or a job index) is ``job_id``."""
    fid = sw.field_id(table, field)
    return [e for e in sw.read_table(table) if sw.match_values(e)[fid] == job_id]


def _lut_entries_of(sw: Switch, table: str, job_id: int, job_index: int) -> list:
    """A lookup table's entries of one job: keyed on its id (BMv2) or its index (Tofino)."""
    keys = {f.name for f in sw.tables.get(table, "table").match_fields}
    if "job_id" in keys:
        return _job_entries(sw, table, job_id)
    return _job_entries(sw, table, job_index, "job_index")


def _lut_tables(sw: Switch, by_job_id: bool = False) -> list[str]:
    """The lookup tables of the program (short names ``thc_lut_*``), in P4Info order;
    ``by_job_id``: only if they are keyed on the job id (BMv2), else none."""
    return [t.preamble.name for t in sw.p4info.tables
            if t.preamble.name.rsplit(".", 1)[-1].startswith("thc_lut_")
            and (not by_job_id or any(f.name == "job_id" for f in t.match_fields))]


def _worker_macs(sw: Switch, job_id: int | None = None, exclude: int | None = None) -> set[str]:
    """MACs in thc_worker_addr entries of one job (or of all jobs but ``exclude``)."""
    return {mac for jid, addrs in installed_addresses(sw).items()
            if (job_id is None or jid == job_id) and jid != exclude
            for _, _, mac, _ in addrs}


def installed_addresses(sw: Switch) -> dict[int, list[tuple[str, int, str, int | None]]]:
    """{job_id: [(worker ip, UDP port, MAC, switch port or None)]} from thc_worker_addr and
    l2_forward."""
    jfid = sw.field_id(ADDR_TABLE, "job_id")
    routes = forwarding.routes(sw)
    out: dict[int, list] = {}
    for e in sw.read_table(ADDR_TABLE):
        p = sw.param_values(e)
        mac = mac_str(p["worker_mac"].to_bytes(6, "big"))
        ip = ".".join(str(b) for b in p["worker_ip"].to_bytes(4, "big"))
        out.setdefault(sw.match_values(e)[jfid], []).append(
            (ip, p["worker_port"], mac, routes.get(mac)))
    return out


def _canonical(entry) -> bytes:
    """An entry (serialized, as ``entry_bytes`` writes it, or a TableEntry read back or
    built) as canonical serialized bytes, so that what is installed compares with what would
    be written without parsing thousands of entries."""
    if isinstance(entry, bytes):
        return entry
    te = entry.table_entry if hasattr(entry, "table_entry") else entry

    def canon(value: bytes) -> bytes:
        return p4rt.canonical_bytes(int.from_bytes(value, "big"))
    matches = sorted((m.field_id, canon(m.exact.value)) for m in te.match)
    if not te.HasField("action"):
        return p4rt.exact_entity(te.table_id, matches)
    act = te.action.action
    return p4rt.exact_entity(te.table_id, matches, act.action_id,
                             sorted((q.param_id, canon(q.value)) for q in act.params))


def unchanged(sw: Switch, job: Job, agg: "AggAddress", job_index: int | None = None) -> bool:
    """Whether the switch holds exactly ``job`` (entries, group, routes), so installing it
    again would only reset slots that its workers may be using.

    Of the lookup tables, the first and the last are compared: every lookup table derives
    from the job's table and is written in one step before the job entry, and an install cut
    short leaves the worker entries missing, which the comparison sees."""
    installed = installed_jobs(sw)
    cfg = installed.get(job.job_id)
    if cfg is None or (job_index is not None and cfg["job_index"] != job_index):
        return False
    if P.epoch_tag(cfg["epoch"]) != job.config_tag:
        # another configuration's epoch (what the entries do not hold: the granularity, a
        # table the compared lookups agree on, or an install from before epochs had tags)
        return False
    luts = _lut_tables(sw)
    checked = [luts[0], luts[-1]] if luts else []
    checked_ids = {sw.tables.get(t, "table").preamble.id for t in checked}
    wanted = [job_entry(sw, job, cfg["job_index"], cfg["epoch"]), *worker_entries(sw, job),
              *addr_entries(sw, job, agg),
              *(e for e in lut_entries(sw, job, cfg["job_index"])
                if p4rt.entity_table_id(e) in checked_ids)]
    have = [*(e for table in (JOB_TABLE, WORKER_TABLE, ADDR_TABLE)
              for e in _job_entries(sw, table, job.job_id)),
            *(e for table in checked
              for e in _lut_entries_of(sw, table, job.job_id, cfg["job_index"]))]
    if sorted(map(_canonical, wanted)) != sorted(map(_canonical, have)):
        return False
    replicas = {(w.switch_port, w.id + 1) for w in job.workers}
    if sw.multicast_groups().get(job.mcast_grp) != replicas:
        return False
    routes = forwarding.routes(sw)
    return all(routes.get(w.mac.lower()) == w.switch_port for w in job.workers
               if w.mac.lower() not in forwarding.UNROUTABLE)


def live_jobs(sw: Switch, job_indices: dict[int, int],
              window: float = LIVE_WINDOW) -> dict[int, int]:
    """{job_id: packets counted while watching} of the jobs (by job index) whose packet
    counter moves within ``window`` seconds; returns as soon as every job moved."""
    if not job_indices or window <= 0:
        return {}

    def packets() -> dict[int, int]:
        cells = counters.all_job_counters(sw, {jid: {"job_index": idx}
                                               for jid, idx in job_indices.items()})
        return {jid: c["packets"] for jid, c in cells.items()}

    before = packets()
    deadline = time.monotonic() + window
    moved: dict[int, int] = {}
    while time.monotonic() < deadline and len(moved) < len(job_indices):
        time.sleep(min(0.05, window))
        now = packets()
        moved = {jid: now[jid] - before[jid] for jid in now if now[jid] != before[jid]}
    return moved


def _refuse_live(sw: Switch, job_indices: dict[int, int], what: str, force: bool,
                 window: float) -> None:
    if force:
        return
    live = live_jobs(sw, job_indices, window)
    if live:
        jid, moved = sorted(live.items())[0]
        others = f" (and live jobs {sorted(live)[1:]})" if len(live) > 1 else ""
        raise JobLive(f"job {jid} is live: {moved} packets arrived within {window:.1f}s; {what} "
                      f"would wipe slots its workers are using{others}. Stop its workers or "
                      f"pass force=True (--force)")


def _installed_configs(sw: Switch) -> dict[int, dict]:
    installed = installed_jobs(sw)
    addresses = installed_addresses(sw)
    return {jid: {**cfg, "addresses": addresses.get(jid, [])} for jid, cfg in installed.items()}


# ---- entries of one job -------------------------------------------------------------------

def job_entry(sw: Switch, job: Job, job_index: int, epoch: int):
    if not 0 < epoch < 1 << 32:
        raise ConfigError(f"job {job.job_id}: epoch {epoch} outside 1..2^32-1")
    return sw.table_entry(JOB_TABLE, {"job_id": job.job_id}, SET_JOB, {
        "job_index": job_index, "n_workers": job.n_workers, "pool_base": job.pool_base,
        "pool_size": job.pool_size, "full_bitmap": job.full_bitmap, "mcast_grp": job.mcast_grp,
        "sum_bits": job.sum_bits, "epoch": epoch,
        "aggregation": P.AGGREGATIONS[job.aggregation]})


def worker_entries(sw: Switch, job: Job) -> list:
    return [sw.table_entry(WORKER_TABLE, {"job_id": job.job_id, "worker_id": w.id,
                                          "src_ip": w.ip, "src_port": w.port},
                           SET_WORKER, {"worker_bit": 1 << w.id})
            for w in job.workers]


def addr_entries(sw: Switch, job: Job, agg: AggAddress) -> list:
    return [sw.table_entry(ADDR_TABLE, {"job_id": job.job_id, "worker_id": w.id},
                           SET_WORKER_ADDR, {"worker_mac": w.mac, "worker_ip": w.ip,
                                               "worker_port": w.port, "agg_mac": agg.agg_mac,
                                               "agg_ip": agg.agg_ip})
            for w in job.workers]


def lut_entries(sw: Switch, job: Job, job_index: int, with_action: bool = True) -> list:
    """The job's lookup entries for the switch's target (serialized: see Switch.entry_bytes);
    without action: their keys. BMv2 keys them on the job id, Tofino on the job's index."""
    return target_of(sw).lut_entries(sw, job, job_index, with_action)


def _upsert(sw: Switch, entries: list, exists: bool = False) -> None:
    """Insert or modify; ``exists``: the entries probably exist (modify first)."""
    first, then, missing = ("MODIFY", "INSERT", "NOT_FOUND") if exists else \
        ("INSERT", "MODIFY", "ALREADY_EXISTS")
    rest = sw.write_entries(first, entries, ignore=[missing])
    if rest:
        sw.write_entries(then, rest)


def _delete(sw: Switch, entries: list) -> None:
    for e in entries:
        e.ClearField("action")
    if entries:
        sw.write_entries("DELETE", entries, ignore=["NOT_FOUND"])


def _delete_stale(sw: Switch, table: str, job_id: int, keep: list) -> None:
    wanted = {tuple(sorted(sw.match_values(e).items())) for e in keep}
    _delete(sw, [e for e in _job_entries(sw, table, job_id)
                 if tuple(sorted(sw.match_values(e).items())) not in wanted])


# ---- slot reset ---------------------------------------------------------------------------

def reset_pool(sw: Switch, job: Job, job_index: int, agg: AggAddress,
               timeout: float = 10.0) -> None:
    """Clear every slot of the job (RESET packet-outs) and wait until the switch applied them."""
    before = counters.resets(sw, job_index)
    sw.packet_out(reset_frame(job.job_id, slot, agg.agg_mac, agg.agg_ip, version)
                  for slot in range(job.pool_size) for version in (0, 1))
    deadline = time.monotonic() + timeout
    done = 0
    while time.monotonic() < deadline:
        done = counters.resets(sw, job_index) - before
        if done >= 2 * job.pool_size:
            return
        time.sleep(0.01)
    raise SwitchError(f"job {job.job_id}: only {done} of {2 * job.pool_size} slot resets reached "
                      f"the data plane within {timeout:.0f}s (is the switch started with "
                      f"--cpu-port {P.CPU_PORT}?)")


# ---- install / remove ---------------------------------------------------------------------

def install_job(sw: Switch, job: Job, agg: AggAddress = AggAddress(),
                job_index: int | None = None, force: bool = False,
                live_window: float = LIVE_WINDOW) -> int:
    """Install or re-install ``job``; returns its job index.

    Refuses (JobLive) to re-install a job whose workers are sending, unless ``force``. The
    worker entries go live only after the pool was reset and the counters zeroed."""
    installed = _installed_configs(sw)
    previous = installed.pop(job.job_id, None)
    if job_index is None:
        job_index = previous["job_index"] if previous is not None else \
            free_index({cfg["job_index"] for cfg in installed.values()})
    check_agg(agg.agg_ip, agg.agg_mac)
    check_job(sw, job, job_index, installed)
    if previous is not None:
        _refuse_live(sw, {job.job_id: previous["job_index"]}, "re-installing it", force,
                     live_window)
    _write_job(sw, job, job_index, agg, previous,
               {cfg["mcast_grp"] for cfg in installed.values()})
    return job_index


def _write_job(sw: Switch, job: Job, job_index: int, agg: AggAddress,
               previous: dict | None, groups_in_use: set[int] = frozenset()) -> None:
    """``groups_in_use``: multicast groups other jobs hold or are given in the same
    install: the previous group of this job is deleted only when none of them is it. A
    write that fails leaves the job without all its worker entries (they go in last), so no
    chunk of it completes; the error says so and how to finish."""
    try:
        _write_entries(sw, job, job_index, agg, previous, groups_in_use)
    except SwitchError as e:
        raise SwitchError(f"job {job.job_id}: the install stopped part-way ({e}). What it "
                          f"wrote stays on the switch without all the job's worker entries, "
                          f"so none of its chunks can complete: install the job again (every "
                          f"entry is rewritten) once the cause is fixed") from e


def _write_entries(sw: Switch, job: Job, job_index: int, agg: AggAddress,
                   previous: dict | None, groups_in_use) -> None:
    # no worker of an old version may add to a slot from here on; a job id without a job
    # entry (see leftovers) may hold worker entries too
    _delete(sw, _job_entries(sw, WORKER_TABLE, job.job_id))
    if previous is not None:
        if previous["job_index"] != job_index:
            _delete(sw, [sw.table_entry(JOB_TABLE, {"job_id": job.job_id})])
    old_macs = {a[2] for a in previous["addresses"]} if previous is not None else set()

    again = previous is not None
    # the job entry first: an install cut short leaves a job that `jobs` lists as not
    # serving and `remove` deletes (without worker entries none of its packets count)
    epoch = job.new_epoch(previous.get("epoch") if previous else None)
    _upsert(sw, [job_entry(sw, job, job_index, epoch)],
            again and previous["job_index"] == job_index)
    addrs = addr_entries(sw, job, agg)
    _upsert(sw, addrs, again)
    _upsert(sw, lut_entries(sw, job, job_index), again)
    sw.set_multicast_group(job.mcast_grp, [(w.switch_port, w.id + 1) for w in job.workers])
    forwarding.install(sw, {w.mac: w.switch_port for w in job.workers})

    # leftovers of an earlier version of this job
    _delete_stale(sw, ADDR_TABLE, job.job_id, addrs)
    if previous is not None and previous["mcast_grp"] != job.mcast_grp \
            and previous["mcast_grp"] not in groups_in_use:
        sw.delete_multicast_group(previous["mcast_grp"])
    gone = old_macs - {w.mac.lower() for w in job.workers} - _worker_macs(sw, exclude=job.job_id)
    if gone:
        forwarding.remove(sw, gone)

    reset_pool(sw, job, job_index, agg)
    counters.clear_job_counters(sw, job_index)
    _upsert(sw, worker_entries(sw, job))


def remove_job(sw: Switch, job_id: int, force: bool = False,
               live_window: float = LIVE_WINDOW) -> bool:
    """Delete everything ``install_job`` created for ``job_id``; refuses (JobLive) while its
    workers are sending, unless ``force``. A job id with entries but no thc_job entry (see
    :func:`leftovers`) has them deleted; returns False then, True for an installed job."""
    installed = installed_jobs(sw)
    cfg = installed.get(job_id)
    if cfg is None:
        if job_id not in leftovers(sw):
            raise JobNotInstalled(f"job {job_id} is not installed on the switch "
                                  f"(installed: {sorted(installed) or 'none'})")
        _remove(sw, job_id, None)
        return False
    _refuse_live(sw, {job_id: cfg["job_index"]}, "removing it", force, live_window)
    _remove(sw, job_id, cfg)
    return True


def leftovers(sw: Switch) -> dict[int, list[str]]:
    """{job_id: short names of the tables holding its entries} of job ids without a thc_job
    entry: what an install or a remove cut short left (a controller older than the job entry
    going in first and out last). Lookup entries count where they are keyed on the job id
    (BMv2); Tofino's are keyed on a job index and rewritten by the next job there."""
    installed = installed_jobs(sw)
    out: dict[int, list[str]] = {}
    for table in (WORKER_TABLE, ADDR_TABLE, *_lut_tables(sw, by_job_id=True)[:1]):
        fid = sw.field_id(table, "job_id")
        for jid in sorted({sw.match_values(e)[fid] for e in sw.read_table(table)} - set(installed)):
            out.setdefault(jid, []).append("lookup tables" if table not in (
                WORKER_TABLE, ADDR_TABLE) else table)
    return out


def _remove(sw: Switch, job_id: int, cfg: dict | None) -> None:
    """``cfg`` None: a job id without a thc_job entry; its group is taken to be the default
    (the job id) when no installed job uses that group."""
    macs = _worker_macs(sw, job_id) - _worker_macs(sw, exclude=job_id)
    # workers first: from here on the job's packets drop. The job entry goes last, so that
    # a remove cut short leaves a job that `jobs` lists and `remove` finishes
    _delete(sw, _job_entries(sw, WORKER_TABLE, job_id))
    # the lookup keys depend on the job id or index only: the table values are not needed
    keys_of = Job(job_id=job_id, workers=(), table=(0,) * (1 << P.INDEX_BITS), granularity=1,
                  lanes=sw.lanes)
    if cfg is not None or _lut_tables(sw, by_job_id=True):
        sw.write_entries("DELETE", lut_entries(sw, keys_of, cfg["job_index"] if cfg else 0,
                                               with_action=False), ignore=["NOT_FOUND"])
    if cfg is not None:
        sw.delete_multicast_group(cfg["mcast_grp"])
    elif job_id not in {c["mcast_grp"] for c in installed_jobs(sw).values()}:
        sw.delete_multicast_group(job_id)
    if macs:
        forwarding.remove(sw, macs)
    _delete(sw, _job_entries(sw, ADDR_TABLE, job_id))
    if cfg is not None:
        _delete(sw, [sw.table_entry(JOB_TABLE, {"job_id": job_id})])


def check_cluster(sw: Switch, cluster: Cluster, prune: bool = False) -> dict[int, int]:
    """{job_id: job_index} the cluster's jobs would take on ``sw``, after every check that
    ``install_cluster`` runs before its first write (ConfigError). On a DryRunSwitch of the
    program to be pushed, these are the checks of the switch right after the push: run them
    before a push, which wipes what is installed."""
    return _plan(sw, cluster, _installed_configs(sw), prune)


def _plan(sw: Switch, cluster: Cluster, installed: dict[int, dict], prune: bool) -> dict:
    cluster.validate(total_slots=P.SWITCH_SLOTS)
    check_agg(cluster.agg_ip, cluster.agg_mac)
    wanted = {j.job_id for j in cluster.jobs}
    staying = {jid: cfg for jid, cfg in installed.items() if jid not in wanted and not prune}
    index = {jid: installed[jid]["job_index"] for jid in wanted if jid in installed}
    taken = {cfg["job_index"] for cfg in staying.values()}
    for job in cluster.jobs:
        if job.job_id in index and index[job.job_id] in taken:
            del index[job.job_id]
        if job.job_id not in index:
            index[job.job_id] = free_index(taken | set(index.values()))
        taken.add(index[job.job_id])
    for job in cluster.jobs:
        others = {**staying, **{j.job_id: config_of(j, index[j.job_id])
                                for j in cluster.jobs if j.job_id != job.job_id}}
        check_job(sw, job, index[job.job_id], others)
    return index


def install_cluster(sw: Switch, cluster: Cluster, prune: bool = False, force: bool = False,
                    live_window: float = LIVE_WINDOW) -> dict[int, int]:
    """Make the switch hold every job of ``cluster``; returns {job_id: job_index}.

    Jobs already installed exactly as configured are left alone (running or not) and keep
    their index; new jobs take free indices. With ``prune``, jobs the cluster lacks are
    removed; without it they stay and must not collide with the cluster. Everything is
    checked before the first write: a collision or a live job to be changed (JobLive,
    unless ``force``) changes nothing."""
    installed = _installed_configs(sw)
    index = _plan(sw, cluster, installed, prune)
    agg = AggAddress.of(cluster)
    wanted = {j.job_id for j in cluster.jobs}
    pruned = {jid: cfg for jid, cfg in installed.items() if jid not in wanted and prune}
    staying = {jid: cfg for jid, cfg in installed.items() if jid not in wanted and not prune}
    keep = {j.job_id for j in cluster.jobs
            if j.job_id in installed and unchanged(sw, j, agg)}

    changed = {jid: cfg["job_index"] for jid, cfg in installed.items()
               if jid in pruned or (jid in wanted and jid not in keep)}
    _refuse_live(sw, changed, "changing or removing it", force, live_window)

    for jid, cfg in pruned.items():
        _remove(sw, jid, cfg)
    for jid in (leftovers(sw) if prune else ()):
        if jid not in wanted:
            _remove(sw, jid, None)
    changing = [j for j in cluster.jobs if j.job_id not in keep]
    try:
        for job in changing:
            # every job to be written stops counting before any is rewritten: a job's new pool
            # or group may be another's that is rewritten later (or never, if a write fails)
            _delete(sw, _job_entries(sw, WORKER_TABLE, job.job_id))
    except SwitchError as e:
        raise SwitchError(f"taking the worker entries of jobs {[j.job_id for j in changing]} "
                          f"off failed ({e}); some of them count no packet until the cluster "
                          f"is installed again") from e
    for job in changing:
        if job.job_id in installed and installed[job.job_id]["job_index"] != index[job.job_id]:
            _remove(sw, job.job_id, installed.pop(job.job_id))   # so that indices can swap
    groups = {j.mcast_grp for j in cluster.jobs} | {cfg["mcast_grp"] for cfg in staying.values()}
    for k, job in enumerate(changing):
        try:
            _write_job(sw, job, index[job.job_id], agg, installed.get(job.job_id),
                       groups - {job.mcast_grp})
        except SwitchError as e:
            rest = [j.job_id for j in changing[k + 1:]]
            if not rest:
                raise
            raise SwitchError(f"{e}. Jobs {rest}, to be written after it, have no worker "
                              f"entries either: install the cluster again") from e
    return index
