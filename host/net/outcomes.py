"""What a round of the aggregation client ends with: its result, its counters, and the
failures it raises. Below the client and its windows, which all use them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thc.wire import protocol as P


@dataclass
class AggregationResult:
    """One round's outcome: per lane its sum (or max), per chunk how many workers were counted
    and which (a chunk closed short by DLCP's bounded loss counts fewer than all), and the
    datapath that ran the round ("compiled" or "python")."""

    sums: np.ndarray
    counts: np.ndarray
    bitmaps: np.ndarray
    datapath: str

    def short(self, n_workers: int) -> bool:
        """Whether some chunk closed with fewer than ``n_workers``."""
        return bool(self.counts.size) and int(self.counts.min()) < n_workers


def host_port(addr: tuple) -> str:
    """``ip:port`` of a socket address (an IPv6 one, a 4-tuple, as ``[ip]:port``)."""
    ip, port = addr[0], addr[1]
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _who(aggregator: tuple, shard: int | None) -> str:
    name = "the aggregator" if shard is None else f"aggregator shard {shard}"
    return f"{name} at {host_port(aggregator)}"


class AggregatorRestarted(ConnectionError):
    """The aggregator's epoch changed within a run: it restarted, or the job was installed
    again, and the run's in-flight chunks are lost.

    Start a new run (new run id, sequence numbers from 0): it starts on clean slots."""

    def __init__(self, aggregator: tuple[str, int], run: int, old_epoch: int, new_epoch: int,
                 shard: int | None = None):
        super().__init__(f"{_who(aggregator, shard)} restarted or re-installed the job during "
                         f"run {run}: its epoch changed from {old_epoch:#010x} to "
                         f"{new_epoch:#010x}, so the run's in-flight chunks are lost; start a "
                         f"new run")
        self.aggregator = aggregator
        self.shard = shard
        self.run = run
        self.old_epoch = old_epoch
        self.new_epoch = new_epoch


class AggregatorMisconfigured(RuntimeError):
    """The aggregator holds this worker's job with another configuration: its epoch's tag
    (``Job.config_tag``) is not this worker's, so its sums, possible as they may look, are
    not of this worker's table, width, lanes, pool or workers."""

    def __init__(self, aggregator: tuple[str, int], job_id: int, theirs: int, ours: int,
                 shard: int | None = None):
        super().__init__(f"{_who(aggregator, shard)} serves job {job_id} with another "
                         f"configuration than this worker's (tag {theirs:#06x}, this worker's "
                         f"{ours:#06x}): its table, granularity, sum width, lanes, pool or "
                         f"workers differ. Install it from the workers' cluster file, or, where "
                         f"this worker's peers run with it as installed, give this worker "
                         f"their cluster file")
        self.aggregator, self.shard, self.theirs, self.ours = aggregator, shard, theirs, ours


class AggregationTimeout(TimeoutError):
    """A chunk did not complete in time; ``missing`` names the workers that never contributed,
    ``shard`` the chunk's shard (0 for an unsharded job; None where not known)."""

    def __init__(self, msg: str, missing: list[int] | None, shard: int | None = None):
        super().__init__(msg)
        self.missing = missing
        self.shard = shard


class AggregationRefused(RuntimeError):
    """The aggregator refused a chunk of this run (a REFUSED reply): ``reason`` is the drop
    reason (protocol.json), ``detail`` what the aggregator holds instead (stale_run: the
    job's run; stale: the slot's newer seq; wrong_use: the use's packet type; reused_run:
    the first incarnation's nonce). 0 is no value of these: from an aggregator that does
    not report it, the message leaves it out."""

    HINTS = {
        "stale_run": "the job belongs to another run{detail} that is active: a run takes "
                     "an active job over only with an id newer by at most {jump} (the "
                     "default clock id of a later launch), any run once the job has been "
                     "idle for {idle} s; restarted workers need a new run id",
        "stale": "the slot already holds a newer chunk{detail} of this run: a worker "
                 "of the run is out of step (restarted with the same run id?), or another "
                 "process sends from a worker's address",
        "wrong_use": "the chunk's slot is in use by another kind of round or another offset"
                     "{detail}: the workers of this run are out of step",
        "wrong_slot": "the packet named a slot or version that is not its sequence number's",
        "reused_run": "another incarnation of this worker{detail} already sent "
                      "chunks under this run id: restarted workers need a new run id (a "
                      "launcher must give a fresh THC_RUN or --run-id at every launch; "
                      "torchrun's restarts add their count to either)",
        "wrong_shard": "the shard{detail} does not own this chunk in its own shard map: the "
                       "workers and the shards were given different shard maps",
        "malformed": "the packet broke a rule of the aggregator's own (a Tofino takes offsets "
                     "below 2^31: the round's offsets passed that)",
        "wrong_config": "the packet's configuration tag is not the one the aggregator's "
                        "install of the job carries, though the reply's epoch names this "
                        "worker's: the worker sends another tag than its job's (a bug)",
    }
    UNDEFINED = ("a refusal this protocol does not define: the aggregator speaks another "
                 "version of the protocol, or is broken")
    SHOW = {"stale_run": " ({})", "stale": " (seq {})", "wrong_use": " (packet type {})",
            "reused_run": " (nonce {:#010x})"}
    UNREPORTED = {"stale_run": "; a Tofino, which does not name the job's run, also holds a "
                               "job silent for 39 to 78 hours as active (its clock wraps every "
                               "78 hours): install the job again"}
    """Added where the aggregator sent no detail."""

    def __init__(self, where: str, reason: str, detail: int):
        shown = self._shown(reason, detail)
        hint = self.HINTS.get(reason, self.UNDEFINED).format(detail=shown, jump=P.RUN_JUMP,
                                                             idle=P.RUN_IDLE_S)
        if not detail:
            hint += self.UNREPORTED.get(reason, "")
        super().__init__(f"{where}: refused by the aggregator ({reason}): {hint}")
        self.reason = reason
        self.detail = detail

    @classmethod
    def _shown(cls, reason: str, detail: int) -> str:
        if not detail:
            return ""
        if reason == "wrong_shard":
            shard, n_shards = P.shard_in_detail(detail)
            return f" (shard {shard} of {n_shards})" if shard < n_shards else ""
        return cls.SHOW.get(reason, "").format(detail)


class LossBoundExceeded(RuntimeError):
    """A chunk came back closed short (a FLUSH counted fewer than every worker) beyond what
    this worker's loss bound lets a round lose: its peers run with a larger bound, or one
    sent FLUSH for chunks it never sent. Taken, it would count a gradient share as lost
    that no rule of this job allowed to be."""

    def __init__(self, where: str, count: int, n_workers: int, missing: list[int],
                 loss_bound: float, cap: int, chunks: int):
        allowed = (f"its loss bound {loss_bound:g} lets {cap} of the round's {chunks} chunks "
                   f"end short (n x floor(bound x chunks): each worker counts its own)"
                   if loss_bound else "it has no loss bound (0), so no chunk may end short")
        super().__init__(f"{where}: closed short, counting {count} of {n_workers} workers "
                         f"(workers {missing} missing), beyond this worker's loss bound: "
                         f"{allowed}. Every worker of a job must run with the job's "
                         f"loss_bound; a peer with a larger one, or one that sent FLUSH for "
                         f"chunks it never sent, closes chunks this worker may not lose")
        self.count, self.missing, self.cap = count, missing, cap


class ClientClosed(RuntimeError):
    """A round called on a client after its ``close()``: its socket is gone."""


class RunFailed(RuntimeError):
    """An earlier round of this run failed, so its sequence numbers are spoilt: the slots may
    hold that round's sums or this worker's old contribution, and a retry would be answered
    from them. Start a new run (``client.run = ...``, a newer id, the same on every worker)."""


@dataclass
class TransportStats:
    sent: int = 0
    retransmitted: int = 0
    received: int = 0
    ignored: int = 0
    other_run: int = 0
    pending: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    flushed: int = 0
    """FLUSH packets sent (chunks this worker asked to close short; repeats included)."""
    short: int = 0
    """Chunks that ended with fewer than all workers (whoever closed them)."""
    rounds: int = 0
    """Rounds (aggregate/max calls with chunks to send) this client began."""
    compiled_rounds: int = 0
    """Of ``rounds``, those the compiled datapath ran; the others ran in Python."""
    rejected: int = 0
    """Replies from the right address for a chunk in flight that were impossible (the wrong
    type or size, count and bitmap at odds, sums no contributors can make): counted in
    ``ignored`` too. Many of them point at an aggregator configured with another job."""
    drained: int = 0
    """Datagrams found queued when a round began, dropped unread: no packet of the round
    had been sent, so none can answer it (a predecessor's results, late duplicates)."""
    spurious: int = 0
    """Timeouts found spurious (see host/net/window.py's RttEstimator): each gave an RTT
    sample from the chunk's first send, which Karn's rule would have thrown away."""
    elsewhere: int = 0
    """Replies to this worker of its job from the port of the chunk's aggregator at another
    IP: counted in ``ignored`` too. An aggregator (or a NAT before it) that answers from
    another address than the one workers send to is never heard."""
    strays: int = 0
    """Replies from the chunk's aggregator's address that answer no chunk of this worker in
    flight (another worker id, job id or packet type, or another offset, slot or version):
    counted in ``ignored`` too. An aggregator that answers every send with these is not
    silent: it writes another job's or worker's ids, or rewrites those fields."""
    queue_full: int = 0
    """Datagrams this worker's own send queue refused (ENOBUFS, EAGAIN, ENOMEM): lost before
    the wire, as the network may lose them, and resent on their timers. A round that times
    out says how many of its own were refused: a queue that stays full looks, from the
    aggregator, like a missing worker."""
    gso_sends: int = 0
    """UDP GSO sends of the compiled window, each several DATA datagrams in one trip down the
    stack (``sent`` counts the datagrams)."""
    gro_bursts: int = 0
    """Receive buffers of the compiled window that held several replies (UDP GRO): one trip
    up the stack for a burst (``received`` counts the datagrams)."""
