"""What every worker program does before its first round, in one place: join the
torch.distributed process group, agree the run id, and build the aggregation client of its
rank from the cluster file; with the flags of each, so that the training worker, the
benchmark workers and the smoke worker read them alike.

Nothing here imports torch unless a process group is used: the smoke worker runs without.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from datetime import timedelta

from thc.argtypes import defaulted_from, non_negative_int, positive_int, seconds
from thc.codec import settings
from thc.collective import watchdog
from thc.net.addresses import parse_hostport
from thc.net.client import AggregationClient
from thc.net.window import DEFAULT_TIMEOUT
from thc.wire import protocol as P
from thc.wire.jobs import Cluster, loss_bound_arg


def run_arg(text: str) -> int:
    """``--run-id`` as an argparse type: a run id, decimal or ``0x`` hexadecimal."""
    try:
        return P.check_run(int(text, 0))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser, *, process_group: bool = True,
                  deadline: float = 30.0) -> None:
    """A worker's flags: its rank, the process group it joins (``process_group``), and its
    aggregation client (``--config`` onward; a mode without an aggregator refuses them)."""
    parser.add_argument("--rank", type=defaulted_from(non_negative_int, "RANK"),
                        default=os.environ.get("RANK", "0"),
                        help="this worker's rank, its worker id in the job (default: RANK, "
                             "else 0)")
    if process_group:
        group = parser.add_argument_group("process group (torch.distributed, Gloo)")
        group.add_argument("--world", type=defaulted_from(positive_int, "WORLD_SIZE"),
                           default=os.environ.get("WORLD_SIZE", "1"),
                           help="workers in the group (default: WORLD_SIZE, else 1)")
        group.add_argument("--rendezvous", default=None, metavar="IP:PORT",
                           help="TCP rendezvous (default: env://, as torchrun sets it; a "
                                "worker alone without it needs none)")
    client = parser.add_argument_group("aggregation client")
    client.add_argument("--config", help="cluster JSON: the job, its table, the aggregator")
    client.add_argument("--agg", metavar="IP:PORT",
                        help="the aggregator (default: the cluster's; a sharded job's shard "
                             "map names its own)")
    client.add_argument("--run-id", dest="run", type=run_arg, default=None,
                        help="run id, the same on every worker, torchrun's restart count "
                             "added as to THC_RUN (default: THC_RUN, else rank 0's clock "
                             "broadcast over the process group)")
    client.add_argument("--deadline", type=seconds, default=deadline,
                        help=f"seconds a chunk may take before the round fails "
                             f"(default {deadline:g})")
    client.add_argument("--window", type=positive_int, default=None,
                        help="chunks in flight (default: the client's, at most the job's pool)")
    client.add_argument("--rto", type=seconds, default=DEFAULT_TIMEOUT,
                        help="initial retransmission timeout, and the least margin over the "
                             "smoothed round trip, seconds")
    client.add_argument("--loss-bound", type=loss_bound_arg, default=None, metavar="F",
                        help="fraction of a round's chunks, in [0, 1), that may close short "
                             "instead of being retransmitted (default: the job's)")


RENDEZVOUS_GRACE = 1.0
"""Seconds past ``timeout`` before a rendezvous that has not formed ends the process: torch's
store connects again after its own timeout (a rendezvous of 5 s took 15 s, of 10 s 19 s)."""


def init_group(args: argparse.Namespace, timeout: float | None = None) -> None:
    """Join the Gloo process group the flags name (``timeout``: seconds a collective may
    wait, default torch's)."""
    import torch.distributed as dist
    extra = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    if not 0 <= args.rank < args.world:
        # torch would fail on this rank only, and its peers wait out their group's timeout
        raise SystemExit(f"--rank {args.rank} is outside a world of {args.world} workers "
                         f"(ranks 0..{args.world - 1})")
    if not args.rendezvous and "MASTER_ADDR" not in os.environ:
        if args.world != 1:
            raise SystemExit(f"--world {args.world}: give every worker --rendezvous IP:PORT (rank "
                             f"0's address and a free port), or start them with torchrun")
        # one worker alone meets no one: an in-memory store stands in for a rendezvous
        dist.init_process_group("gloo", store=dist.HashStore(), rank=args.rank, world_size=1,
                                **extra)
        return
    init = f"tcp://{args.rendezvous}" if args.rendezvous else "env://"
    where = args.rendezvous or (f"{os.environ.get('MASTER_ADDR')}:"
                                f"{os.environ.get('MASTER_PORT', '?')} (env://)")
    print(f"rank {args.rank} of {args.world}: joining the process group at {where}",
          file=sys.stderr, flush=True)   # a rendezvous no one answers waits its timeout
    timer = None
    if timeout is not None:
        timer = threading.Timer(timeout + RENDEZVOUS_GRACE, watchdog.end_process, (
            f"rank {args.rank} of {args.world}: no process group formed at {where} within "
            f"its timeout, {timeout:g} s",))
        timer.daemon = True
        timer.start()
    try:
        dist.init_process_group("gloo", init_method=init, rank=args.rank,
                                world_size=args.world, **extra)
    except dist.DistError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"rank {args.rank} of {args.world}: no process group formed at "
                         f"{where} ({type(e).__name__}: {first})") from None
    finally:
        if timer is not None:
            timer.cancel()


def live_dist():
    """torch.distributed where a process group is up, else None. A group exists only where
    torch.distributed was imported: looking it up in sys.modules keeps torch out of the
    workers that have none."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def checks_given_run(group, n_workers: int) -> bool:
    """Whether a run id given to a client is still checked over ``group``
    (:func:`agree_run`): where a process group is up and holds as many ranks as the job has
    workers, so that an id given on some ranks only fails at once instead of leaving the
    other ranks alone in the agreement."""
    dist = live_dist()
    return dist is not None and n_workers > 1 and dist.get_world_size(group) == n_workers


def device_of(group, model=None):
    """Where ``group``'s collectives take their tensors: NCCL moves device tensors only, on
    ``model``'s GPU where it has one, else the current one. A reducer's domain that is no
    process group (an aggregator's client) takes CPU tensors."""
    import torch
    import torch.distributed as dist
    if not (group is None or isinstance(group, dist.ProcessGroup)) or \
            dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    on = next((p.device for p in model.parameters() if p.is_cuda), None) if model else None
    return on or torch.device("cuda", torch.cuda.current_device())


MALFORMED = -2
"""What a rank whose own run id does not parse puts in :func:`agree_run`'s all-gather."""


def job_seat(worker_id: int, job) -> tuple[int, int, int, int]:
    """What :func:`agree_run` compares across a job's workers: this worker's id, and its job's
    id, configuration tag and number of aggregators (shards, or one)."""
    return worker_id, job.job_id, job.config_tag, max(1, len(job.shards))


def _seat_errors(seats: list[tuple[int, ...]]) -> str | None:
    """Why ranks holding ``seats`` are not one job's workers, each rank its own."""
    if len({s[1:] for s in seats}) > 1:
        jobs = "; ".join(
            f"rank {r}: " + (f"job {s[1]}, configuration tag {s[2]:#06x}, {s[3]} aggregator"
                             f"{'s' if s[3] > 1 else ''}" if s[0] >= 0 else
                             "a job of another number of workers")
            for r, s in enumerate(seats))
        return (f"the ranks hold unlike jobs ({jobs}): give every rank the same cluster file")
    ids = [s[0] for s in seats]
    for w in sorted(set(ids)):
        ranks = [r for r, i in enumerate(ids) if i == w]
        if len(ranks) > 1:
            return (f"ranks {', '.join(map(str, ranks))} are all worker {w} of job "
                    f"{seats[0][1]}: give each rank a worker id of its own")
    return None


def agree_run(group=None, alone: bool = False, given: int | None = None,
              seat: tuple[int, int, int, int] | None = None) -> int:
    """One run id for every worker of this training run, chosen without asking the aggregator.

    ``THC_RUN`` from the launcher wins; else rank 0's clock (:func:`P.run_from_clock`). With
    a torch.distributed process group every rank of ``group`` takes part in one all-gather,
    whatever it holds: ranks that hold different ids (``THC_RUN`` set on some ranks only) or
    one that does not parse fail at once, each naming the difference, rather than wait in a
    collective the others never join. Without a group only a worker that is ``alone`` in its
    job may draw its own: clocks of separate processes would disagree. (A caller given a run
    id explicitly needs none of this: each job's workers are given theirs; with a group,
    ``given`` is checked against the other ranks' there all the same.) ``seat``
    (:func:`job_seat`, given on every rank of a group of the job's size): ranks that hold
    unlike jobs, or one worker id, fail there too, each naming them (with unlike shard maps
    the rounds would time out naming as missing a worker that sends elsewhere)."""
    dist = live_dist()
    try:
        mine, bad = (P.run_from_env() if given is None else given), None
    except ValueError as e:
        if dist is None:
            raise
        mine, bad = None, e
    if dist is not None:
        import torch
        rank0 = dist.get_rank(group) == 0
        device = device_of(group)
        t = torch.tensor([MALFORMED if bad else -1 if mine is None else mine,
                          P.run_from_clock() if rank0 else -1,
                          *(seat if seat is not None else (-1,) * 4)], dtype=torch.int64,
                         device=device)
        world = dist.get_world_size(group)
        every = [torch.empty_like(t) for _ in range(world)]
        try:
            dist.all_gather(every, t, group=group)   # every rank, whatever it holds
            every = [x.tolist() for x in every]      # an NCCL all-gather is waited for here
        except RuntimeError as e:
            raise RuntimeError(
                f"the run agreement over the process group's {world} ranks failed ({e}); "
                f"every rank joins it but one given its run id whose job has another number "
                f"of workers than the group has ranks (a cluster file unlike this rank's: "
                f"give every rank the same one), or one that stopped before it (its own "
                f"error says why)") from e
        held = [x[0] for x in every]
        if bad is not None:
            raise bad
        if MALFORMED in held:
            raise ValueError(f"rank {held.index(MALFORMED)}'s {P.RUN_ENV} is not a run id "
                             f"(that rank says why)")
        if len(set(held)) > 1:
            ranks = ", ".join(f"rank {r}: {'none' if v < 0 else v}" for r, v in enumerate(held))
            raise ValueError(f"the ranks hold different run ids ({ranks}): give the same "
                             f"one ({P.RUN_ENV} or --run-id) to every rank, or to none")
        seats = [tuple(x[2:]) for x in every]
        if any(s[0] >= 0 for s in seats) and (why := _seat_errors(seats)):
            raise ValueError(why)
        return P.check_run(held[0] if held[0] >= 0 else every[0][1])
    if mine is not None:
        return mine
    if alone:
        return P.run_from_clock()
    raise ValueError(f"no run id: set {P.RUN_ENV} (the same on every worker), pass "
                     f"AggregationClient(run=...), or initialise torch.distributed so rank 0's "
                     f"id can be broadcast")


def worker_client(config: str | os.PathLike | Cluster, rank: int,
                  agg: str | tuple[str, int] | None = None, *, aggregation: str | None = None,
                  run: int | None = None, **options) -> AggregationClient:
    """The client of worker ``rank`` for the cluster's first job doing ``aggregation``
    (``"thc"``, ``"vote"``; default: its first job), sending to ``agg`` (``HOST:PORT`` or a
    pair; default the cluster's aggregator; a sharded job's shard map names its own), in run
    ``run`` (default: :func:`agree_run`). ``options`` go to :class:`AggregationClient`."""
    cluster = config if isinstance(config, Cluster) else Cluster.load(config)
    job = next((j for j in cluster.jobs if aggregation in (None, j.aggregation)), None)
    if job is None:
        raise ValueError(f"{config} has no {aggregation} job")
    if job.shards:
        address = None
    elif agg is None:
        address = (cluster.agg_ip, cluster.agg_port)
    else:
        address = parse_hostport(agg) if isinstance(agg, str) else tuple(agg)
    job_sized = checks_given_run(None, job.n_workers)
    if run is None or job_sized:
        run = agree_run(alone=job.n_workers == 1, given=run,
                        seat=job_seat(rank, job) if job_sized else None)
    return AggregationClient(job, rank, address, run=run, **options)


def client_from_args(args: argparse.Namespace, *, aggregation: str | None = None,
                     cluster: Cluster | None = None, **options) -> AggregationClient:
    """:func:`worker_client` from the flags of :func:`add_arguments` and the process's
    settings (``cluster``: ``--config`` already loaded); ``options`` add to or override the
    flags' client options."""
    if cluster is None and not args.config:
        raise SystemExit("a mode through an aggregator needs --config (the cluster JSON)")
    kw = {"deadline": args.deadline, "window": args.window, "timeout": args.rto,
          "loss_bound": args.loss_bound, "settings": settings.current(), **options}
    run = None if args.run is None else P.after_restarts(args.run)
    return worker_client(cluster or args.config, args.rank, args.agg,
                         aggregation=aggregation, run=run, **kw)


__all__ = ["add_arguments", "init_group", "agree_run", "worker_client", "client_from_args",
           "run_arg"]
