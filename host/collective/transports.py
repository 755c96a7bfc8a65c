"""The transports of a THC all-reduce: what does its two collective steps (the max of the
slice norms, the sum of table values).

- :class:`AggregatorTransport`: the switch or the software aggregator (UDP, 4-bit indices up,
  sums down), through :class:`thc.net.client.AggregationClient`;
- :class:`DistTransport`: an ordinary ``torch.distributed`` all-reduce (Gloo, NCCL) of the
  table values, for clusters without a programmable switch: THC sums are integers, so any
  all-reduce adds them exactly.

``transport.sum`` returns the sums and, when a round closed short (DLCP's bounded loss), a
:class:`Short`: how many workers each lane actually had and whether this worker's own value
was among them.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from thc.codec.common import wire_sum_dtype
from thc.codec.params import THCParams
from thc.codec.thc import table_values
from thc.collective.worker import agree_run, checks_given_run, job_seat
from thc.wire import protocol as P


def ring_bytes(t: torch.Tensor, world: int) -> int:
    """What one worker sends in a ring all-reduce of ``t`` among ``world``: 2 (p-1)/p of it.
    Every all-reduce of the project is counted so, FP32's and THC's alike."""
    return 2 * (world - 1) * t.numel() * t.element_size() // world


def paired(vals: torch.Tensor) -> torch.Tensor:
    """What carries 16-bit sums through an all-reduce: neither Gloo nor NCCL sums int16, so
    two lanes ride in each int32 word (a zero lane pads an odd count). Exact: every lane's
    sum is below 2^15 (``wire_sum_dtype``), so none carries into its neighbour or the sign.
    Other types go as they are."""
    if vals.dtype != torch.int16:
        return vals
    if vals.numel() % 2:
        vals = torch.cat([vals, vals.new_zeros(1)])
    return vals.contiguous().view(torch.int32)


@dataclass
class Short:
    """Per lane of a round that closed short: workers counted, and whether this one was."""
    counts: np.ndarray
    mine: np.ndarray


_deferring = threading.local()


@contextlib.contextmanager
def run_agreement_deferred():
    """Aggregator transports built inside (on this thread) agree their client's run only when
    :meth:`AggregatorTransport.agree_run` is called. A DDP hook builds a bucket's reducer so,
    agrees that every rank's build went well, then has the run agreed: a rank whose factory
    failed before its transport would otherwise join the hook's agreement while its peers
    waited in the run's."""
    before = getattr(_deferring, "on", False)
    _deferring.on = True
    try:
        yield
    finally:
        _deferring.on = before


_ROUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ROUNDS_LOCK = threading.Lock()


def round_lock(domain) -> threading.Lock:
    """The lock a reducer holds from the first exchange of a round to its last, one per
    domain its rounds pair on (an aggregator client, a process group). Two threads' reducers
    on one domain would otherwise interleave their rounds' exchanges in unlike orders on each
    worker: one's sums paired with the other's on a peer (a DATA taking the sequence number
    a peer gave the other's, an all-reduce of integer sums meeting another tensor's), a sum
    of two tensors that passed every check. Held, a round's exchanges stay together, and
    rounds of one scheme that two workers run in unlike orders meet at their tag lanes,
    refused (a THC round's agreement meeting a Marsit round's, one lane longer, is ended by
    Gloo aborting a process). An aggregator client holds its own (reentrant), which its
    calls from another thread meet, refused."""
    own = getattr(domain, "round_lock", None)
    if own is not None:
        return own
    with _ROUNDS_LOCK:
        return _ROUNDS.setdefault(domain, threading.Lock())


def holding(transport):
    """The transport's round lock (its ``one_round``), to hold for a round; a stand-in
    transport without one (tests) holds nothing."""
    one_round = getattr(transport, "one_round", None)
    return one_round() if one_round is not None else contextlib.nullcontext()


def codec_mismatch(job, params: THCParams) -> str | None:
    """Why ``job``'s aggregator cannot sum indices encoded under ``params`` (None where it
    can): it carries 4-bit indices, and adds the job's own lookup table."""
    if params.bits != P.INDEX_BITS:
        return (f"the aggregation protocol carries {P.INDEX_BITS}-bit indices; THC "
                f"bits={params.bits} needs the torch.distributed transport")
    if tuple(int(v) for v in params.table) != tuple(job.table):
        return (f"job {job.job_id} has granularity {job.granularity} and lookup table "
                f"{list(job.table)}, the codec's is {[int(v) for v in params.table]}")
    return None


class AggregatorTransport:
    """Sums through an aggregator: the indices travel packed, the table lives in the network.

    A client not given a run id (none, or ``THC_RUN``'s) gets one agreed over ``group``
    (:func:`agree_run`), every rank's checked against the others' there; where ``group`` is
    the job's workers, a run id given to the client is checked there too, so that ranks given
    ids on some ranks only, or different ones, all raise at once instead of one waiting in
    the agreement its peers skip. Built under :func:`run_agreement_deferred` (a DDP hook's
    factory), it agrees when :meth:`agree_run` is called instead. Build a client's
    transports on one thread, in the same order on every rank: builds on several threads
    at once agree in unlike orders, and are refused."""

    def __init__(self, client, group=None):
        self._group = group
        self._run_agreed = False
        self.client = client
        if not getattr(_deferring, "on", False):
            self.agree_run()
        self.domain = client
        """What this transport's rounds pair on: the client's (agreement.identify)."""
        self.n_workers = client.job.n_workers
        self.rank = client.worker_id
        self.members = ("job", client.job.job_id)
        """Whose workers this transport's are: the aggregator job's."""
        self.bytes_sent = 0
        """UDP payload bytes this worker sent in the MAX and DATA rounds (the client's count)."""
        self.datapath: str | None = None
        """The client datapath that ran the last round."""
        self.short_chunks = 0
        """Chunks of this transport's rounds that ended short (DLCP's bounded loss)."""

    @property
    def run_group(self):
        """The process group the run agreement takes (:meth:`agree_run`): its one collective."""
        return self._group

    def abandon(self, why: str, summed: bool = False) -> None:
        """This worker failed after its MAX round: unless its sums all came back
        (``summed``: its sequence numbers are in step with its peers'), its peers' DATA holds
        the slots its next round would take, so its client's run takes no more rounds
        (:meth:`thc.net.client.AggregationClient.fail_run`)."""
        if not summed:
            self.client.fail_run(why)

    def check(self, params: THCParams) -> None:
        why = codec_mismatch(self.client.job, params)
        if why:
            raise ValueError(f"{why}: install the job with the same bits/granularity/p")

    def one_round(self):
        """The client's round lock (:func:`round_lock`): a client takes one exchange at a
        time, but a round is several (the size agreement, MAX, DATA per piece)."""
        return round_lock(self.client)

    def agree_run(self) -> None:
        """The client's run id agreed over the group, or checked there (the class's
        docstring); once."""
        if self._run_agreed:
            return
        client, workers = self.client, self.client.job.n_workers
        job_sized = checks_given_run(self._group, workers)
        if not client.run_settled or job_sized:
            DistTransport.check_group(self._group)   # a round left its peers mid-round
            run = agree_run(self._group, alone=workers == 1,
                            given=client.run if client.run_settled else None,
                            seat=job_seat(client.worker_id, client.job) if job_sized else None)
            if run != client.run:
                client.run = run
            client.run_settled = True
        self._run_agreed = True

    def _check_agreed(self) -> None:
        """Raise where a deferred run agreement was never made: the run would go unchecked."""
        if not self._run_agreed:
            raise RuntimeError("this transport was built under run_agreement_deferred() and "
                               "its client's run was never agreed: call agree_run() on every "
                               "worker before its first round")

    def max(self, norms: torch.Tensor) -> torch.Tensor:
        self._check_agreed()
        before = self.client.stats.bytes_sent
        out = self.client.max(norms.detach().cpu().numpy())
        self.bytes_sent += self.client.stats.bytes_sent - before
        return torch.from_numpy(out).to(norms.device)

    packed = True
    """What :meth:`sum` takes: the packed wire form the codec's fused encode writes."""

    @property
    def lanes(self) -> int:
        """Coordinates per chunk: priority classes are given per chunk of lanes."""
        return self.client.job.lanes

    def sum(self, packed: torch.Tensor, count: int, params: THCParams, classes=None):
        """(sums of ``count`` coordinates, None or :class:`Short`); ``packed``: their 4-bit
        indices in wire form; ``classes``: a priority class per chunk of lanes."""
        self._check_agreed()
        client = self.client
        lanes = client.job.lanes
        wire = packed.cpu().numpy() if isinstance(packed, torch.Tensor) else packed
        pad = (-count) % lanes
        if pad:
            wire = np.concatenate([wire, np.zeros((count + pad) // 2 - wire.size, np.uint8)])
        before = client.stats.bytes_sent
        r = client.reduce(wire, classes=classes)
        sums = r.sums[:count]
        self.bytes_sent += client.stats.bytes_sent - before
        self.datapath = r.datapath
        short = None
        if r.short(self.n_workers):
            self.short_chunks += int(np.count_nonzero(r.counts < self.n_workers))
            mine = (r.bitmaps >> client.worker_id) & 1 == 1
            short = Short(np.repeat(r.counts, lanes)[:count], np.repeat(mine, lanes)[:count])
        return torch.from_numpy(sums.astype(np.int32)).to(packed.device), short


def rank_in(group) -> int:
    """This process's rank in ``group`` (None: the default group). torch answers -1 for a
    process outside the group, whose collectives there then fail with errors that do not say
    so: it is refused here, when the reducer is built."""
    import torch.distributed as dist
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the process group it builds a "
                         "reducer on: build it on the group's members only")
    return rank


def members(group) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: the default group), in its rank order: with the
    rank in it, which process this is, whichever groups of its size there are."""
    import torch.distributed as dist
    return tuple(dist.get_process_group_ranks(group if group is not None
                                              else dist.group.WORLD))


class DistTransport:
    """Sums through ``torch.distributed.all_reduce`` of table values (narrowest exact dtype)."""

    _abandoned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    """Process group -> why no THC round may use it any more (see :meth:`abandon`)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self.dist = dist
        self.group = group
        self.rank = rank_in(group)
        self.n_workers = dist.get_world_size(group)
        self.members = members(group)
        """The group's global ranks (:func:`members`)."""
        self.bytes_sent = 0
        """Bytes this worker sends in its all-reduces, counted as a ring all-reduce sends them
        (2 (p-1)/p of the tensor), as the FP32 and FP16 hooks count theirs."""
        self.stream_ordered = dist.get_backend(group) == "nccl"
        """NCCL adds on the device's stream: a round needs no host wait in between."""
        self.agree_each_round = not self.stream_ordered
        """Gloo aborts a process whose all-reduce differs in length from its peers': every
        round starts with the fixed-length agreement (four lanes), so that workers whose
        tensors differ in slice count refuse the round instead."""

    def check(self, params: THCParams) -> None:
        pass

    def _group(self):
        """The process group this transport's collectives use now (``group=None``: the
        default group of the moment, which a re-init replaces)."""
        return self.group if self.group is not None else self.dist.group.WORLD

    @property
    def domain(self):
        """What this transport's rounds pair on: the process group (agreement.identify)."""
        return self._group()

    def abandon(self, why: str, summed: bool = False) -> None:
        """This worker left a round between its collectives, or failed after them (``summed``
        or not) while its peers went on: any later collective of its on this process group
        would pair with a peer's pending one (NCCL does not check that they match), so the
        project issues none (the first reason is kept); the peers' own collectives time out.
        What does not pass through :meth:`max` and :meth:`sum` (a replayed CUDA graph, a DDP
        hook's FP32 spans) calls :meth:`check_group` first."""
        DistTransport.abandon_group(self.group, why)

    @staticmethod
    def abandon_group(group, why: str) -> None:
        """:meth:`abandon` for ``group`` (None: the default group now), by a caller without a
        transport: it asks nothing of the group, which may be failing."""
        import torch.distributed as dist
        group = group if group is not None else dist.group.WORLD
        if group is not None:   # None: no process group any more, nothing to pair with
            DistTransport._abandoned.setdefault(group, why)

    def usable(self) -> None:
        """Raise if a round on this transport's process group was abandoned."""
        DistTransport.check_group(self.group)

    @staticmethod
    def check_group(group) -> None:
        """Raise if a round on ``group`` (None: the default group now) was abandoned."""
        import torch.distributed as dist
        group = group if group is not None else dist.group.WORLD
        why = DistTransport._abandoned.get(group) if group is not None else None
        if why is not None:
            raise RuntimeError(f"no THC round may use this process group any more: {why}; its "
                               f"workers' collectives are out of step (restart the job)")

    def one_round(self) -> threading.Lock:
        """The process group's round lock (:func:`round_lock`): its integer sums carry no
        tag of their round."""
        return round_lock(self._group())

    def max(self, norms: torch.Tensor) -> torch.Tensor:
        self.usable()
        out = norms.detach().clone()
        self.bytes_sent += ring_bytes(out, self.n_workers)
        self.dist.all_reduce(out, op=self.dist.ReduceOp.MAX, group=self.group)
        return out

    packed = False
    """What :meth:`sum` takes: indices, whose table values are summed."""
    lanes = None
    short_chunks = None

    def sum(self, indices: torch.Tensor, count: int, params: THCParams, classes=None):
        self.usable()
        # the codec's own indices: in the table by construction
        vals = table_values(indices, params, checked=False).to(
            wire_sum_dtype(self.n_workers, params))
        words = paired(vals)
        self.bytes_sent += ring_bytes(words, self.n_workers)
        self.dist.all_reduce(words, group=self.group)
        return (vals if words is vals else words.view(torch.int16)[: vals.numel()]), None
