"""What the switch holds: the jobs installed, their entries and addresses, and whether a job
is installed exactly as configured. The switch is the only record: a restarted controller
reads it here."""
from __future__ import annotations

from thc.controller import forwarding, p4rt
from thc.controller.frames import mac_str
from thc.controller.job_entries import (AggAddress, addr_entries, install_entry, job_entry,
                                        worker_entries)
from thc.controller.job_checks import pools_overlap, target_of
from thc.controller.program import ADDR_TABLE, INSTALL_TABLE, JOB_TABLE, WORKER_TABLE
from thc.controller.switch import Switch
from thc.wire import protocol as P
from thc.wire.jobs import Job


def installed_jobs(sw: Switch) -> dict[int, dict]:
    """{job_id: set_job parameters} of the jobs on the switch."""
    fid = sw.field_id(JOB_TABLE, "job_id")
    return {sw.match_values(e)[fid]: sw.param_values(e) for e in sw.read_table(JOB_TABLE)}


def worker_entries_of(sw: Switch, job_id: int) -> list:
    """The job's thc_worker entries: all n_workers of them once an install finished."""
    return entries_of(sw, WORKER_TABLE, job_id)


def install_epochs(sw: Switch, job_id: int) -> list[int]:
    """The epochs of the job's thc_install entries: one once an install finished."""
    fid = sw.field_id(INSTALL_TABLE, "epoch")
    return [sw.match_values(e)[fid] for e in entries_of(sw, INSTALL_TABLE, job_id)]


def entries_of(sw: Switch, table: str, job_id: int, field: str = "job_id") -> list:
    """The entries of ``table`` whose ``field`` (the job id, or a job index) is ``job_id``."""
    fid = sw.field_id(table, field)
    return [e for e in sw.read_table(table) if sw.match_values(e)[fid] == job_id]


def lut_entries_of(sw: Switch, table: str, job_id: int, job_index: int) -> list:
    """A lookup table's entries of one job: keyed on its id (BMv2) or its index (Tofino)."""
    if "job_id" in sw.key_names(table):
        return entries_of(sw, table, job_id)
    return entries_of(sw, table, job_index, "job_index")


def lut_tables(sw: Switch, by_job_id: bool = False) -> list[str]:
    """The lookup tables of the program (short names ``thc_lut_*``), in P4Info order;
    ``by_job_id``: only if they are keyed on the job id (BMv2), else none."""
    return [t.preamble.name for t in sw.p4info.tables
            if t.preamble.name.rsplit(".", 1)[-1].startswith("thc_lut_")
            and (not by_job_id or any(f.name == "job_id" for f in t.match_fields))]


def worker_macs(sw: Switch, job_id: int | None = None, exclude: int | None = None) -> set[str]:
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


def canonical(entry) -> bytes:
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


def unchanged(sw: Switch, job: Job, agg: AggAddress, job_index: int | None = None) -> bool:
    """Whether the switch holds exactly ``job`` (entries, group, routes), so installing it
    again would only reset slots that its workers may be using.

    Of the lookup tables, the first and the last are compared: every lookup table derives
    from the job's table and is written in one step, before the worker entries (the last
    write), so an install cut short leaves the worker entries missing, which the comparison
    sees."""
    if any(w.switch_port is None for w in job.workers):
        return False   # not a job a switch takes: the install refuses it, naming why
    installed = installed_jobs(sw)
    cfg = installed.get(job.job_id)
    if cfg is None or (job_index is not None and cfg["job_index"] != job_index):
        return False
    if P.epoch_tag(cfg["epoch"]) != job.config_tag:
        # another configuration's epoch (what the entries do not hold: the granularity, a
        # table the compared lookups agree on, or an install from before epochs had tags)
        return False
    luts = lut_tables(sw)
    checked = [luts[0], luts[-1]] if luts else []
    wanted = [job_entry(sw, job, cfg["job_index"], cfg["epoch"]),
              install_entry(sw, job.job_id, cfg["epoch"]), *worker_entries(sw, job),
              *addr_entries(sw, job, agg),
              *target_of(sw).lut_entries(sw, job, cfg["job_index"], tables=checked)]
    have = [*(e for table in (JOB_TABLE, INSTALL_TABLE, WORKER_TABLE, ADDR_TABLE)
              for e in entries_of(sw, table, job.job_id)),
            *(e for table in checked
              for e in lut_entries_of(sw, table, job.job_id, cfg["job_index"]))]
    if sorted(map(canonical, wanted)) != sorted(map(canonical, have)):
        return False
    replicas = {(w.switch_port, w.id + 1) for w in job.workers}
    if sw.multicast_groups().get(job.mcast_grp) != replicas:
        return False
    routes = forwarding.routes(sw)
    return all(routes.get(w.mac.lower()) == w.switch_port for w in job.workers
               if w.mac.lower() not in forwarding.UNROUTABLE)


def installed_configs(sw: Switch) -> dict[int, dict]:
    installed = installed_jobs(sw)
    addresses = installed_addresses(sw)
    return {jid: {**cfg, "addresses": addresses.get(jid, [])} for jid, cfg in installed.items()}


def conflicts(sw: Switch) -> dict[int, list[str]]:
    """{job_id: what is wrong} of jobs whose entries disagree, as an install or remove cut
    short can leave them: a job whose workers' packets count (it has thc_worker entries)
    without one thc_install entry of its own epoch (the RESETs of its install are dropped,
    or another install's run), and jobs whose pools overlap (one's packets or queued RESETs
    reach the other's slots) or that share a multicast group (one's results reach the other's
    workers). An install of the cluster mends them."""
    held = installed_jobs(sw)
    counting = {jid for jid in held if worker_entries_of(sw, jid)}
    out: dict[int, list[str]] = {}
    for jid, cfg in sorted(held.items()):
        epochs = install_epochs(sw, jid)
        if jid in counting and epochs != [cfg["epoch"]]:
            out.setdefault(jid, []).append(
                f"its packets count, but its thc_install entries name epochs "
                f"{[hex(e) for e in epochs]}, not its job entry's {cfg['epoch']:#x}")
        lo, hi = cfg["pool_base"], cfg["pool_base"] + cfg["pool_size"]
        for other, o in sorted(held.items()):
            if other == jid:
                continue
            if pools_overlap(lo, cfg["pool_size"], o["pool_base"], o["pool_size"]):
                out.setdefault(jid, []).append(
                    f"its slots {lo}..{hi - 1} overlap job {other}'s "
                    f"{o['pool_base']}..{o['pool_base'] + o['pool_size'] - 1}")
            if cfg["mcast_grp"] == o["mcast_grp"]:
                out.setdefault(jid, []).append(
                    f"it shares multicast group {cfg['mcast_grp']} with job {other}")
    return out


def stray_groups(sw: Switch) -> list[int]:
    """Multicast groups no job's entry names. A swap of two jobs' groups cut short keeps the
    rewritten job's old group for the job about to take it; given another group later, that
    job leaves it behind. Nothing is multicast through one (a job's entry names its group
    before the group is written); the next install of a cluster deletes them."""
    named = {cfg["mcast_grp"] for cfg in installed_jobs(sw).values()}
    return sorted(set(sw.multicast_groups()) - named)


def leftovers(sw: Switch) -> dict[int, list[str]]:
    """{job_id: short names of the tables holding its entries} of job ids without a thc_job
    entry: what an install or a remove cut short left (a controller older than the job entry
    going in first and out last). Lookup entries count where they are keyed on the job id
    (BMv2); Tofino's are keyed on a job index and rewritten by the next job there."""
    installed = installed_jobs(sw)
    out: dict[int, list[str]] = {}
    for table in (WORKER_TABLE, INSTALL_TABLE, ADDR_TABLE, *lut_tables(sw, by_job_id=True)[:1]):
        fid = sw.field_id(table, "job_id")
        for jid in sorted({sw.match_values(e)[fid] for e in sw.read_table(table)} - set(installed)):
            out.setdefault(jid, []).append("lookup tables" if table not in (
                WORKER_TABLE, INSTALL_TABLE, ADDR_TABLE) else table)
    return out
