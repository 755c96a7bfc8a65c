"""Why a job cannot go on the switch: every check that runs before the first write, so bad
input changes nothing installed (controller/jobs.py runs them)."""
from __future__ import annotations

import ipaddress
import numbers

from thc.controller import forwarding, targets
from thc.controller.program import L2_TABLE, WORKER_PORT_KEY, WORKER_TABLE
from thc.controller.switch import Switch
from thc.wire import protocol as P
from thc.wire.jobs import ConfigError, Job, check_address, check_mac


def target_of(sw: Switch) -> targets.Target:
    """The target of the switch's program; ConfigError when it is not a THC program."""
    if sw.target is None:
        known = ", ".join(f"{t.lut_table.format(0, 0)} ({t.name})"
                          for t in targets.TARGETS.values())
        raise ConfigError(f"the switch's P4 program is not a THC program: it has none of the "
                          f"lookup tables {known}")
    return sw.target


REGISTER_SIZES = {"thc_run": 2 * P.SWITCH_SLOTS, "thc_job_run": P.MAX_JOBS,
                  "thc_worker_run": P.MAX_JOBS * P.MAX_WORKERS}
"""Registers whose sizes protocol.json fixes (slot versions, jobs, workers of every job)."""


def pools_overlap(base: int, size: int, other_base: int, other_size: int) -> bool:
    """Whether two slot pools share a slot."""
    return base < other_base + other_size and other_base < base + size


def check_program(sw: Switch) -> None:
    """ConfigError when the switch's program was compiled for other slots, jobs or workers
    than protocol.json gives: it would take jobs whose slots it does not have, and leave
    their workers unanswered (registers a P4Info does not list are not checked); or when
    its worker table has no port key (a build from before it), which the install would find
    only at its worker entries, after every other write."""
    if WORKER_PORT_KEY not in sw.key_names(WORKER_TABLE):
        raise ConfigError(f"the switch's P4 program keys {WORKER_TABLE} on "
                          f"{', '.join(sw.key_names(WORKER_TABLE))} but not on the switch port "
                          f"({WORKER_PORT_KEY}): it is a build from before the port key; push "
                          f"the current one (`thc controller push`), or on a Tofino start "
                          f"bf_switchd with p4src/thc_tna.p4 compiled anew")
    for reg in sw.p4info.registers:
        short = reg.preamble.name.rsplit(".", 1)[-1]
        want = REGISTER_SIZES.get(short)
        if want is not None and reg.size != want:
            raise ConfigError(f"the switch's P4 program does not match protocol.json: register "
                              f"{short} holds {reg.size} entries, protocol.json gives {want}; "
                              f"compile the program again and push it (`make p4`)")


def check_job(sw: Switch, job: Job, job_index: int, others: dict[int, dict],
              held: frozenset[int] = frozenset()) -> None:
    """Why ``job`` cannot go on the switch at ``job_index`` (ConfigError), checked before any
    write. ``others``: {job_id: set_job parameters plus ``addresses`` as installed_addresses
    gives them} of the jobs that stay on the switch beside ``job``; ``held``: ids of jobs
    without a job entry whose lookup entries stay (leftovers: they take room too)."""
    job.validate()
    portless = [w.id for w in job.workers if w.switch_port is None]
    if portless:   # it was taken as port 0, where every result went
        raise ConfigError(f"job {job.job_id}: worker(s) {portless} give no switch_port; the "
                          f"switch sends each result out of its workers' ports: give every "
                          f"worker its `switch_port`")
    if job.shards:
        raise ConfigError(f"job {job.job_id} is spread over {len(job.shards)} software "
                          f"aggregator shards (its shard map): the switch aggregates every "
                          f"chunk it gets and refuses none as another shard's, so a worker "
                          f"with another map would wait for chunks that never complete; "
                          f"install the job without its shard map, or run `thc aggregator "
                          f"--shard K` on the shards' hosts")
    target_of(sw).check_job(job)
    check_program(sw)
    top = target_of(sw).max_mcast_group
    if not 1 <= job.mcast_grp <= top:
        raise ConfigError(f"job {job.job_id}: multicast group {job.mcast_grp} outside "
                          f"1..{top} ({target_of(sw).name}); give the job an mcast_grp in range "
                          f"(it defaults to the job id)")
    if job.lanes != sw.lanes:
        raise ConfigError(f"job {job.job_id} has {job.lanes} lanes; the switch program was "
                          f"compiled for {sw.lanes}")
    if isinstance(job_index, bool) or not isinstance(job_index, numbers.Integral):
        # written as int(job_index), a fraction would land on another job's index
        raise ConfigError(f"job index {job_index!r} is not an integer")
    if not 0 <= job_index < P.MAX_JOBS:
        raise ConfigError(f"job index {job_index} outside 0..{P.MAX_JOBS - 1}")
    room = target_of(sw).max_jobs(sw.p4info)
    held = set(held) - set(others) - {job.job_id}
    if len(others) + len(held) >= room:
        left = f" and {len(held)} removed jobs' lookup entries stay ({sorted(held)}: " \
               f"leftovers, `thc controller remove --job N` takes them off)" if held else ""
        raise ConfigError(f"job {job.job_id}: the {target_of(sw).name} program's lookup tables "
                          f"hold {room} jobs at once, and {len(others)} stay installed "
                          f"({', '.join(str(j) for j in sorted(others))}){left}; remove one "
                          f"first")
    if job.pool_base + job.pool_size > P.SWITCH_SLOTS:
        last = job.pool_base + job.pool_size - 1
        raise ConfigError(f"job {job.job_id}: pool {job.pool_base}..{last}"
                          f" does not fit the switch's {P.SWITCH_SLOTS} slots")
    for w in job.workers:
        if not target_of(sw).front_panel(w.switch_port):
            raise ConfigError(f"job {job.job_id} worker {w.id}: switch_port {w.switch_port} "
                              f"is not a front-panel port ({target_of(sw).front_panel_ports})")
        if ipaddress.IPv4Address(w.ip).is_loopback:
            raise ConfigError(f"job {job.job_id} worker {w.id}: ip {w.ip} is a loopback "
                              f"address, which no host sends from or takes results at over a "
                              f"switch port (a cluster written for the loopback testbed); give "
                              f"the worker its host's address")
        if w.mac.lower() in forwarding.UNROUTABLE:
            raise ConfigError(f"job {job.job_id} worker {w.id}: mac {w.mac} (the default when "
                              f"a worker gives none) cannot be answered: the switch sends "
                              f"results to the worker's MAC; give the worker its `mac`")
        if forwarding.is_group(w.mac):
            raise ConfigError(f"job {job.job_id} worker {w.id}: mac {w.mac} is a multicast "
                              f"(group) address, no one host's: the switch sends results to "
                              f"the worker's MAC; give the worker its own")
    _check_own_macs(job)
    for jid, cfg in others.items():
        if cfg["job_index"] == job_index:
            raise ConfigError(f"job index {job_index} is taken by job {jid}")
        if cfg["mcast_grp"] == job.mcast_grp:
            raise ConfigError(f"multicast group {job.mcast_grp} is taken by job {jid}")
        lo, hi = cfg["pool_base"], cfg["pool_base"] + cfg["pool_size"]
        if pools_overlap(job.pool_base, job.pool_size, lo, cfg["pool_size"]):
            raise ConfigError(f"job {job.job_id}'s slot pool {job.pool_base}.."
                              f"{job.pool_base + job.pool_size - 1} overlaps job {jid}'s "
                              f"{lo}..{hi - 1}")
        _check_addresses(job, jid, cfg.get("addresses", ()))


def check_room(sw: Switch, cluster_jobs: list[int], staying: list[int],
               held: frozenset[int]) -> None:
    """ConfigError when a cluster's jobs, with the installed jobs it leaves and removed jobs'
    lookup leftovers, outnumber the jobs the program's lookup tables hold: said of the
    cluster as a whole, before :func:`check_job` would name one of its jobs as the one too
    many and its others as installed."""
    room = target_of(sw).max_jobs(sw.p4info)
    if len(cluster_jobs) + len(staying) + len(held) <= room:
        return
    beside = f", and {len(staying)} installed jobs it does not name stay " \
             f"({', '.join(str(j) for j in sorted(staying))}; --prune removes them)" \
        if staying else ""
    left = f", and {len(held)} removed jobs' lookup entries stay ({sorted(held)}: leftovers, " \
           f"`thc controller remove --job N` takes them off)" if held else ""
    raise ConfigError(f"the cluster has {len(cluster_jobs)} jobs "
                      f"({', '.join(str(j) for j in cluster_jobs)}){beside}{left}; the "
                      f"{target_of(sw).name} program's lookup tables hold {room} jobs at once")


def check_routes(sw: Switch, new_jobs, freed=frozenset()) -> None:
    """ConfigError when ``l2_forward`` lacks room for the routes of the jobs' worker MACs it
    does not hold yet: routes added by hand share the table, and a full one stopped an
    install part-way, after its job and lookup entries. ``freed``: routes the install takes
    off before it adds any (those of the jobs it prunes)."""
    have = set(forwarding.routes(sw)) - set(freed)
    new = {w.mac.lower() for j in new_jobs for w in j.workers} - have - forwarding.UNROUTABLE
    size = sw.tables.get(L2_TABLE, "table").size
    if new and len(have) + len(new) > size:
        raise ConfigError(f"{L2_TABLE} holds {size} routes and has {len(have)}: the workers' "
                          f"{len(new)} new MACs do not fit; remove routes added by hand "
                          f"(thc controller l2 remove) or jobs no longer used")


def check_agg(agg_ip: str, agg_mac: str, agg_port: int = P.UDP_PORT) -> None:
    """ConfigError when results from the switch could not reach a worker: they leave with
    ``agg_ip``/``agg_mac`` as their source, and a worker's stack drops a loopback or
    unspecified source (127.0.0.1 is what a cluster without ``agg_ip`` gets); or when the
    workers' packets would never reach the program: it takes THC's UDP port only, and
    workers send to ``agg_port``."""
    if agg_port != P.UDP_PORT:
        raise ConfigError(f"the cluster's agg_port {agg_port} is not the switch's: the switch "
                          f"program aggregates packets to UDP port {P.UDP_PORT} only, and "
                          f"forwards others as plain traffic; leave agg_port out of the "
                          f"cluster or give {P.UDP_PORT}")
    check_address("the aggregator (the switch)", agg_ip, agg_port)   # unspecified, multicast
    check_mac("the aggregator (the switch)", agg_mac)
    if ipaddress.IPv4Address(agg_ip).is_loopback:
        raise ConfigError(f"the cluster's agg_ip {agg_ip} is a loopback address (127.0.0.1 "
                          f"is the default where a cluster gives no agg_ip), which no switch "
                          f"has: workers drop results from it; give the cluster the switch's "
                          f"agg_ip (e.g. 10.0.0.254)")
    if agg_mac.lower() in forwarding.UNROUTABLE or forwarding.is_group(agg_mac):
        raise ConfigError(f"the cluster's agg_mac {agg_mac} cannot be a switch's address (no "
                          f"frame comes from the all-zero, broadcast or a group address); "
                          f"give the cluster the switch's agg_mac (e.g. 02:00:00:00:00:fe)")


def check_beside_agg(job: Job, agg_ip: str, agg_mac: str) -> None:
    """ConfigError for a worker at the switch's own address: its packets to the switch would
    stay in its own host, and frames to the switch's MAC would be routed to its port."""
    for w in job.workers:
        if w.ip == agg_ip or w.mac.lower() == agg_mac.lower():
            raise ConfigError(f"job {job.job_id} worker {w.id}: ip {w.ip} / mac {w.mac} is the "
                              f"switch's own (agg_ip {agg_ip}, agg_mac {agg_mac}); give the "
                              f"worker its host's address")


def _check_own_macs(job: Job) -> None:
    """One MAC names one host within a job too: two switch ports (l2_forward keeps one) or
    two IPs under one MAC leave a worker unanswered."""
    first: dict[str, object] = {}
    for w in job.workers:
        mac = w.mac.lower()
        o = first.setdefault(mac, w)
        if (o.ip, o.switch_port) != (w.ip, w.switch_port):
            raise ConfigError(f"job {job.job_id} worker {w.id}: MAC {w.mac} belongs to {o.ip} "
                              f"on switch port {o.switch_port} (worker {o.id}), not {w.ip} on "
                              f"port {w.switch_port}")


def _check_addresses(job: Job, other_id: int, addresses) -> None:
    """Workers of two jobs may share a host (MAC and IP, other UDP port) but never an
    ip:port (the switch could not tell whose packet it is), and one MAC may not name two
    hosts (two IPs, or two switch ports for l2_forward)."""
    for w in job.workers:
        mac = w.mac.lower()
        for ip, port, omac, oport in addresses:
            if (w.ip, w.port) == (ip, port):
                raise ConfigError(f"job {job.job_id} worker {w.id}: address {w.ip}:{w.port} "
                                  f"is used by a worker of job {other_id}")
            if mac == omac and mac not in forwarding.UNROUTABLE and (
                    w.ip != ip or (oport is not None and w.switch_port != oport)):
                raise ConfigError(
                    f"job {job.job_id} worker {w.id}: MAC {w.mac} belongs to {ip} on switch "
                    f"port {oport} in job {other_id}, not {w.ip} on port {w.switch_port}")


def config_of(job: Job, job_index: int) -> dict:
    """A job as ``check_job`` sees the others: set_job parameters and addresses."""
    return {"job_index": job_index, "mcast_grp": job.mcast_grp, "pool_base": job.pool_base,
            "pool_size": job.pool_size,
            "addresses": [(w.ip, w.port, w.mac.lower(), w.switch_port) for w in job.workers]}


def free_index(taken: set[int]) -> int:
    free = [i for i in range(P.MAX_JOBS) if i not in taken]
    if not free:
        raise ConfigError(f"the switch holds {P.MAX_JOBS} jobs already")
    return free[0]
