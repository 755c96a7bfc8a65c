"""PyTorch DDP communication hooks: THC (through an aggregator or torch.distributed), FP32
(the baseline, on the same machinery), TopK, Marsit (sign bits merged along a ring, or
counted by a vote job in the network).

Install with ``hook.register(ddp_model)``: the DDP model's process group must hold the
hook's workers. What every hook shares (uncompressed parameters, error feedback per bucket,
``no_sync`` stretches, the communication thread that overlaps backward) is
:class:`thc.collective.ddp_base.BaseHook`'s. :class:`FP32Hook` checks each bucket's split
once and no round after, as DDP's own all-reduce checks none.

``THCHook(..., priorities=True)`` hands THC each bucket's per-element layer positions
(:func:`layer_positions`), so its chunks carry DLCP classes: the layers the next forward pass
needs first get the highest.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from thc.codec.baselines import TopK
from thc.codec.common import NonFiniteInput, cast_estimate, cast_moved, scale_factor
from thc.collective import agreement
from thc.collective.allreduce import THCAllReduce
from thc.collective.ddp_base import BaseHook, HookOptions, layer_positions
from thc.collective.graphed import GraphedAllReduce
from thc.collective.marsit import MarsitAllReduce, MarsitVoteAllReduce
from thc.collective.transports import DistTransport, ring_bytes


class FP32Hook(BaseHook):
    """The FP32 all-reduce (the mean) through the same machinery as the compressing hooks:
    the baseline that leaves only their codec's cost as the difference."""

    def reduce(self, bucket, flat: torch.Tensor, sizes: list[int],
               position: torch.Tensor | None = None, stretches: int = 0) -> torch.Tensor:
        DistTransport.check_group(self.group)   # a failed bucket left its peers mid-round
        try:
            out = flat / self.world   # before the sum, as DDP's hook: a half sum overflows first
        except BaseException as e:
            # before its all-reduce went out (out of memory): the peers wait in theirs
            DistTransport.abandon_group(self.group, f"a bucket of backward failed before its "
                                        f"all-reduce ({type(e).__name__}: {e})")
            raise
        dist.all_reduce(out, group=self.group)
        self.bytes_sent += ring_bytes(out, self.world)
        return out


class THCHook(BaseHook):
    """THC all-reduce of each bucket; ``make_allreducer(group)`` builds one per bucket (its
    own error-feedback residual): a :class:`THCAllReduce`, or on NCCL a
    :class:`GraphedAllReduce`, whose rounds replay from a CUDA graph, through
    torch.distributed on ``group`` (the hook's process group: see the module docstring) or
    through an aggregator. ``priorities``: mark every chunk with its DLCP class (an
    aggregator transport's packets carry it in DSCP). Under ``torch.amp.GradScaler`` build the
    factory's reducers with ``nonfinite="propagate"``: an overflowed step's bucket then comes
    back NaN on every rank, and the scaler skips the step there (and call
    :meth:`rescale_residuals` after each ``scaler.update()``)."""

    def __init__(self, model,
                 make_allreducer: Callable[[object], THCAllReduce | GraphedAllReduce],
                 options: HookOptions = HookOptions(), group=None, overlap: bool = True,
                 priorities: bool = False, comm_group=None):
        super().__init__(model, options, group, overlap, comm_group)
        self.make_allreducer = make_allreducer
        self.wants_positions = priorities
        self.reducers: dict[tuple, THCAllReduce | GraphedAllReduce] = {}

    def _reducer(self, group) -> THCAllReduce | GraphedAllReduce:
        """The factory's reducer; one that cannot carry the priority classes asked for is a
        failure of this rank's build, which every rank then raises (:meth:`_build`)."""
        ar = self.make_allreducer(group)
        if self.wants_positions and isinstance(ar, GraphedAllReduce):
            raise ValueError("priorities=True marks chunks with DLCP classes, which travel "
                             "through an aggregator's transport: a graphed round uses none")
        if self.wants_positions and getattr(ar.transport, "lanes", None) is None:
            raise ValueError("priorities=True marks chunks with DLCP classes, which travel "
                             "through an aggregator's transport: this reducer's "
                             f"({type(ar.transport).__name__}) carries none")
        return ar

    @property
    def codec_seconds(self) -> float:
        """Encode, decode and error-feedback time of every bucket so far (the codec cost the
        all-reduce really paid, measured; the norm round's wire time is not in it). Rounds
        replayed from a CUDA graph are not split into phases, so they are not in it."""
        return sum(ar.stats.seconds["encode"] + ar.stats.seconds["decode"]
                   + ar.stats.seconds["feedback"] for ar in self.reducers.values())

    @property
    def short_chunks(self) -> int | None:
        """Chunks that ended short (DLCP's bounded loss) so far; None without an aggregator."""
        counts = [ar.transport.short_chunks for ar in self.reducers.values()
                  if ar.transport.short_chunks is not None]
        return sum(counts) if counts else None

    def check(self, first: Exception | None = None) -> None:
        """Raise a refusal that reducers with deferred checks (``GraphedAllReduce(
        deferred_checks=True)``) still hold: call it after the last step (else the process's
        end only warns of it). ``first``: one already read, raised with the others."""
        errors = [] if first is None else [first]
        for ar in list(self.reducers.values()):
            if isinstance(ar, GraphedAllReduce):
                try:
                    ar.check()
                except Exception as e:  # noqa: BLE001 - every reducer's pending is read
                    errors.append(e)
        if len(errors) > 1:
            raise RuntimeError(f"{len(errors)} buckets' rounds were refused: "
                               + "; ".join(str(e) for e in errors)) from errors[0]
        if errors:
            raise errors[0]

    def reduce(self, bucket, flat: torch.Tensor, sizes: list[int],
               position: torch.Tensor | None = None, stretches: int = 0) -> torch.Tensor:
        key = (bucket, flat.numel())
        ar = self.reducers.get(key)
        if ar is None:
            self.check()   # the reducers of buckets DDP rebuilt take no further rounds
            ar = self.reducers[key] = self._build(self._reducer, flat.numel(), flat.device,
                                                  bucket)
        before = ar.transport.bytes_sent
        self._count_round(ar, stretches)
        if isinstance(ar, GraphedAllReduce) and ar.owes_check:
            try:
                ar.check()
            except Exception as e:  # noqa: BLE001 - raised with the other buckets'
                # the last step's refusal, read alike on every rank: its other buckets' are
                # raised with it, as this step's later buckets are not reduced (each would
                # raise its own a step later)
                self.check(first=e)
        out = ar(flat, position=position)
        self.bytes_sent += ar.transport.bytes_sent - before
        return out


class TopKHook(BaseHook):
    """TopK sparsification (default 10%) with error feedback (:class:`thc.codec.baselines.TopK`),
    exchanged by all-gather: k values and indices per worker. ``nonfinite``
    (:data:`thc.collective.agreement.NONFINITE`): a bucket in which some worker's gradient
    holds NaN or Inf is refused on every worker ("raise"), or comes back NaN on every worker
    ("propagate", for ``torch.amp.GradScaler``); either way the residuals stay as they were."""

    def __init__(self, model, ratio: float = 0.1, options: HookOptions = HookOptions(),
                 group=None, overlap: bool = True, comm_group=None, nonfinite: str = "raise"):
        self.ratio = ratio
        super().__init__(model, options, group, overlap, comm_group, nonfinite)
        self.nonfinite = nonfinite
        self.scheme = TopK(ratio=ratio, error_feedback=True)
        self._calls = 0

    def _check_settings(self, overlap: bool, comm_group, group, nonfinite) -> None:
        super()._check_settings(overlap, comm_group, group, nonfinite)
        TopK(ratio=self.ratio)   # a ratio it refuses fails the build on every rank

    def rescale_residuals(self, factor: float) -> None:
        self.scheme.rescale(factor)
        self._per_param.rescale_carried(scale_factor(factor))

    def _residual_keys(self) -> list:
        return list(self.scheme.residuals)

    def _residual_of(self, key: tuple) -> torch.Tensor | None:
        return self.scheme.residuals.get(key)

    def reduce(self, bucket, flat: torch.Tensor, sizes: list[int],
               position: torch.Tensor | None = None, stretches: int = 0) -> torch.Tensor:
        key = (bucket, flat.numel())
        failure = None
        if key not in self.scheme.residuals:
            try:   # a bucket new to the hook: its parameters' residuals, if any
                seed = self._per_param.seed(bucket, flat.device)
                if seed is not None:
                    self.scheme.residuals[key] = seed   # kept, refused round or not
                self._per_param.taken(bucket)
            except Exception as e:  # noqa: BLE001 - every worker refuses, none waits
                failure = e
        before = self.scheme.residuals.get(key)
        try:
            if failure is None:
                payload = self.scheme.compress(flat, key=key)
        except Exception as e:  # noqa: BLE001 - every worker refuses, none waits in a gather
            failure = e
        rnd, self._calls = self._calls, self._calls + 1
        try:
            # the gathers are as long as k: agree on it first
            self.bytes_sent += agreement.together(
                self.group, rnd, agreement.key_of("topk", self.ratio, flat.numel(),
                                                  self.nonfinite, self.index, stretches,
                                                  self._resumed),
                flat.device, failure, alike="the hook's ratio or nonfinite, the bucket's "
                "length, which reducer it is (the hook), the steps accumulated (a rank "
                "that ran one under no_sync alone, or split a stretch with a forward outside "
                "it), or the backward passes behind the state the hook was loaded from")
        except Exception as e:
            if failure is None:   # a refused round leaves the residual as it was
                if before is None:
                    self.scheme.residuals.pop(key, None)
                else:
                    self.scheme.residuals[key] = before
            if isinstance(e, NonFiniteInput):
                if self.nonfinite == "propagate":   # a step like another: its bytes count
                    self.bytes_sent += agreement.together_bytes(self.world)
                    return torch.full_like(flat, float("nan"))
                if agreement.PROPAGATE_HINT not in str(e):
                    raise NonFiniteInput(f"{e}{agreement.PROPAGATE_HINT}") from e
            raise
        try:
            idx = payload.indices.to(torch.int32 if flat.numel() <= 1 << 31 else torch.int64)
            vals = payload.values.float()
            all_idx = [torch.empty_like(idx) for _ in range(self.world)]
            all_vals = [torch.empty_like(vals) for _ in range(self.world)]
            dist.all_gather(all_idx, idx, group=self.group)
            dist.all_gather(all_vals, vals, group=self.group)
            self.bytes_sent += (self.world - 1) * idx.numel() * (idx.element_size()
                                                                 + vals.element_size())
            return self._held(key, self.scheme.combine(all_vals, all_idx, flat.numel()),
                              flat.dtype)
        except BaseException as e:
            # this rank's own failure: its peers wait in a gather or go on to their next
            # collective, which would pair with its next
            DistTransport.abandon_group(self.group, f"TopK step {rnd} failed after its "
                                        f"agreement ({type(e).__name__}: {e})")
            raise

    def _held(self, key: tuple, mean: torch.Tensor, dtype) -> torch.Tensor:
        """``mean`` as a half type holds it: held to float16's range (the residuals carry it
        past 65504), rounded; what the hold and the rounding move joins every worker's
        residual, so that their next mean applies it."""
        held = cast_estimate(mean, dtype)
        cut = cast_moved(mean, held)
        if cut is None:
            return mean   # the bucket holds the float32 mean as it is
        if key in self.scheme.residuals and bool(cut.any()):
            self.scheme.residuals[key] += cut
        return held.float()


class MarsitHook(BaseHook):
    """Marsit: one sign bit per coordinate through a merging ring all-reduce, with global
    compensation and a scale per parameter tensor (:class:`thc.collective.marsit.
    MarsitAllReduce`, one per bucket). ``make_allreducer(group)`` builds another sign
    all-reduce per bucket instead (the vote: :class:`MarsitVoteHook`), on the hook's group.
    ``generator`` and ``nonfinite``: the default reducers' (:class:`thc.collective.marsit.
    MarsitAllReduce`; one generator shared by every bucket's merges, where given, instead of
    each reducer's own)."""

    def __init__(self, model, options: HookOptions = HookOptions(), group=None,
                 generator: torch.Generator | None = None, overlap: bool = True,
                 make_allreducer: Callable[[object], MarsitAllReduce] | None = None,
                 comm_group=None, nonfinite: str = "raise"):
        super().__init__(model, options, group, overlap, comm_group, nonfinite)
        self.make_allreducer = make_allreducer or (
            lambda on: MarsitAllReduce(on, generator, nonfinite=nonfinite))
        self.reducers: dict[tuple, MarsitAllReduce] = {}

    def reduce(self, bucket, flat: torch.Tensor, sizes: list[int],
               position: torch.Tensor | None = None, stretches: int = 0) -> torch.Tensor:
        key = (bucket, flat.numel())
        ar = self.reducers.get(key)
        if ar is None:
            ar = self.reducers[key] = self._build(self.make_allreducer, flat.numel(),
                                                  flat.device, bucket)
        before = ar.bytes_sent
        self._count_round(ar, stretches)
        out = ar(flat, sizes)
        self.bytes_sent += ar.bytes_sent - before
        return out


class MarsitVoteHook(MarsitHook):
    """Marsit's sign bits counted in the network: every bucket's bits go through the vote job
    of ``client`` (switch or software aggregator), one compensation residual per bucket."""

    def __init__(self, model, client, options: HookOptions = HookOptions(), group=None,
                 overlap: bool = True, majority: bool = False, comm_group=None,
                 nonfinite: str = "raise"):
        super().__init__(model, options, group, overlap=overlap,
                         make_allreducer=lambda on: MarsitVoteAllReduce(
                             client, on, majority=majority, nonfinite=nonfinite),
                         comm_group=comm_group, nonfinite=nonfinite)


__all__ = ["HookOptions", "layer_positions", "FP32Hook", "THCHook", "TopKHook", "MarsitHook",
           "MarsitVoteHook"]
