"""Install and remove THC jobs: every table entry, group and slot a job owns on the switch.

A job becomes its table entries (controller/job_entries.py), and

  multicast group  job.mcast_grp: one replica per worker (its switch_port, instance worker_id + 1)
  l2_forward       worker MAC -> switch_port
  RESET x 2 x pool packet-outs that clear the job's slot versions in the data plane,
                   because BMv2's P4Runtime server cannot write registers; each carries
                   the install's epoch, which the job's thc_install entry names

Safety: the ``thc_worker`` entries are what let a worker's packets touch the slots, so they
go in last, after the pool was reset, and come out first on a re-install. A job is *live*
when its packet counter moves while the controller watches it for ``live_window`` seconds;
re-installing or removing a live job is refused (:class:`JobLive`) unless forced. The switch
is the only record (controller/installed.py reads it): ``install_cluster`` leaves jobs whose
entries already match the config untouched. Every check (controller/job_checks.py) runs
before the first write, so bad input changes nothing installed.
"""
from __future__ import annotations

import time
import warnings

from thc.controller import counters, forwarding
from thc.controller.frames import reset_frame
from thc.controller.installed import (entries_of, install_epochs, installed_configs,
                                      installed_jobs, leftovers, lut_tables, stray_groups,
                                      unchanged, worker_macs)
from thc.controller.job_checks import (check_agg, check_beside_agg, check_job, check_room,
                                       check_routes, config_of, free_index, pools_overlap)
from thc.controller.job_entries import (AggAddress, addr_entries, delete, install_entry,
                                        job_entry, lut_entries, upsert, worker_entries)
from thc.controller.program import ADDR_TABLE, INSTALL_TABLE, JOB_TABLE, WORKER_TABLE
from thc.controller.switch import Displaced, Switch, SwitchError
from thc.net.window import DEFAULT_MAX_TIMEOUT
from thc.wire import protocol as P
from thc.wire.jobs import Cluster, ConfigError, Job

LIVE_WINDOW = 2 * DEFAULT_MAX_TIMEOUT + 0.2
"""Seconds the controller watches a job's packet counter before changing it: more than two
of the clients' longest default backoffs (a worker waiting for its peers resends at least
that often), so a round in flight moves it. Between rounds (a training step's compute) a job
sends nothing and reads idle: stop its workers before changing it."""


class JobNotInstalled(SwitchError):
    """Remove (or change) of a job the switch does not hold."""


class JobLive(SwitchError):
    """Re-install or remove of a job whose workers are sending; pass force to do it anyway."""


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


def refuse_live_jobs(sw: Switch, what: str, force: bool = False,
                     window: float = LIVE_WINDOW) -> None:
    """JobLive unless ``force`` when any job the switch holds is live (before a push, which
    wipes them all)."""
    if sw.has_table(JOB_TABLE):
        _refuse_live(sw, {jid: cfg["job_index"] for jid, cfg in installed_jobs(sw).items()},
                     what, force, window)


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


def _check_unchanged(sw: Switch, seen: dict[int, dict]) -> None:
    """Raise if the switch's jobs differ from ``seen`` (:func:`installed_configs`, read when
    the plan was made): another controller (another election id) wrote them during the live
    watch, and writing the plan now could hand its job's slots to one of ours."""
    now = installed_configs(sw)
    if now != seen:
        moved = sorted(j for j in set(now) | set(seen) if now.get(j) != seen.get(j))
        raise SwitchError(f"jobs {moved} changed on the switch while this controller watched "
                          f"for live workers (another controller wrote them): nothing was "
                          f"written; run the command again")


def _delete_stale(sw: Switch, table: str, job_id: int, keep: list) -> None:
    wanted = {tuple(sorted(sw.match_values(e).items())) for e in keep}
    delete(sw, [e for e in entries_of(sw, table, job_id)
                 if tuple(sorted(sw.match_values(e).items())) not in wanted])


# ---- slot reset ---------------------------------------------------------------------------

def reset_pool(sw: Switch, job: Job, job_index: int, agg: AggAddress, epoch: int,
               timeout: float = 10.0) -> None:
    """Clear every slot of the job (RESET packet-outs of the install ``epoch``, which the
    job's thc_install entry already names) and wait until the switch applied them. The
    switch counts only RESETs of that install: those still queued from an earlier one that
    timed out are dropped (stale_reset), so the count from here is this install's."""
    deadline = time.monotonic() + timeout
    before = counters.resets(sw, job_index)
    sw.packet_out(reset_frame(job.job_id, slot, agg.agg_mac, agg.agg_ip, version, epoch)
                  for slot in range(job.pool_size) for version in (0, 1))
    done = 0
    while time.monotonic() < deadline:
        done = counters.resets(sw, job_index) - before
        if done >= 2 * job.pool_size:
            return
        time.sleep(0.01)
    cpu = (f"started with --cpu-port {P.CPU_PORT}" if sw.target is None or
           sw.target.cpu_port == P.CPU_PORT else f"one whose CPU port is {sw.target.cpu_port}")
    raise SwitchError(f"job {job.job_id}: only {done} of {2 * job.pool_size} slot resets reached "
                      f"the data plane within {timeout:g}s (is the switch {cpu}?); the rest "
                      f"may still be queued, and the next install's epoch makes the switch "
                      f"drop them (stale_reset)")


# ---- install / remove ---------------------------------------------------------------------

def install_job(sw: Switch, job: Job, agg: AggAddress = AggAddress(),
                job_index: int | None = None, force: bool = False,
                live_window: float = LIVE_WINDOW) -> int:
    """Install or re-install ``job``; returns its job index.

    Refuses (JobLive) to re-install a job whose workers are sending, unless ``force``. The
    worker entries go live only after the pool was reset and the counters zeroed."""
    seen = installed_configs(sw)
    installed = dict(seen)
    previous = installed.pop(job.job_id, None)
    if job_index is None:
        job_index = previous["job_index"] if previous is not None else \
            free_index({cfg["job_index"] for cfg in installed.values()})
    check_agg(agg.agg_ip, agg.agg_mac)
    check_job(sw, job, job_index, installed, _lookups_left(sw))
    check_beside_agg(job, agg.agg_ip, agg.agg_mac)
    check_routes(sw, [job])
    if previous is not None:
        _refuse_live(sw, {job.job_id: previous["job_index"]}, "re-installing it", force,
                     live_window)
        _check_unchanged(sw, seen)
    last_epoch = previous["epoch"] if previous is not None else None
    if previous is not None and previous["job_index"] != job_index:
        # a Tofino's lookup entries are keyed on the index: the old ones would stay,
        # filling the tables, unless the job leaves its old index whole (as a cluster's)
        _remove(sw, job.job_id, previous)
        previous = None
    _write_job(sw, job, job_index, agg, previous,
               {cfg["mcast_grp"] for cfg in installed.values()}, last_epoch)
    return job_index


def _write_job(sw: Switch, job: Job, job_index: int, agg: AggAddress,
               previous: dict | None, groups_in_use: set[int] = frozenset(),
               last_epoch: int | None = None, held: tuple[int, ...] = ()) -> None:
    """``groups_in_use``: multicast groups other jobs hold or are given in the same
    install: the previous group of this job is deleted only when none of them is it.
    ``last_epoch``: the job's epoch before, which the new one must differ from (also where
    the job left its old index, so ``previous`` is None). ``held``: epochs of install
    entries already taken off (RESETs of theirs may still be queued), drawn by none. A
    write that fails leaves the job without all its worker entries (they go in last), so no
    chunk of it completes; the error says so and how to finish."""
    try:
        _write_entries(sw, job, job_index, agg, previous, groups_in_use, last_epoch, held)
        sw.confirm_held()
    except Displaced as e:
        raise Displaced(f"job {job.job_id}: another controller held the switch during this "
                        f"install ({e}). This install's last write before that was seen may "
                        f"stand on a job it installed, where a re-install that finds the job "
                        f"unchanged would keep it: once that controller is done, remove the "
                        f"job (`thc controller remove --job {job.job_id} --force`) and install "
                        f"the cluster that should hold it") from e
    except SwitchError as e:
        raise SwitchError(f"job {job.job_id}: the install stopped part-way ({e}). What it "
                          f"wrote stays on the switch without all the job's worker entries, "
                          f"so none of its chunks can complete: install the job again (every "
                          f"entry is rewritten) once the cause is fixed") from e


def _write_entries(sw: Switch, job: Job, job_index: int, agg: AggAddress,
                   previous: dict | None, groups_in_use, last_epoch: int | None,
                   held: tuple[int, ...] = ()) -> None:
    # no worker of an old version may add to a slot from here on; a job id without a job
    # entry (see leftovers) may hold worker entries too
    delete(sw, entries_of(sw, WORKER_TABLE, job.job_id))
    if previous is not None:
        if previous["job_index"] != job_index:
            delete(sw, [sw.table_entry(JOB_TABLE, {"job_id": job.job_id})])
    # what the new version no longer uses goes while the old job entry still names it (a
    # retry after a failure further on would read the new group and MACs as the previous;
    # with the worker entries gone nothing of the job is multicast or routed)
    old_macs = {a[2] for a in previous["addresses"]} if previous is not None else set()
    if previous is not None and previous["mcast_grp"] != job.mcast_grp \
            and previous["mcast_grp"] not in groups_in_use:
        sw.delete_multicast_group(previous["mcast_grp"])
    gone = old_macs - {w.mac.lower() for w in job.workers} - worker_macs(sw, exclude=job.job_id)
    if gone:
        forwarding.remove(sw, gone)

    again = previous is not None
    # the job entry first: an install cut short leaves a job that `jobs` lists as not
    # serving and `remove` deletes (without worker entries none of its packets count)
    # an epoch the switch still names (an install cut short before its thc_install entry
    # was replaced) may have RESETs queued: a new install draws none of them
    epoch = job.new_epoch(previous.get("epoch") if previous else last_epoch,
                          avoid=set(install_epochs(sw, job.job_id)) | set(held))
    upsert(sw, [job_entry(sw, job, job_index, epoch)],
            again and previous["job_index"] == job_index)
    # from here on only this install's RESETs clear the job's slots and count
    delete(sw, entries_of(sw, INSTALL_TABLE, job.job_id))
    upsert(sw, [install_entry(sw, job.job_id, epoch)])
    addrs = addr_entries(sw, job, agg)
    upsert(sw, addrs, again)
    upsert(sw, lut_entries(sw, job, job_index), again)
    sw.set_multicast_group(job.mcast_grp, [(w.switch_port, w.id + 1) for w in job.workers])
    forwarding.install(sw, {w.mac: w.switch_port for w in job.workers})

    # leftovers of an earlier version of this job
    _delete_stale(sw, ADDR_TABLE, job.job_id, addrs)

    reset_pool(sw, job, job_index, agg, epoch)
    if not counters.clear_job_counters(sw, job_index):
        warnings.warn(f"job {job.job_id}: the switch did not zero the counters of job index "
                      f"{job_index}: they go on from what an earlier job there counted "
                      f"(read differences)", RuntimeWarning, stacklevel=3)
    upsert(sw, worker_entries(sw, job))


def remove_job(sw: Switch, job_id: int, force: bool = False,
               live_window: float = LIVE_WINDOW) -> bool:
    """Delete everything ``install_job`` created for ``job_id``; refuses (JobLive) while its
    workers are sending, unless ``force``. A job id with entries but no thc_job entry (see
    :func:`leftovers`) has them deleted; returns False then, True for an installed job."""
    seen = installed_configs(sw)
    cfg = seen.get(job_id)
    if cfg is None:
        if job_id not in leftovers(sw):
            raise JobNotInstalled(f"job {job_id} is not installed on the switch "
                                  f"(installed: {sorted(seen) or 'none'})")
        _remove(sw, job_id, None)
        return False
    _refuse_live(sw, {job_id: cfg["job_index"]}, "removing it", force, live_window)
    _check_unchanged(sw, seen)
    _remove(sw, job_id, cfg)
    return True


def _remove(sw: Switch, job_id: int, cfg: dict | None) -> None:
    """``cfg`` None: a job id without a thc_job entry; its group is taken to be the default
    (the job id) when no installed job uses that group. A write that fails leaves the job
    half-removed; the error says so and how to finish."""
    try:
        _delete_job(sw, job_id, cfg)
        sw.confirm_held()
    except Displaced as e:
        raise Displaced(f"job {job_id}: another controller held the switch during this "
                        f"removal ({e}). Its last delete before that was seen may have taken "
                        f"entries of a job that controller installed: once it is done, remove "
                        f"the job (`thc controller remove --job {job_id} --force`) and install "
                        f"the cluster that should hold it") from e
    except SwitchError as e:
        raise SwitchError(f"job {job_id}: the removal stopped part-way ({e}). The job no "
                          f"longer serves (its worker entries go first) and `thc controller "
                          f"jobs` lists what is left: `thc controller remove --job {job_id}` "
                          f"or an install of the job finishes it once the cause is "
                          f"fixed") from e


def _delete_job(sw: Switch, job_id: int, cfg: dict | None) -> None:
    macs = worker_macs(sw, job_id) - worker_macs(sw, exclude=job_id)
    # workers first: from here on the job's packets drop. The job entry goes last, so that
    # a remove cut short leaves a job that `jobs` lists and `remove` finishes
    delete(sw, entries_of(sw, WORKER_TABLE, job_id))
    # the lookup keys depend on the job id or index only: the table values are not needed
    keys_of = Job(job_id=job_id, workers=(), table=(0,) * (1 << P.INDEX_BITS), granularity=1,
                  lanes=sw.lanes)
    if cfg is not None or lut_tables(sw, by_job_id=True):
        sw.write_entries("DELETE", lut_entries(sw, keys_of, cfg["job_index"] if cfg else 0,
                                               with_action=False), ignore=["NOT_FOUND"])
    # a group another job names stays: after a swap cut short, this job's stale entry may
    # name the group a complete job now serves from
    others = {c["mcast_grp"] for j, c in installed_jobs(sw).items() if j != job_id}
    group = cfg["mcast_grp"] if cfg is not None else job_id
    if group not in others:
        sw.delete_multicast_group(group)
    if macs:
        forwarding.remove(sw, macs)
    delete(sw, entries_of(sw, ADDR_TABLE, job_id))
    delete(sw, entries_of(sw, INSTALL_TABLE, job_id))
    if cfg is not None:
        delete(sw, [sw.table_entry(JOB_TABLE, {"job_id": job_id})])


def check_cluster(sw: Switch, cluster: Cluster, prune: bool = False) -> dict[int, int]:
    """{job_id: job_index} the cluster's jobs would take on ``sw``, after every check that
    ``install_cluster`` runs before its first write (ConfigError). On a DryRunSwitch of the
    program to be pushed, these are the checks of the switch right after the push: run them
    before a push, which wipes what is installed."""
    return _plan(sw, cluster, installed_configs(sw), prune)


def _lookups_left(sw: Switch) -> frozenset[int]:
    """Ids of the jobs whose lookup entries stay without a job entry (see leftovers)."""
    return frozenset(jid for jid, kinds in leftovers(sw).items() if "lookup tables" in kinds)


def _plan(sw: Switch, cluster: Cluster, installed: dict[int, dict], prune: bool) -> dict:
    cluster.validate(total_slots=P.SWITCH_SLOTS)
    check_agg(cluster.agg_ip, cluster.agg_mac, cluster.agg_port)
    wanted = {j.job_id for j in cluster.jobs}
    staying = {jid: cfg for jid, cfg in installed.items() if jid not in wanted and not prune}
    index = {jid: installed[jid]["job_index"] for jid in wanted if jid in installed}
    taken = {cfg["job_index"] for cfg in staying.values()}
    for jid, i in index.items():
        # two jobs on one index share a Tofino's lookup entries and counters: no write gives
        # either its own without taking the other's off
        other = [o for o, cfg in installed.items() if cfg["job_index"] == i and o != jid]
        if other:
            raise ConfigError(f"job {jid} shares job index {i} with job {other[0]} on the "
                              f"switch (entries another controller or a hand wrote): remove "
                              f"one of them, then install the other again")
    for job in cluster.jobs:
        if job.job_id not in index:
            index[job.job_id] = free_index(taken | set(index.values()))
        taken.add(index[job.job_id])
    held = frozenset() if prune else _lookups_left(sw) - wanted
    check_room(sw, [j.job_id for j in cluster.jobs], list(staying), held)
    for job in cluster.jobs:
        others = {**staying, **{j.job_id: config_of(j, index[j.job_id])
                                for j in cluster.jobs if j.job_id != job.job_id}}
        check_job(sw, job, index[job.job_id], others, held)
        check_beside_agg(job, cluster.agg_ip, cluster.agg_mac)
    used = {w.mac.lower() for j in cluster.jobs for w in j.workers} | {
        a[2].lower() for cfg in staying.values() for a in cfg.get("addresses", ())}
    check_routes(sw, cluster.jobs, {a[2].lower() for jid, cfg in installed.items()
                                    if jid not in wanted and prune
                                    for a in cfg.get("addresses", ())} - used)
    return index


def _overtaken(changing: list[Job], installed: dict[int, dict]) -> set[int]:
    """Jobs of ``changing`` whose installed pool a job written before them takes: their
    install entries go before any job is written, so that RESETs still queued from their
    last install (one whose resets timed out) are dropped, not run on the slots of a job
    already live there. Elsewhere the entries stay until the job's own rewrite, where they
    keep their epochs from the next draw (after a write that failed, too)."""
    order = {j.job_id: k for k, j in enumerate(changing)}
    out = set()
    for y in changing:
        cfg = installed.get(y.job_id)
        if cfg is None:
            continue
        if any(order[x.job_id] < order[y.job_id] and pools_overlap(
                x.pool_base, x.pool_size, cfg["pool_base"], cfg["pool_size"]) for x in changing):
            out.add(y.job_id)
    return out


def install_cluster(sw: Switch, cluster: Cluster, prune: bool = False, force: bool = False,
                    live_window: float = LIVE_WINDOW) -> dict[int, int]:
    """Make the switch hold every job of ``cluster``; returns {job_id: job_index}.

    Jobs already installed exactly as configured are left alone (running or not) and keep
    their index; new jobs take free indices. With ``prune``, jobs the cluster lacks are
    removed; without it they stay and must not collide with the cluster. Everything is
    checked before the first write: a collision or a live job to be changed (JobLive,
    unless ``force``) changes nothing."""
    installed = installed_configs(sw)
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
    _check_unchanged(sw, installed)

    for jid, cfg in pruned.items():
        _remove(sw, jid, cfg)
    for jid in (leftovers(sw) if prune else ()):
        if jid not in wanted:
            _remove(sw, jid, None)
    changing = [j for j in cluster.jobs if j.job_id not in keep]
    overtaken = _overtaken(changing, installed)
    held = {j.job_id: tuple(install_epochs(sw, j.job_id)) if j.job_id in overtaken else ()
            for j in changing}
    try:
        for job in changing:
            # every job to be written stops counting before any is rewritten: a job's new pool
            # or group may be another's that is rewritten later (or never, if a write fails)
            delete(sw, entries_of(sw, WORKER_TABLE, job.job_id))
            if job.job_id in overtaken:
                delete(sw, entries_of(sw, INSTALL_TABLE, job.job_id))
    except Displaced:
        raise
    except SwitchError as e:
        raise SwitchError(f"taking the worker and install entries of jobs "
                          f"{[j.job_id for j in changing]} off failed ({e}); some of them count "
                          f"no packet until the cluster is installed again") from e
    epochs = {jid: cfg["epoch"] for jid, cfg in installed.items()}
    groups = {j.mcast_grp for j in cluster.jobs} | {cfg["mcast_grp"] for cfg in staying.values()}
    for k, job in enumerate(changing):
        try:
            _write_job(sw, job, index[job.job_id], agg, installed.get(job.job_id),
                       groups - {job.mcast_grp}, epochs.get(job.job_id), held[job.job_id])
        except SwitchError as e:
            rest = [j.job_id for j in changing[k + 1:]]
            if not rest or isinstance(e, Displaced):
                raise
            raise SwitchError(f"{e}. Jobs {rest}, to be written after it, have no worker "
                              f"entries either: install the cluster again") from e
    for group in stray_groups(sw):
        sw.delete_multicast_group(group)
    return index
