"""Marsit: one sign bit per coordinate through a ring all-reduce, merged at every hop, or
counted by a switch or the software aggregator (a vote).

Each worker sends the sign of its compensated gradient (an exact zero as a fair coin's, so
its expectation stays 0). In the ring's reduce-scatter, a
chunk that already merges the bits of k workers meets a new worker, which keeps its own bit
with probability 1/(k+1) and otherwise forwards the incoming one: no hop decompresses or
re-compresses, and every final bit is the sign of a uniformly chosen worker, so its
expectation is the workers' mean sign (unbiased). The all-gather then spreads the merged
bits. A small all-reduce carries the scales (the workers' mean absolute value, one per
segment: per parameter tensor in the DDP hook, as layers differ in magnitude by orders), and
the global compensation keeps, on every worker, what the shared estimate missed of its own
gradient (error feedback against the global estimate), which keeps training convergent.

In the network (:class:`MarsitVoteAllReduce`), a vote job of the same protocol as THC counts
the +1 bits of every coordinate (the switch adds, never decompresses); the count c of n gives
the exact mean sign (2c - n) / n instead of one random worker's sign.

Bytes on the wire per worker: 2 (p - 1) / p * d / 8 for d coordinates through the ring;
d / 8 up and d counts (8-bit) down through the vote; plus the scales.
"""
from __future__ import annotations

import math
import operator
import zlib

import torch
import torch.distributed as dist

from thc.codec.common import (NonFiniteInput, as_float32, cast_estimate, check_float,
                              scale_factor)
from thc.codec.packing import pack_bits, unpack_bits
from thc.collective import agreement, checkpoint
from thc.collective.transports import DistTransport, members, rank_in, ring_bytes, round_lock
from thc.collective.worker import device_of

COMPENSATED_LIMIT = float(torch.finfo(torch.float32).max) / 2
"""With compensation, the largest magnitude a round takes: the estimate is no larger than the
largest input of any worker, so the residual x - estimate stays finite in float32 (one of
3e38 against an estimate of -3e38 made it Inf, and every later round NaN)."""

RESIDUAL_LIMIT = COMPENSATED_LIMIT / 2
"""The residual kept is clamped to it, so that only a gradient over half the limit itself is
refused: an unclamped residual over the limit would have every later round refused (NaN for
good under "propagate")."""


def merge(incoming: torch.Tensor, own: torch.Tensor, merged: int,
          generator: torch.Generator | None = None) -> torch.Tensor:
    """The bit that leaves a hop: ``own`` with probability 1/(merged + 1), else ``incoming``
    (which already stands for ``merged`` workers). Bits are bool tensors."""
    if merged < 1:
        raise ValueError(f"an incoming chunk merges at least one worker, got {merged}")
    keep = torch.rand(own.shape, generator=generator, device=own.device) < 1.0 / (merged + 1)
    return torch.where(keep, own, incoming)


def ring_merge(signs: list[torch.Tensor], generator: torch.Generator | None = None
               ) -> torch.Tensor:
    """The merged bits a ring of ``len(signs)`` workers produces for one chunk, in one process
    (the hops in ring order); what the statistical tests check."""
    acc = signs[0]
    for k, own in enumerate(signs[1:], start=1):
        acc = merge(acc, own, k, generator)
    return acc


def _check_cpu_coins(coins, what: str) -> None:
    """Refuses what a CPU generator would not take as its state, before a load takes any."""
    try:
        torch.Generator().set_state(coins)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"{what} is not a CPU generator's state ({e})") from None


class _SignAllReduce:
    """Compensation, scales and the estimate shared by the ring and the vote; subclasses say
    how the workers' sign bits become the mean-sign estimate.

    ``compensation`` keeps one residual per call site: call one instance per tensor (or
    bucket) of fixed size, as the DDP hook does.
    """

    kind: tuple = ()
    """What the agreement key names besides the layout: ranks running unlike reducers (the
    ring and the vote, a mean and a majority) refuse the round together."""

    def __init__(self, group=None, compensation: bool = True, nonfinite: str = "raise",
                 name=None):
        """``nonfinite``: what a round in which some worker's gradient (with its
        compensation) holds NaN or Inf, or with compensation a magnitude over
        :data:`COMPENSATED_LIMIT`, gives (:data:`thc.collective.agreement.NONFINITE`):
        a refusal on every worker, which forgets the compensation ("raise"), or NaN on every
        worker, the compensation kept ("propagate": ``torch.amp.GradScaler`` then skips the
        step). ``name``: as :class:`thc.collective.allreduce.THCAllReduce`'s."""
        self.nonfinite = agreement.nonfinite_mode(nonfinite)
        self.group = group
        self.rank = rank_in(group)
        self.world = dist.get_world_size(group)
        self._members = members(group)
        self._domain = self._group_now()
        self.name = agreement.identify(self._domain, name)
        self.compensation = compensation
        self._coin = torch.Generator().manual_seed(0x4D415253 + dist.get_rank(group))
        """Fair coins for exact zeros: private to the worker, not drawn alike on every rank."""
        self.residual: torch.Tensor | None = None
        self.bytes_sent = 0
        self.round = 0
        """Calls so far, refused ones included: the agreement's round lanes."""
        self._scaled = False
        """Whether this call's scales were summed (:meth:`__call__`)."""
        self._voted = False
        """Whether this call's signs came back from an aggregator (a vote's)."""

    def skip_to(self, rnd: int) -> None:
        """Take round ``rnd`` next where it is ahead (rounds never go back: each draws its
        own rotation and rounding); a DDP hook's ``no_sync`` count (``BaseHook._count_round``).
        Refused as :func:`agreement.skipped_to` says."""
        self.round = agreement.skipped_to(self.round, rnd)

    @property
    def kept_residual(self) -> torch.Tensor | None:
        """The compensation residual the next round adds (None: none yet, or none kept)."""
        return self.residual

    @property
    def state_owner(self) -> dict:
        """As :attr:`thc.collective.allreduce.THCAllReduce.state_owner`."""
        return checkpoint.owner(self.rank, self.world, self._members, self.name)

    def state_dict(self) -> dict:
        """What a restarted worker needs to go on as this reducer would (:mod:`thc.collective.
        checkpoint`): its next round, a copy of its compensation residual, its coins' state
        and its owner."""
        return {**checkpoint.state(self.round, self.residual, self.state_owner),
                "coin": self._coin.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Take :meth:`state_dict`'s state before the first round (this reducer's own):
        checked whole before any of it is taken."""
        rnd, residual = checkpoint.loaded(state, self.round, self.compensation,
                                          type(self).__name__, self.state_owner)
        checkpoint.within(residual, RESIDUAL_LIMIT, type(self).__name__)
        coin = state.get("coin")
        if coin is not None:
            _check_cpu_coins(coin, f"{type(self).__name__}: the state's 'coin'")
        self._check_extra(state)
        self.round, self.residual = rnd, residual
        if coin is not None:
            self._coin.set_state(coin)
        self._take_extra(state)

    def _check_extra(self, state: dict) -> None:
        """A subclass's own part of the state, checked before anything is taken."""

    def _take_extra(self, state: dict) -> None:
        """A subclass's own part of the state, taken once all of it was checked."""

    def _group_now(self):
        return self.group if self.group is not None else dist.group.WORLD

    def mean_sign(self, own: torch.Tensor) -> torch.Tensor:
        """From this worker's bits (bool, True = +1) to the shared estimate of the workers'
        mean sign (the same tensor on every worker)."""
        raise NotImplementedError

    def rescale_residual(self, factor: float) -> None:
        """The gradients' scale changed by ``factor`` (new / old): the compensation residual
        follows it. Call between rounds."""
        factor = scale_factor(factor)
        if self.residual is not None:
            self.residual = self.residual * factor

    def __call__(self, grad: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """The estimate of the workers' mean of ``grad``; ``sizes`` splits it into segments
        with a scale each (default: one)."""
        agreement.check_domain(self._domain, self._group_now())
        grad, failure = agreement.input_of(grad, device_of(self._domain))
        try:
            if failure is not None:
                raise failure
            # no autograd history: the residual would chain every round's graph to the next
            flat = grad.detach().reshape(-1)   # a sparse tensor has no flat view
            check_float(flat)         # the signs of a complex or integer tensor mean nothing
            flat = as_float32(flat)
            sizes = [flat.numel()] if sizes is None else [operator.index(n) for n in sizes]
            if self.compensation and self.residual is not None:
                if self.residual.shape != flat.shape:
                    raise ValueError(f"Marsit: residual of {self.residual.numel()} elements, "
                                     f"gradient of {flat.numel()}: use one instance per tensor")
                flat = flat + self.residual
            if sum(sizes) != flat.numel() or any(n < 0 for n in sizes):
                raise ValueError(f"Marsit: segments {sizes} do not split {flat.numel()} "
                                 f"elements")
            self._ready(flat.device)
        except Exception as e:  # noqa: BLE001 - every worker raises it in the agreement
            failure = e
            try:   # the stand-in of its marked round
                flat = agreement.stand_in(grad.numel, grad.device)
            except BaseException as lost:   # Ctrl-C: its peers wait in the agreement
                DistTransport.abandon_group(self.group, f"Marsit round {self.round}: its "
                                            f"refused input's stand-in could not be made "
                                            f"({type(lost).__name__}: {lost})")
                raise
            sizes = [flat.numel()]
        with round_lock(self._domain):   # the ring's and the scales' tensors carry no tag
            # the scales' all-reduce is as long as the segments: agree on them first
            rnd, self.round = self.round, self.round + 1
            key = agreement.key_of("marsit", *self.kind, flat.numel(), tuple(sizes),
                                   self.nonfinite, self.name, agreement.half_type(grad.dtype),
                                   agreement.shape_of(grad.shape))
            self.bytes_sent += agreement.together(self.group, rnd, key, flat.device, failure)
            if flat.numel() == 0:      # every rank agreed on it: nothing to send
                return grad.clone()
            self._scaled = self._voted = False
            try:
                return self._round(grad, flat, sizes)
            except BaseException as e:
                # this worker's own failure: its peers wait in a collective or go on to their
                # next, which would pair with its next. Once the scales are summed, not so for
                # their NaN's refusal, which every worker reaches alike (and a vote's counts
                # out of range, once its signs came back); a vote's peers send their signs to
                # the aggregator instead (:meth:`_left`)
                why = f"Marsit round {rnd} failed after its agreement ({type(e).__name__}: {e})"
                if not self._scaled:
                    DistTransport.abandon_group(self.group, why)
                elif not isinstance(e, NonFiniteInput):
                    self._left(why)
                raise

    def _ready(self, device: torch.device) -> None:
        """Raises where this worker cannot run a round on ``device``: before the agreement,
        so that every worker refuses the round (mid-ring, its peers would wait on it)."""

    def _left(self, why: str) -> None:
        """This worker failed after the scales' all-reduce, its peers going on to the ring,
        whose collectives its next would pair with: it abandons the process group."""
        DistTransport.abandon_group(self.group, why)

    def _round(self, grad: torch.Tensor, flat: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        # A worker with NaN or Inf still joins the scales' all-reduce, with NaN scales: the
        # sum carries them to every worker, and all refuse the round (none waits). Scales in
        # float64: a float32 sum of huge values would overflow on every worker alike.
        why, scale = self._scales(flat, sizes)
        dist.all_reduce(scale, group=self.group)
        self._scaled = True
        self.bytes_sent += ring_bytes(scale, self.world)
        if why or not bool(torch.isfinite(scale).all()):
            if self.nonfinite == "propagate":   # every worker sees the NaN sum alike
                return torch.full_like(grad, float("nan"))
            self.residual = None   # every worker refuses the round and compensates anew
            raise NonFiniteInput((f"Marsit: the gradient (with its compensation) {why}" if why
                                  else "Marsit: a worker's gradient (with its compensation) "
                                  "holds NaN or Inf, or a magnitude beyond the compensation's "
                                  "limit: the round is refused") + agreement.PROPAGATE_HINT)
        scale /= self.world
        per_coord = scale.float().repeat_interleave(torch.tensor(sizes, device=flat.device))
        estimate = self.mean_sign(self._signs(flat)) * per_coord
        out = cast_estimate(estimate.reshape(grad.shape), grad.dtype)
        if self.compensation:   # of what is applied: a float16 estimate held to its range
            self.residual = (flat - out.reshape(-1).float()).clamp_(-RESIDUAL_LIMIT,
                                                                    RESIDUAL_LIMIT)
        return out

    def _scales(self, flat: torch.Tensor, sizes: list[int]) -> tuple[str, torch.Tensor]:
        """Why the round cannot take ``flat`` ("" where it can), and this worker's mean
        magnitude of each segment (NaN where it cannot)."""
        top = float(flat.abs().max())   # NaN where flat holds one
        why = ("holds NaN or Inf" if not math.isfinite(top) else
               f"holds a magnitude of {top:.3g}, over {COMPENSATED_LIMIT:.3g} (half of "
               f"float32's largest), where its compensation residual would overflow"
               if self.compensation and top > COMPENSATED_LIMIT else "")
        if why:
            return why, torch.full((len(sizes),), float("nan"), dtype=torch.float64,
                                   device=flat.device)
        return why, torch.stack([part.abs().double().sum() / max(1, part.numel())
                                 for part in flat.split(sizes)])

    def _signs(self, flat: torch.Tensor) -> torch.Tensor:
        """This worker's bits (True = +1); an exact zero's bit is a fair coin."""
        bits = flat > 0
        zeros = flat == 0
        count = int(zeros.sum())
        if count:
            bits[zeros] = (torch.rand(count, generator=self._coin) < 0.5).to(flat.device)
        return bits


class MarsitAllReduce(_SignAllReduce):
    """Sign-bit ring all-reduce of one tensor over a torch.distributed group (Gloo or NCCL),
    merging at every hop (:func:`merge`)."""

    kind = ("ring",)

    def __init__(self, group=None, generator: torch.Generator | None = None,
                 compensation: bool = True, nonfinite: str = "raise", name=None):
        """``generator``: the merges' coins; by default one of the reducer's own, keyed by
        its rank and name and made on the gradients' device, not torch's global generator,
        which the training draws from on another thread (and which a checkpoint would then
        have to hold)."""
        super().__init__(group, compensation, nonfinite, name)
        self.generator = generator
        self._own_merges: torch.Generator | None = None
        self._merges_state: tuple[str, torch.Tensor] | None = None
        """A loaded state of the reducer's own merge coins, taken when they are made."""

    def _merge_coins(self, device: torch.device) -> torch.Generator:
        if self.generator is not None:
            return self.generator
        made = self._own_merges
        if made is None or made.device.type != device.type:
            if self._merges_state is not None and self._merges_state[0] != device.type:
                raise ValueError(f"{type(self).__name__}: the loaded merge coins are a "
                                 f"{self._merges_state[0]} generator's, the gradients are "
                                 f"on {device.type}")
            seed = 0x4D455247 + self.rank + (zlib.crc32(str(self.name).encode()) << 20)
            made = torch.Generator(device=device).manual_seed(seed)
            if self._merges_state is not None:
                made.set_state(self._merges_state[1])
                self._merges_state = None
            self._own_merges = made
        return made

    def _ready(self, device: torch.device) -> None:
        self._merge_coins(device)

    def state_dict(self) -> dict:
        """:meth:`_SignAllReduce.state_dict`'s, and the state of the reducer's own merge
        coins (a caller's ``generator`` is the caller's to restore)."""
        own = self._own_merges
        merges = (own.device.type, own.get_state()) if own is not None else self._merges_state
        return {**super().state_dict(), "merges": merges}

    def _check_extra(self, state: dict) -> None:
        merges = state.get("merges")
        if merges is not None and self.generator is None:
            kind, coins = merges if isinstance(merges, (tuple, list)) and len(merges) == 2 \
                else (None, None)
            if kind not in ("cpu", "cuda") or not isinstance(coins, torch.Tensor) \
                    or coins.dtype != torch.uint8:
                raise ValueError(f"{type(self).__name__}: 'merges' holds (device type, a "
                                 f"generator's uint8 state), not {merges!r:.80}")
            if kind == "cpu":   # a CUDA generator's is checked when the coins are made
                _check_cpu_coins(coins, f"{type(self).__name__}: 'merges'")

    def _take_extra(self, state: dict) -> None:
        merges = state.get("merges")
        if merges is not None and self.generator is None:
            self._merges_state, self._own_merges = (merges[0], merges[1].cpu()), None

    def _peer(self, offset: int) -> int:
        r = (self.rank + offset) % self.world
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, send, self._peer(1), self.group),
               dist.P2POp(dist.irecv, recv, self._peer(-1), self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.bytes_sent += send.numel() * send.element_size()

    def mean_sign(self, own: torch.Tensor) -> torch.Tensor:
        p, d = self.world, own.numel()
        chunk = -(-d // (8 * p)) * 8          # bits per chunk, a whole number of bytes
        padded = torch.zeros(chunk * p, dtype=torch.bool, device=own.device)
        padded[:d] = own
        mine = padded.reshape(p, chunk)
        acc = mine.clone()
        buf = torch.empty(chunk // 8, dtype=torch.uint8, device=own.device)
        for step in range(p - 1):
            send_idx, recv_idx = (self.rank - step) % p, (self.rank - step - 1) % p
            self._exchange(pack_bits(acc[send_idx], 1), buf)
            incoming = unpack_bits(buf, 1, chunk).bool()
            acc[recv_idx] = merge(incoming, mine[recv_idx], step + 1,
                                  self._merge_coins(own.device))
        done = (self.rank + 1) % p
        for step in range(p - 1):
            send_idx, recv_idx = (done - step) % p, (done - step - 1) % p
            self._exchange(pack_bits(acc[send_idx], 1), buf)
            acc[recv_idx] = unpack_bits(buf, 1, chunk).bool()
        return acc.reshape(-1)[:d].float() * 2 - 1


def counts_to_mean_sign(counts: torch.Tensor, n_workers: int,
                        majority: bool = False, voters: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Counts of +1 votes among ``n_workers`` -> the mean sign (2c - n) / n, or with
    ``majority`` the majority's sign (a tie counts 0). ``voters``: per coordinate, the
    workers counted (a chunk closed short counts fewer): (2c - k) / n, a missing worker's
    vote as 0, as THC counts a missing worker's value."""
    if n_workers < 1:
        raise ValueError(f"a vote needs at least one worker, got {n_workers}")
    if voters is not None and voters.numel() and \
            bool(((voters < 0) | (voters > n_workers)).any()):
        bad = int(voters.max()) if bool((voters > n_workers).any()) else int(voters.min())
        raise ValueError(f"{bad} voters among {n_workers} workers")
    k = torch.full_like(counts, n_workers) if voters is None else voters
    if counts.numel() and bool((counts < 0).any()):
        raise ValueError(f"{int(counts.min())} +1 votes: a count is never negative")
    if counts.numel() and bool((counts > k).any()):
        raise ValueError(f"more +1 votes than workers counted ({int(counts.max())} among "
                         f"{n_workers} workers)")
    diff = counts.float() * 2 - k.float()
    return torch.sign(diff) if majority else diff / n_workers


class MarsitVoteAllReduce(_SignAllReduce):
    """Sign bits counted in the network: a vote job of the THC protocol (switch or software
    aggregator) adds the +1 bits of every coordinate, the client turns counts into the mean
    sign (or the majority's, ``majority``). The scales go over ``group`` (Gloo)."""

    def __init__(self, client, group=None, compensation: bool = True, majority: bool = False,
                 nonfinite: str = "raise", name=None):
        if client.job.aggregation != "vote":
            raise ValueError(f"job {client.job.job_id} aggregates {client.job.aggregation!r}; "
                             f"Marsit's vote needs a vote job (Job.vote)")
        super().__init__(group, compensation, nonfinite, name)
        self.kind = ("vote", bool(majority))
        if client.job.n_workers != self.world:
            raise ValueError(f"vote job of {client.job.n_workers} workers, process group of "
                             f"{self.world}")
        self.client = client
        self.majority = majority

    def _left(self, why: str) -> None:
        """The peers' signs went to the aggregator, not a collective: unless this worker's
        came back (its sequence numbers in step), its next vote would take their round's and
        add into its counts (a vote's offsets are every round's), so its client's run takes
        no more rounds."""
        if not self._voted:
            self.client.fail_run(why)

    def mean_sign(self, own: torch.Tensor) -> torch.Tensor:
        d, lanes = own.numel(), self.client.job.lanes
        padded = torch.zeros(-(-d // lanes) * lanes, dtype=torch.bool)
        padded[:d] = own.cpu()
        before = self.client.stats.bytes_sent
        r = self.client.reduce(pack_bits(padded, 1).numpy())
        self._voted = True
        self.bytes_sent += self.client.stats.bytes_sent - before
        # a chunk closed short (bounded loss) counts only the workers in its bitmap
        voters = torch.from_numpy(r.counts.astype("int64")).repeat_interleave(lanes)[:d]
        est = counts_to_mean_sign(torch.from_numpy(r.sums[:d].astype("int64")),
                                  self.client.job.n_workers, self.majority, voters)
        return est.to(own.device)
