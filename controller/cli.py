"""``thc controller``: program a switch over P4Runtime: BMv2's simple_switch_grpc, or a
Tofino's bf_switchd (``--target tofino``; it loads its program itself, so no push).

  thc controller push [--program thc|l2]        load the compiled program from p4src/build
  thc controller install --config cluster.json  install/update every job of a cluster
                                                (unchanged jobs are left alone)
  thc controller remove --job N                 delete one job's entries, group and routes

``install`` and ``remove`` refuse to change a job whose workers are sending unless
``--force`` is given.
  thc controller jobs                           list installed jobs
  thc controller counters [--json]              drops by reason, per-job counters
  thc controller l2 add|del MAC [PORT]          non-THC forwarding entries
  thc controller --target tofino --dry-run install --config cluster.json
                                                print the writes of the install, one line
                                                an entity, as on a switch holding no jobs,
                                                without connecting
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from thc.argtypes import non_negative_int, positive_int, seconds
from thc.controller import (counters, dryrun, forwarding, installed, job_checks, job_entries,
                            jobs, program, targets)
from thc.controller.switch import DEFAULT_DEVICE_ID, DEFAULT_GRPC, NoProgram, Switch, SwitchError
from thc.lifetime import Terminated, stopped_by
from thc.wire.jobs import MAX_JOB_ID, Cluster, ConfigError


def _switch_options(parser: argparse.ArgumentParser, defaults: bool = True,
                    dry_run: bool = True) -> None:
    """The options of every action; without ``defaults`` (an action's own copy) each is
    set only where given, so they may stand before the action or after it. ``dry_run``:
    whether ``--dry-run`` is among them (only install's copy has it)."""
    def opt(*names, default=None, **kw):
        parser.add_argument(*names, **kw,
                            default=default if defaults else argparse.SUPPRESS)

    opt("--grpc-addr", type=_grpc_address, default=DEFAULT_GRPC, metavar="HOST:PORT",
        help=f"P4Runtime server (default {DEFAULT_GRPC})")
    opt("--device-id", type=_uint64, default=DEFAULT_DEVICE_ID,
        help="P4Runtime device id (simple_switch_grpc --device-id; default 0)")
    opt("--election-id", type=_election, default=None, metavar="HIGH,LOW",
        help="the P4Runtime session's election id (default: for the actions "
             "that write, one of the session's own, lower than any earlier "
             "writer's; 0,PID for jobs, counters and l2 list, so that a "
             "reader never takes a writer's place)")
    opt("--timeout", type=seconds, default=5.0,
        help="seconds to wait for the P4Runtime server (default 5)")
    opt("--target", default=targets.DEFAULT, choices=sorted(targets.TARGETS),
        help=f"the switch's program: bmv2 (p4src/thc.p4) or tofino "
             f"(p4src/thc_tna.p4); default {targets.DEFAULT}")
    opt("--build-dir", default=None,
        help="where the compiled program is (default p4src/build for bmv2, "
             "p4src/build/tofino for tofino)")
    if dry_run:
        opt("--dry-run", action="store_true", default=False,
            help="install only: print the writes it would make on a switch that "
                 "holds no jobs, from the target's P4Info, without connecting")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _switch_options(parser)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, dry_run: bool = False, **kw) -> argparse.ArgumentParser:
        p = sub.add_parser(name, **kw)
        _switch_options(p, defaults=False, dry_run=dry_run)
        return p

    p = action("push", help="load the compiled P4 program (clears all switch state: refused "
                             "while a job's workers are sending)")
    p.add_argument("--program", default="thc", choices=["thc", "l2"],
                   help="thc (default), or l2: plain L2 forwarding alone (the baseline of "
                        "`thc bench switch`)")
    p.add_argument("--force", action="store_true",
                   help="push even while a job's workers are sending")

    p = action("install", dry_run=True, help="install or update the jobs of a cluster config")
    p.add_argument("--config", required=True, help="cluster JSON (host/wire/jobs.py Cluster)")
    p.add_argument("--push", action="store_true",
                   help="push the program first, which removes every installed job (refused "
                        "while one is live)")
    p.add_argument("--prune", action="store_true",
                   help="remove installed jobs that the config does not list")
    p.add_argument("--force", action="store_true",
                   help="change or remove jobs even while their workers are sending")

    p = action("remove", help="remove one job")
    p.add_argument("--job", type=_job_id, required=True, metavar="JOB_ID",
                   help="the job's id in its cluster config (`jobs` lists them)")
    p.add_argument("--force", action="store_true",
                   help="remove the job even while its workers are sending")

    action("jobs", help="list installed jobs")

    p = action("counters", help="drop and per-job counters")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = action("l2", help="list, add or delete the switch's plain L2 forwarding entries "
                          "(l2_forward: frames that are not THC's)")
    p.add_argument("op", choices=["add", "del", "list"],
                   help="add MAC PORT, del MAC, or list")
    p.add_argument("mac", nargs="?", help="add, del: the destination MAC")
    p.add_argument("port", nargs="?", type=non_negative_int,
                   help="add: the switch port to forward to")


def _grpc_address(text: str) -> str:
    """gRPC's ``HOST:PORT`` (``[IPv6]:PORT``), or ``unix:PATH``: a port that no server can
    have (65536, abc) or no host waited out --timeout, then named no server."""
    if text.startswith("unix:") and len(text) > 5:
        return text
    host, colon, port = text.rpartition(":")
    if not colon or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"HOST:PORT (a port 1..65535) or unix:PATH, not "
                                         f"{text!r}")
    return text


def _job_id(text: str) -> int:
    value = positive_int(text)
    if value > MAX_JOB_ID:
        raise argparse.ArgumentTypeError(f"a job id is 1..{MAX_JOB_ID}, not {value}")
    return value


def _uint64(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"an integer in 0..2^64-1, not {text!r}")
    return value


def _election(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"HIGH,LOW (two integers in 0..2^64-1), not {text!r}")
    hi, lo = (_uint64(x) for x in parts)
    if (hi, lo) == (0, 0):
        raise argparse.ArgumentTypeError("0,0 is no election id (P4Runtime's ids start at 1)")
    return hi, lo


def _placed(cluster: Cluster, placed: dict[int, int], same: set[int], note: str = "") -> None:
    for jid, idx in placed.items():
        job = cluster.job(jid)
        print(f"job {jid}: index {idx}, {job.n_workers} workers, slots "
              f"{job.pool_base}..{job.pool_base + job.pool_size - 1}, "
              f"multicast group {job.mcast_grp}"
              + (" (unchanged, left alone)" if jid in same else "") + note)


class UsageError(ValueError):
    """Arguments that no switch would take: exit status 2, as argparse's own refusals."""


def _dry_run(args: argparse.Namespace, target: targets.Target, cluster: Cluster) -> int:
    if args.action != "install" or args.push:
        raise UsageError("--dry-run shows what `install` (without --push) writes to a switch "
                         "holding no jobs; other actions depend on what the switch holds")
    sw = dryrun.DryRunSwitch(target, args.build_dir)
    placed = jobs.install_cluster(sw, cluster, prune=args.prune, force=args.force)
    _placed(cluster, placed, set(), f" (dry run, {target.name})")
    print(f"dry run: {sw.writes} writes to a {target.name} switch ({sw.lanes} lanes)")
    return 0


def _refuse_live_before_push(args: argparse.Namespace, election: tuple[int, int]) -> None:
    """A push removes every job: JobLive if one is live. A switch without a program holds no
    job to protect; one that cannot be read is not pushed to."""
    with Switch(args.grpc_addr, args.device_id, election, timeout=args.timeout,
                require_primary=False) as sw:
        try:
            sw.connect(program=None)
        except NoProgram:
            return
        jobs.refuse_live_jobs(sw, "pushing a program, which removes every job,")


def _run(args: argparse.Namespace) -> int:
    target = targets.get(args.target)
    build_dir = args.build_dir or target.build_dir
    cluster = Cluster.load(args.config) if args.action == "install" else None
    if args.dry_run:
        return _dry_run(args, target, cluster)
    push = None
    if args.action == "push":
        push = args.program
    elif args.action == "install" and args.push:
        push = target.program
    if push and target.push_refusal:
        raise ValueError(f"cannot push to a {target.name} switch: {target.push_refusal}")
    if push and cluster is not None:
        # the push wipes every job: check the cluster against the program first
        jobs.check_cluster(dryrun.DryRunSwitch(target, build_dir, out=lambda line: None),
                           cluster, prune=args.prune)
    read_only = args.action in ("jobs", "counters") or (args.action == "l2" and args.op == "list")
    election = args.election_id or ((0, os.getpid()) if read_only else None)
    if push and not args.force:   # it only reads
        _refuse_live_before_push(args, args.election_id or (0, os.getpid()))
    if args.action == "l2":
        _check_l2(args, target)
    with Switch(args.grpc_addr, args.device_id, election, timeout=args.timeout,
                require_primary=not read_only) as sw:
        sw.connect(program=push, build_dir=build_dir)
        if args.action in ("install", "remove") and sw.target not in (None, target):
            raise ValueError(f"the switch at {args.grpc_addr} runs the {sw.target.name} "
                             f"program, not {target.name}: pass --target {sw.target.name}")
        if args.action == "install":
            _install(sw, args, cluster)
        else:
            ACTIONS[args.action](sw, args)
    return 0


def _check_l2(args: argparse.Namespace, target: targets.Target) -> None:
    """``l2 OP`` given what it takes, before any session (a missing MAC was found only once
    connected, and a MAC given to ``list`` or a PORT to ``del`` was ignored), its MAC in
    canonical form and routable, its port one a host can sit at."""
    takes = {"add": ("MAC", "PORT"), "del": ("MAC",), "list": ()}[args.op]
    given = tuple(name for name, value in (("MAC", args.mac), ("PORT", args.port))
                  if value is not None)
    if given != takes:
        raise UsageError(f"l2 {args.op} takes {' and '.join(takes) or 'no MAC or PORT'}, "
                         f"given {' and '.join(given) or 'none'}")
    if args.mac is not None:
        try:
            args.mac = forwarding.check_mac(args.mac, f"l2 {args.op}")
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.op == "add" and args.mac in forwarding.UNROUTABLE:
        raise UsageError(f"l2 add: {args.mac} is the all-zero or broadcast MAC, which the "
                         f"controller keeps out of l2_forward; name one host's MAC")
    if args.port is not None and not target.front_panel(args.port):
        raise UsageError(f"l2 add: port {args.port} is not a front-panel port of a "
                         f"{target.name} switch ({target.front_panel_ports})")


def _jobs_of_mac(sw: Switch, mac: str) -> list[int]:
    """The installed jobs (on the THC program) with a worker of MAC ``mac``."""
    if sw.target is None:
        return []
    return sorted(jid for jid, addrs in installed.installed_addresses(sw).items()
                  if any(m == mac for _, _, m, _ in addrs))


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BrokenPipeError:
        raise          # a reader of the output gone: thc's dispatch says which and ends it
    except UsageError as e:
        print(f"thc controller: {e}", file=sys.stderr)
        return 2
    except (SwitchError, ConfigError, ValueError, OSError) as e:
        print(f"thc controller: {e}", file=sys.stderr)
        return 1


def _push(sw: Switch, args: argparse.Namespace) -> None:
    print(f"pushed {args.program} ({sw.lanes} lanes) to {args.grpc_addr}"
          if args.program == "thc" else f"pushed {args.program} to {args.grpc_addr}")


def _install(sw: Switch, args: argparse.Namespace, cluster: Cluster) -> None:
    job_checks.check_program(sw)     # before reading entries in the program's shape
    agg = job_entries.AggAddress.of(cluster)
    same = {j.job_id for j in cluster.jobs if installed.unchanged(sw, j, agg)}
    pruned = sorted((set(installed.installed_jobs(sw)) | set(installed.leftovers(sw)))
                    - {j.job_id for j in cluster.jobs}) if args.prune else []
    touched = ", ".join(map(str, sorted({j.job_id for j in cluster.jobs} - same | set(pruned))))
    with _interrupted(f"installing: job(s) {touched} may be half-written (`thc controller "
                      f"jobs` names a job NOT serving and leftover entries); run the same "
                      f"install again" if touched else "installing: no job was being changed"):
        placed = jobs.install_cluster(sw, cluster, prune=args.prune, force=args.force)
    _placed(cluster, placed, same)
    for jid in pruned:
        print(f"job {jid}: removed (not in the config; --prune)")


def _remove(sw: Switch, args: argparse.Namespace) -> None:
    with _interrupted(f"removing job {args.job}: entries of it may remain (`thc controller "
                      f"jobs` lists them); run the same remove again"):
        removed = jobs.remove_job(sw, args.job, force=args.force)
    if removed:
        print(f"removed job {args.job}")
    else:
        print(f"removed the leftover entries of job {args.job} (it had no thc_job entry)")


@contextlib.contextmanager
def _interrupted(what: str):
    """Ctrl-C (or SIGTERM, SIGHUP) in the middle of writes says what it left part-way, then
    ends the command as any such signal does (thc's dispatch: one line, its status)."""
    try:
        yield
    except (KeyboardInterrupt, Terminated) as e:
        print(f"thc controller: {stopped_by(e)[0]} while {what}", file=sys.stderr)
        raise


def _listing(sw: Switch) -> tuple[dict, dict, dict, dict, list]:
    """The installed jobs, leftovers, conflicts, worker entries a job and stray multicast
    groups, read table by table."""
    held = installed.installed_jobs(sw)
    return (held, installed.leftovers(sw), installed.conflicts(sw),
            {jid: len(installed.worker_entries_of(sw, jid)) for jid in held},
            installed.stray_groups(sw))


def _jobs(sw: Switch, args: argparse.Namespace) -> None:
    held, left, wrong, live, stray = first = _listing(sw)
    if left or wrong or stray or any(live[j] != cfg["n_workers"] for j, cfg in held.items()):
        # tables read while another controller writes disagree for a moment: read again
        held, left, wrong, live, stray = second = _listing(sw)
        if second != first:
            print("the switch changed while it was read (another controller is writing?): "
                  "this is a second read, which may be mid-change too; run `jobs` again once "
                  "that controller is done")
    if not held:
        print("no jobs installed")
    for group in stray:
        print(f"multicast group {group}: named by no job (an install stopped part-way); the "
              f"next install deletes it")
    for jid, tables in sorted(left.items()):
        print(f"job {jid}: NOT installed, but entries of it remain in {', '.join(tables)} "
              f"(an install or remove stopped part-way); `remove --job {jid}` deletes them")
    for jid, cfg in sorted(held.items()):
        state = "" if live[jid] == cfg["n_workers"] else \
            f" (NOT serving: {live[jid]} of {cfg['n_workers']} worker entries; install it again)"
        print(f"job {jid}: " + ", ".join(f"{k}={v}" for k, v in cfg.items()) + state)
        for why in wrong.get(jid, ()):
            print(f"job {jid}: NOT consistent: {why}; install the cluster again")


def _counters(sw: Switch, args: argparse.Namespace) -> None:
    # the l2 program (`thc bench switch`'s baseline) has l2_misses alone
    held = installed.installed_jobs(sw) if sw.has_table(program.JOB_TABLE) else {}
    snap = counters.snapshot(sw, held)
    if args.json:
        print(json.dumps(snap, indent=2, sort_keys=True))
        return
    if "drops" in snap:
        print("drops: " + ", ".join(f"{k}={v}" for k, v in snap["drops"].items()))
    print(f"l2 misses: {snap['l2_misses']}"
          + (f", dscp unknown: {snap['dscp_unknown']}" if "dscp_unknown" in snap else ""))
    for jid, c in snap.get("jobs", {}).items():
        print(f"job {jid}: " + ", ".join(f"{k}={v}" for k, v in c.items()))


def _l2(sw: Switch, args: argparse.Namespace) -> None:
    if args.op == "list":
        routes = forwarding.routes(sw)
        for mac, port in sorted(routes.items()):
            print(f"{mac} -> port {port}")
        if not routes:
            print("l2_forward: no entries")
    elif owners := _jobs_of_mac(sw, args.mac):
        raise ValueError(f"l2 {args.op}: {args.mac} is a worker MAC of job(s) {owners}, "
                         f"whose install keeps its route: change the job's config and "
                         f"install it again")
    elif args.op == "add":
        forwarding.install(sw, {args.mac: args.port})
        print(f"l2_forward: {args.mac} -> port {args.port}")
    elif not forwarding.remove(sw, [args.mac]):
        raise ValueError(f"no l2_forward entry for {args.mac}")
    else:
        print(f"l2_forward: deleted {args.mac}")


ACTIONS = {"push": _push, "remove": _remove, "jobs": _jobs, "counters": _counters, "l2": _l2}
"""What each action does with the open session (install takes its cluster too)."""
