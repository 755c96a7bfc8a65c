"""What every DDP communication hook of :mod:`thc.collective.ddp` shares (:class:`BaseHook`):
registering on a DDP model, splitting each bucket into its compressed and its FP32 parts,
the ``no_sync`` stretches its rounds count (:mod:`thc.collective.stretches`), the residuals
kept per parameter (:mod:`thc.collective.paramresiduals`), and the one communication thread.

Gradients of parameters chosen to stay uncompressed (by name, or below a size) go through a
float32 all-reduce, after the rest of the bucket has gone through the hook's compressor
(with per-bucket error feedback), whose checked round makes sure every rank is reducing the
same bucket first; tag lanes after the spans make sure of it again where that round used no
collective of the group (through an aggregator). A complex parameter is reduced as its real
view, as DDP holds it (``HookOptions.min_numel`` counts its complex elements); sparse
gradients are refused. A bucket's rounds also count the DDP model's stretches of forwards
under ``no_sync`` that a backward ran through (or that a gradient accumulated in, inside
``no_sync``: a loss kept aside, ``ddp.module``'s micro-batch), so a rank that accumulated a
step alone (``no_sync`` on it only) is refused on every rank while the counts differ, while
gradient accumulation (``no_sync`` on every rank) is not. Not told apart: a rank whose loop
skipped a batch (it contributes its next gradient as its peers do theirs), unlike numbers of
accumulated micro-batches where each rank has some (DDP sums those too); refused though
legitimate: accumulation under ``join()`` once a rank has joined (its shadow steps see no
stretch), and a backward under ``no_sync`` on some ranks only whose gradient is zeroed before
the next synced step (a probe); the counts stay apart, and so do the refusals, until the
hook is built anew on every rank.

A hook returns at once with a future that one communication thread completes, so a bucket
is reduced while backward computes the next ones, as DDP's own all-reduce overlaps. The one
thread keeps every process's collectives in the same order, on a process group of the hook's
own: a collective that backward or DDP issues meanwhile on the model's group (SyncBatchNorm,
DDP's table of unused parameters, the next forward's buffer broadcast) cannot pair with one
of the hook's (Gloo and NCCL pair a group's collectives by issue order).
:meth:`BaseHook.step_breakdown` says how much of the communication backward hid.
"""
from __future__ import annotations

import gc
import operator
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from thc.codec.common import scale_factor
from thc.collective import agreement, checkpoint, unused
from thc.collective.paramresiduals import ParamResiduals
from thc.collective.stretches import StretchCount
from thc.collective.transports import (DistTransport, members, rank_in, ring_bytes,
                                       run_agreement_deferred)
from thc.collective.worker import device_of
from thc.collective.torchgaps import group_timeout


@dataclass(frozen=True)
class HookOptions:
    uncompressed: tuple[str, ...] = ()
    """Parameter-name substrings whose gradients are all-reduced in FP32 (e.g. "bias", "bn")."""
    min_numel: int = 0
    """Parameters with fewer elements than this stay uncompressed."""

    def check_names(self, model: torch.nn.Module) -> None:
        """ValueError for an ``uncompressed`` part in no parameter's name of ``model``: a
        typo ("bais") left every gradient compressed, unsaid."""
        names = [n for n, _ in model.named_parameters()]
        unmatched = [s for s in self.uncompressed if not any(s in n for n in names)]
        if unmatched:
            raise ValueError(f"uncompressed {unmatched} is in no parameter's name (the "
                             f"model's: {', '.join(names[:6])}"
                             f"{', ...' if len(names) > 6 else ''})")

    def __post_init__(self):
        """Checked here, not at the first backward: a bare string would be read as its
        characters ("bias": every name holding an "i" or an "s" left uncompressed)."""
        names = self.uncompressed
        hint = f" (one name: ({names!r},))" if isinstance(names, str) else ""
        bad = isinstance(names, (str, bytes))
        if not bad:
            try:
                names = tuple(names)
            except TypeError:
                bad = True
        if bad or not all(isinstance(n, str) and n for n in names):
            raise TypeError(f"HookOptions.uncompressed takes parameter-name substrings (a "
                            f"tuple of strings), got {self.uncompressed!r}{hint}")
        object.__setattr__(self, "uncompressed", names)
        count = self.min_numel
        if isinstance(count, float) and count.is_integer():
            count = int(count)   # 1e6
        try:
            count = None if isinstance(count, bool) else operator.index(count)
        except TypeError:
            count = None
        if count is None or count < 0:
            raise ValueError(f"HookOptions.min_numel takes a count of elements (an int, 0 or "
                             f"more), got {self.min_numel!r}")
        object.__setattr__(self, "min_numel", count)


def layer_positions(model: torch.nn.Module) -> dict[int, float]:
    """``id(parameter)`` -> its layer's place in the forward order, 0 (first) .. 1 (last).

    The order is the modules' registration order (a ``Sequential``'s is its forward order);
    a layer's parameters (weight, bias) share its place, and a parameter two layers share (an
    embedding tied to the output head) takes the first's: the next forward needs it there."""
    layers = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    last = max(1, len(layers) - 1)
    places: dict[int, float] = {}
    for i, m in enumerate(layers):
        for p in m.parameters(recurse=False):
            places.setdefault(id(p), i / last)
    return places


def _raising(fut: torch.futures.Future) -> torch.futures.Future:
    """``fut`` as DDP reads it: torch's ``set_exception`` stores the error as the future's value,
    which DDP's C++ side then fails to cast ("Unable to cast ... to Tensor"); a callback that
    raises fails the chained future itself, so DDP raises the error under its own type's
    name."""
    return fut.then(lambda done: done.wait())


STRETCH_ROUNDS = agreement.ROUND_SPAN
"""What a ``no_sync`` stretch adds to a bucket's round number: one in the high part."""

_LOST = ("lost its connection to a peer rank, whose process ended or whose own collective "
         "timed out first")
PEER_GONE = {"Timed out": "timed out: a peer rank did not reach this bucket's reduction",
             "Connection closed by peer": _LOST, "Connection reset by peer": _LOST,
             "Application timeout caused pair closure":
                 "found its connection to a peer rank closed by an earlier timeout (Gloo "
                 "keeps a pair that timed out closed: the group carries no more collectives)"}
"""What the words of a Gloo collective's error say of the peers: the hook names it beside
the step (the peer's own error, in its log, says why it stopped or is elsewhere)."""


def _peer_gone(e: BaseException, step: int) -> BaseException:
    """``e`` or, where it is a Gloo collective's timeout or lost connection, an error that
    says what that means for the bucket."""
    text = str(e)
    said = next((v for k, v in PEER_GONE.items() if k in text), None)
    if said is None or not isinstance(e, RuntimeError):
        return e
    return RuntimeError(f"the hook's collective of backward {step} {said} (it failed in "
                        f"backward or before, runs another step, or stopped: its own error "
                        f"says why): {text.splitlines()[0]}")


@dataclass
class StepBreakdown:
    """Where one step's communication went (seconds)."""
    comm: float
    """Time the communication thread spent reducing buckets."""
    exposed: float
    """Communication backward waited for: from the last bucket handed over to the last done
    (all of it where the hook does not overlap backward: each bucket is reduced in it)."""

    @property
    def hidden(self) -> float:
        return max(0.0, self.comm - self.exposed)


_USERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Process group -> the hooks whose collectives it carries, each as (a weak reference, whether
it overlaps backward). An overlapping hook issues its collectives from its own thread, whose
order against any other hook's on that group differs from rank to rank (Gloo then pairs an
FP32 span with a THC sum of as many bytes): such a group carries that hook's alone."""


def _carrier(group):
    """The group a hook's collectives go on, as :data:`_USERS` keys it (None: the world)."""
    return group if group is not None else dist.group.WORLD


def _clashes(group, overlap: bool) -> bool:
    """Whether a hook that overlaps backward (or not) would share ``group`` with a live hook
    it may not share it with. A hook whose model was dropped may wait for the cycle
    collector: it runs before a clash is reported."""
    def clash() -> bool:
        live = [o for ref, o in _USERS.get(_carrier(group), ()) if ref() is not None]
        return bool(live) if overlap else any(live)
    if not clash():
        return False
    gc.collect()
    return clash()


_SERVED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""Model key (:func:`agreement.model_key`) -> the hook that serves a model of it on this
rank: a second hook serving a model of the same key (a copy of the first) is warned of."""

_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Aggregator client -> the hook whose reducers' rounds go through it (:meth:`BaseHook.
_check_client`)."""


def _group_name(group) -> str | None:
    """A process group's name, alike on every rank that made its groups in the same order:
    ranks that pass different groups as ``comm_group`` are told apart (None: no group)."""
    return None if group is None else getattr(group, "group_name", "")


def _remove_all(handles) -> None:
    for h in handles:
        h.remove()


class BaseHook:
    """Splits a bucket into compressed and FP32 spans; subclasses compress the former."""

    def __init__(self, model: torch.nn.Module, options: HookOptions = HookOptions(),
                 group=None, overlap: bool = True, comm_group=None,
                 nonfinite: str | None = None):
        """``group``: the workers (default: the whole world). ``comm_group``: the process
        group of the hook's collectives, of the same ranks. With ``overlap`` it must be the
        hook's own (see the module docstring): for the whole world one is made here, as
        every rank of the world constructs its hooks in the same order (torch makes a group
        only where every rank of the world joins); for a smaller group, pass one made so
        (``dist.new_group(ranks, timeout=...)`` on every rank, with the timeout of ``group``: a
        timeout of its own is warned of), or ``overlap=False``. ``nonfinite``: the
        hook's own mode (:data:`thc.collective.agreement.NONFINITE`), where it has one. Every
        rank checks these settings, and that the others' are alike, in one agreement: a rank
        whose settings fail makes every rank raise."""
        self.options = options
        self.world = dist.get_world_size(group)
        failure = None
        try:
            self._check_settings(overlap, comm_group, group, nonfinite)
            options.check_names(model)
        except (ValueError, TypeError) as e:   # raised here by together, refused elsewhere
            failure = e
        # ranks unlike here would make the hook's group on some ranks only: a wait in
        # new_group, or collectives on different groups, until the timeout
        sent = agreement.together(
            group, 0, agreement.key_of("hook", type(self).__name__, overlap,
                                       _group_name(comm_group), nonfinite),
            device_of(group, model), failure,
            alike="the hook's kind (THCHook, FP32Hook, ...), overlap, comm_group (which group) or "
                  "nonfinite")
        self.group = comm_group if comm_group is not None else \
            dist.new_group(timeout=group_timeout(group)) if overlap else group
        """The process group of the hook's collectives."""
        parent = dist.group.WORLD if group is None else group
        self._parent = parent
        self._rank, self._members = rank_in(parent), members(parent)
        """This rank in the hook's workers' group, and the group's global ranks."""
        self.index = (getattr(parent, "group_name", ""), agreement.ordinal(parent, "hook"))
        """This hook's workers' group (torch names groups in the order they are made, alike
        on every rank) and its place among the hooks built on it, in every name of its
        reducers: two hooks' reducers may share a group, or (neither overlapping) an
        aggregator client. Every rank builds its hooks on a group in the same order (the
        agreement above runs on it)."""
        users = _USERS.setdefault(_carrier(self.group), [])
        users[:] = [(ref, o) for ref, o in users if ref() is not None]
        users.append((weakref.ref(self), overlap))
        self._built = 0
        """Reducers built so far (:meth:`_build`): the round of their agreement."""
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._per_param = ParamResiduals(
            {n: p.numel() * (2 if p.is_complex() else 1)
             for n, p in model.named_parameters() if not self._keep_fp32(p)},
            lambda key: self._residual_of(key))
        self._positions = layer_positions(model)
        self.wants_positions = False
        """Subclasses set it to get each bucket's per-element layer positions in reduce."""
        self.bytes_sent = sent
        self.fp32_elements = 0
        self._agreed: set = set()
        """Buckets whose split every rank checked (:meth:`_agree_bucket`)."""
        self._model: int | None = None
        """The model the hook serves (:func:`agreement.model_key`), in every bucket's check:
        read at the first, when DDP's replicas are alike (a model wrapped with
        ``init_sync=False`` is made alike by its user after :meth:`register`)."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ddp-comm") if overlap else None
        self.reducers: dict = {}
        """Per bucket, the reducer that keeps its residual (hooks that build one each)."""
        self._backwards = 0
        """Backward passes whose buckets were handed to the hook (DDP's last bucket ends one)."""
        self._resumed: int | None = 0
        """Backward passes behind the state the hook was loaded from (0: a fresh start; None:
        a state that does not count them). Every reducer's build agrees on it, so a rank that
        resumed where a peer did not is refused: its residuals would carry a history its
        peers' lack."""
        self._stretches = StretchCount()
        """The DDP model's ``no_sync`` stretches a backward ran through, since
        :meth:`register`, which a bucket's rounds count (:meth:`reduce`'s ``stretches``)."""
        self._stretches_of: dict[int, int] = {}
        """Per reducer (by id; the hook keeps them alive), the stretches its rounds count."""
        self._failed_step: int | None = None
        """The backward pass of the last bucket that failed (:meth:`_reduce_in_step`)."""
        self._stats_lock = threading.Lock()
        self._ddp: weakref.ref | None = None
        """The DDP model :meth:`register` installed the hook on, and the state DDP hands the
        hook (a hook installed by hand is refused at its first bucket)."""
        self._comm = 0.0
        self._last_call = self._last_done = 0.0
        self._unused_seen = False
        """Whether DDP may leave a parameter unused (``find_unused_parameters`` or
        ``static_graph``, read at each bucket): then a bucket's parameters no rank used keep
        their spans and residuals (:mod:`thc.collective.unused`)."""
        self._uses = unused.UseCount(self._see_gradient)
        self._comm_thread: int | None = None
        """The communication thread's ident, once it has reduced a bucket."""

    def _check_settings(self, overlap: bool, comm_group, group, nonfinite) -> None:
        """Raise on this rank if its hook's settings cannot work (see :meth:`__init__`)."""
        if nonfinite is not None:
            agreement.nonfinite_mode(nonfinite)
        if comm_group is None and overlap and group is not None:
            raise ValueError("a hook that overlaps backward runs its collectives on a group "
                             "of its own, which every rank of the world must make alike: "
                             "pass comm_group=dist.new_group(ranks, timeout=...) made on every "
                             "rank, or overlap=False")
        if comm_group is not None and dist.get_world_size(comm_group) != self.world:
            raise ValueError(f"comm_group holds {dist.get_world_size(comm_group)} ranks, the "
                             f"hook's group {self.world}")
        if comm_group is not None:
            own, parent = group_timeout(comm_group, quiet=True), group_timeout(group, quiet=True)
            if own is not None and parent is not None and own != parent:
                warnings.warn(f"comm_group waits {own} for a peer, the hook's group {parent}: "
                              f"a stalled rank ends the hook's collectives after {own} (make "
                              f"it with dist.new_group(ranks, timeout=...))", RuntimeWarning,
                              stacklevel=4)
        if overlap and comm_group is not None and _clashes(comm_group, True):
            raise ValueError("comm_group carries another hook's collectives: each hook "
                             "that overlaps backward needs a group of its own "
                             "(dist.new_group(ranks, timeout=...) made on every rank)")
        if not overlap and _clashes(comm_group if comm_group is not None else group, False):
            raise ValueError("the hook's group carries the collectives of a hook that "
                             "overlaps backward, from a thread of its own: their order "
                             "against this hook's would differ from rank to rank; give this "
                             "hook another group (comm_group=dist.new_group(ranks, "
                             "timeout=...) made on every rank)")

    def state_dict(self) -> dict:
        """The hook's error-feedback residuals, one per compressed parameter by its name
        (:mod:`thc.collective.checkpoint`), and the backward passes behind them: save it
        beside the model's on every rank (``torch.save``) between steps, and give it to
        :meth:`load_state_dict` of the hook built anew. Read on the hook's communication
        thread, between two reductions."""
        def read() -> dict:
            return {"hook": type(self).__name__, "owner": self._state_owner(),
                    "steps": None if self._resumed is None else
                    self._resumed + self._backwards, "residuals": {
                        name: r.detach().clone() for name, r in self._per_param.named().items()}}
        on_pool = self._pool is not None and threading.get_ident() != self._comm_thread
        return self._pool.submit(read).result() if on_pool else read()

    def load_state_dict(self, state: dict) -> None:
        """Take :meth:`state_dict`'s residuals before the first step: each bucket's reducer
        takes its parameters' when it is built (zeros for a parameter the state lacks). Every
        rank loads the state it saved at one step, or none does: the first step refuses a
        mix on every rank."""
        kind = state.get("hook") if isinstance(state, dict) else None
        if kind != type(self).__name__:
            raise ValueError(f"not a {type(self).__name__}'s state (its state_dict()), got "
                             f"{kind if kind is not None else type(state).__name__}")
        residuals = checkpoint.residuals_of(state, kind)
        checkpoint.check_owner(state, self._state_owner(), kind)
        steps = state.get("steps")   # None or absent: a state that does not count them
        if steps is not None and (type(steps) is not int or steps < 0):
            raise ValueError(f"a {kind}'s state names the backward passes behind it, a count "
                             f"(its state_dict()), got {steps!r:.80}")
        if self._residual_keys() or self._backwards:
            raise ValueError("a hook's state is loaded before its first step")
        self._per_param.load(residuals)
        self._resumed = steps

    def _state_owner(self) -> dict:
        """Whose residuals the hook keeps: this rank's, in its workers' group."""
        return checkpoint.owner(self._rank, self.world, self._members)

    def _residual_keys(self) -> list:
        """The (bucket, length) keys of the residuals the hook keeps."""
        return list(self.reducers)

    def _residual_of(self, key: tuple) -> torch.Tensor | None:
        """The residual bucket ``key``'s reducer keeps (not a copy)."""
        return getattr(self.reducers[key], "kept_residual", None)

    def step_breakdown(self) -> StepBreakdown:
        """The communication of the buckets reduced since the last call (call once a step)."""
        with self._stats_lock:
            out = StepBreakdown(self._comm, self._comm if self._pool is None else
                                max(0.0, self._last_done - self._last_call))
            self._comm = 0.0
            self._last_call = self._last_done = 0.0   # a step that reduces nothing waits none
        return out

    def _keep_fp32(self, p: torch.Tensor) -> bool:
        name = self._names.get(id(p), "")
        return p.numel() < self.options.min_numel or any(s in name for s in
                                                         self.options.uncompressed)

    def register(self, ddp_model) -> "BaseHook":
        """Install on a DistributedDataParallel model (DDP wants a function: the bound
        method). It must wrap the model the hook was built for, and its process group must
        hold the hook's workers: the hook averages over its own group, and replicas DDP keeps
        apart would be averaged together."""
        module = getattr(ddp_model, "module", None)
        unknown = [n for n, p in (module.named_parameters() if module is not None else ())
                   if id(p) not in self._names]
        if unknown:
            raise ValueError(f"the hook was built for another model, or before parameter "
                             f"{unknown[0]!r} was added (its options and layer positions name "
                             f"the model's parameters): build one hook per DDP model, from "
                             f"the model DDP wraps, once its parameters are final")
        ranks = dist.get_process_group_ranks
        ddp_group = getattr(ddp_model, "process_group", None)
        if self._pool is not None and ddp_group is self.group:
            raise ValueError("the DDP model's process group is the hook's own: a hook that "
                             "overlaps backward needs a group DDP's own collectives do not "
                             "use (see the module docstring)")
        if ddp_group is not None and ranks(ddp_group) != ranks(self._parent):
            raise ValueError(f"the DDP model's process group holds ranks {ranks(ddp_group)}, "
                             f"the hook's workers {ranks(self._parent)}: build the hook with "
                             f"group= the DDP model's process group")
        if self._ddp is not None:
            raise ValueError("the hook was registered on a DDP model before: build one hook "
                             "per DDP model (a hook built anew takes the old one's residuals "
                             "through state_dict and load_state_dict)")
        token = weakref.ref(ddp_model)   # DDP's state for the hook: tells a hand install
        ddp_model.register_comm_hook(token, self.hook)
        self._ddp = token
        handles = self._uses.handles
        handles += [ddp_model.register_forward_pre_hook(self._see_forward),
                    ddp_model.register_forward_hook(self._see_output)]
        self._uses.watch_all(module.parameters() if module is not None else ())
        # the parameters outlive their DDP model (a model wrapped anew): their hooks would
        # keep this hook, its thread and its residuals alive, and run on every gradient
        weakref.finalize(ddp_model, _remove_all, handles)
        return self

    def _see_forward(self, module, args) -> None:
        self._uses.watch_unfrozen()
        self._stretches.forward(module)

    def _see_output(self, module, args, output) -> None:
        self._stretches.output(module, output)

    def _see_gradient(self, param) -> None:
        """A gradient accumulated (autograd's threads)."""
        self._uses.saw(param)
        ddp = self._ddp() if self._ddp is not None else None
        self._stretches.gradient(getattr(ddp, "require_backward_grad_sync", True))

    def hook(self, state, bucket):  # unannotated: DDP rejects string annotations
        if state is None or state is not self._ddp:
            refused: torch.futures.Future = torch.futures.Future()
            refused.set_exception(ValueError(
                "the hook runs where hook.register(ddp_model) installed it: installed by hand "
                "(ddp_model.register_comm_hook), it would not see the DDP model's process "
                "group, unused parameters or its own wrapping, and would average replicas "
                "DDP keeps apart or spend residuals DDP never applies"))
            return _raising(refused)
        buf = bucket.buffer()
        spans, offset = [], 0
        params = bucket.parameters()
        for p in params:
            n = p.numel() * (2 if p.is_complex() else 1)   # DDP's bucket holds a real view
            spans.append((offset, offset + n, self._keep_fp32(p),
                          self._positions.get(id(p), 1.0)))
            offset += n
        if buf.layout != torch.strided:
            spans = ValueError("the hook reduces dense gradients: a parameter with a sparse "
                               "gradient (e.g. Embedding(sparse=True)) needs DDP's own "
                               "all-reduce (no hook)")
        elif offset != buf.numel():
            spans = ValueError(f"the bucket holds {buf.numel()} elements, its parameters "
                               f"{offset}: the hook cannot split it")
        # a bucket is its parameters, not its index: DDP rebuilds its buckets after the
        # first iteration, and an index may then hold others (a residual would move to them)
        key = tuple(id(p) for p in params)
        ddp = self._ddp() if self._ddp is not None else None
        self._unused_seen = ddp is not None and bool(
            getattr(ddp, "find_unused_parameters", False) or getattr(ddp, "static_graph", False))
        idle = self._uses.take(key, self._unused_seen)
        with self._stats_lock:
            self._last_call = time.perf_counter()
        step, stretches = self._backwards, self._stretches.count
        place = (step, bucket.index())
        if bucket.is_last():
            self._backwards += 1
        fut: torch.futures.Future = torch.futures.Future()
        if self._pool is None:
            # raised here, a refusal would leave DDP's reducer half-marked: every later step
            # then fails inside torch
            try:
                fut.set_result(self._reduce_in_step(place, stretches, key, buf, spans, idle))
            except Exception as e:  # noqa: BLE001 - handed to DDP, which raises it
                fut.set_exception(e)
            return _raising(fut)

        def finish(done) -> None:
            try:
                error = done.exception()
            except BaseException as e:  # noqa: BLE001 - a cancelled task: fail, never hang
                error = e
            if error is None:
                fut.set_result(done.result())
            else:   # torch's futures take an Exception only: anything else would hang DDP
                fut.set_exception(error if isinstance(error, Exception) else
                                  RuntimeError(f"the bucket's reduction ended in {error!r}"))

        chained = _raising(fut)
        self._pool.submit(self._reduce_in_step, place, stretches, key, buf, spans,
                          idle).add_done_callback(finish)
        return chained

    def _reduce_in_step(self, place: tuple[int, int], stretches: int, bucket,
                        buf: torch.Tensor, spans, idle=None) -> torch.Tensor:
        """:meth:`_reduce_bucket` in backward ``step`` (``place``: the step and DDP's index
        of the bucket), unless a bucket of that step failed:
        DDP raises then, and the buffers of the step's later buckets are the next step's
        before their reductions could run (they would read and overwrite its gradients).
        Every rank refuses a bucket alike, so every rank skips the same later ones."""
        self._comm_thread = threading.get_ident()
        step = place[0]
        if step == self._failed_step:
            raise RuntimeError(f"not reduced: an earlier bucket of backward {step} failed, "
                               f"so DDP raised and its later buckets are left alone")
        try:
            return self._reduce_bucket(bucket, buf, spans, stretches, place, idle)
        except BaseException as e:
            self._failed_step = step
            named = _peer_gone(e, step)
            if named is e:
                raise
            raise named from e

    def _agree_bucket(self, bucket, spans, device, buf_dtype) -> None:
        """Before a bucket's first reduction, every rank checks that the others split it
        alike: ranks whose hooks or options differ would pair one's FP32 span with another's
        compressed round (an abort, or a wrong sum where the lengths match). ``spans``: an
        exception where this rank cannot split the bucket: every rank raises."""
        failure = spans if isinstance(spans, Exception) else None
        layout = () if failure else tuple((b - a, fp32) for a, b, fp32, _ in spans)
        key = agreement.key_of(type(self).__name__, self.index, self._model_key(),
                               str(buf_dtype), layout, self._unused_seen)
        self.bytes_sent += agreement.together(
            self.group, len(self._agreed), key, device, failure,
            alike="the hook (its kind, which of the hooks built on the group it is, the "
                  "model it serves (its parameters' names, shapes and first values), the "
                  "bucket's dtype, FP32 and compressed spans, or whether DDP finds unused "
                  "parameters)")
        self._agreed.add(bucket)

    def _model_key(self) -> int:
        """:attr:`_model`, read once. Two hooks on this rank serving models of one key (one a
        copy of the other) are warned of: built in another order on some rank, each would
        average its model's gradients with the other's there, and no check can tell."""
        if self._model is None:
            ddp = self._ddp() if self._ddp is not None else None
            module = getattr(ddp, "module", None)
            self._model = 0 if module is None else agreement.model_key(
                module, getattr(ddp, "parameters_to_ignore", ()))
            other = _SERVED.get(self._model) if module is not None else None
            other_ddp = other._ddp() if other is not None and other._ddp is not None else None
            if getattr(other_ddp, "module", module) is not module:   # not the same model anew
                warnings.warn("two DDP models with hooks are alike in their parameters' names, "
                              "shapes and first values (one a copy of the other): nothing "
                              "tells their hooks apart, so build them in the same order on "
                              "every rank", RuntimeWarning, stacklevel=2)
            if module is not None:
                _SERVED[self._model] = self
        return self._model

    def _build(self, make: Callable, numel: int, device, bucket=None):
        """A bucket's reducer from ``make(self.group)``, then one agreement: a rank whose
        factory failed makes every rank raise, none waits in the reducer's first round. The
        reducer takes bucket ``bucket``'s parameters' residuals
        (:meth:`ParamResiduals.seed`) before it."""
        failure, reducer = None, None
        try:
            with run_agreement_deferred():   # an aggregator's run: agreed below, in step
                reducer = make(self.group)
            self._check_reducer(reducer)
            seed = None if bucket is None else self._per_param.seed(bucket, device)
            if seed is not None:
                reducer.load_state_dict(checkpoint.state(
                    0, seed, getattr(reducer, "state_owner", None)))
        except Exception as e:  # noqa: BLE001 - raised on this rank by together
            failure = e
        rnd, self._built = self._built, self._built + 1
        self.bytes_sent += agreement.together(
            self.group, rnd, agreement.key_of("reducer", type(self).__name__, numel,
                                              self._resumed), device, failure,
            alike="the hook, the bucket, or the backward passes behind the state the hook "
                  "was loaded from (each rank loads the state it saved at the same step, or "
                  "none does)")
        transport = getattr(reducer, "transport", None)
        if callable(getattr(transport, "agree_run", None)):
            transport.agree_run()   # refused on every rank: the next step builds anew
        if bucket is not None:
            self._per_param.taken(bucket)
        if hasattr(reducer, "name"):
            # named by the agreed build count: a build that failed on some rank took a place
            # in the group's build order on the others
            reducer.name = ("hook", *self.index, rnd)
        return reducer

    def _check_client(self, client) -> None:
        """A reducer's aggregator client may serve another hook's reducers only where neither
        hook runs its rounds on a thread of its own (``overlap``): two threads' rounds on one
        client run in unlike orders on each rank, and each such pair is refused
        (:meth:`thc.collective.transports.AggregatorTransport.one_round`)."""
        owner = _CLIENTS.get(client)
        other = owner() if owner is not None else None
        if other is not None and other._ddp is not None and other._ddp() is None:
            other = None   # its DDP model is gone (wrapped anew, say): it runs no more rounds
        if other is not None and other is not self and (self._pool or other._pool):
            raise ValueError("the hook's factory returned a reducer whose rounds go through an "
                             "aggregator client that another hook's reducers use, and a hook "
                             "that overlaps backward runs its rounds on a thread of its own: "
                             "the two threads' rounds would meet in unlike orders on each "
                             "rank, refused; give each hook a client of its own (one job "
                             "each), or build both with overlap=False")
        _CLIENTS[client] = weakref.ref(self)

    def _check_reducer(self, reducer) -> None:
        """A factory's reducer must be new, as its error-feedback residual is one bucket's
        (one reducer for two buckets adds each one's rounding error to the other), and its
        collectives (an aggregator's: its run agreement) must run on the group the factory
        was given, the hook's (on another they
        would pair with backward's own collectives: an abort, or a wrong sum where the lengths
        match), and they must sum as many workers as the group has ranks (fewer: each rank
        averages another set; more: a round waits for workers no rank is)."""
        if any(reducer is r for r in self.reducers.values()):
            raise ValueError("the hook's factory returned a reducer that another bucket "
                             "uses: each bucket keeps its own error-feedback residual, so "
                             "make_allreducer(group) must build a new reducer at every call")
        if not callable(getattr(reducer, "skip_to", None)):
            raise ValueError(f"the hook's factory returned a {type(reducer).__name__}, which "
                             f"has no skip_to(round): the hook moves a bucket's rounds ahead "
                             f"for each no_sync stretch (THCAllReduce, GraphedAllReduce and "
                             f"Marsit's reducers have it)")
        carrier = getattr(reducer, "transport", reducer)   # Marsit's reducers carry the group
        client = getattr(carrier, "client", None)
        if client is not None:
            self._check_client(client)
        workers = getattr(carrier, "n_workers", self.world)
        if workers != self.world:
            raise ValueError(f"the hook's factory returned a reducer whose rounds sum "
                             f"{workers} workers' gradients, in a process group of "
                             f"{self.world} ranks: each rank would average another set "
                             f"(give every rank its place in one job of {self.world} workers)")
        # an aggregator's rounds take no collectives, but its run agreement does
        on = getattr(carrier, "group", getattr(carrier, "run_group", self.group))
        def resolved(group):
            return dist.group.WORLD if group is None else group
        if resolved(on) is not resolved(self.group):
            raise ValueError("the hook's factory returned a reducer whose collectives run on "
                             "another process group than the one it was given: "
                             "make_allreducer(group) must build its reducer on that group")

    def _abandon(self, why: str) -> None:
        """This rank failed in a bucket while its peers go on: none of its later rounds may
        pair with theirs. The process group is abandoned, which stops its collectives; a
        round through an aggregator uses none, so each reducer's transport is abandoned too
        (an aggregator client's run takes no more rounds: the peers' round waiting for this
        rank ends in a timeout that names it, not in a sum of two steps)."""
        DistTransport.abandon_group(self.group, why)
        for reducer in self.reducers.values():
            transport = getattr(reducer, "transport", None)
            if callable(getattr(transport, "abandon", None)):
                transport.abandon(why)

    def _reduce_bucket(self, bucket, buf: torch.Tensor, spans, stretches: int = 0,
                       place: tuple[int, int] | None = None, idle=None) -> torch.Tensor:
        """``idle``: per parameter, whether no gradient accumulated into it on this rank
        (None: DDP uses every parameter)."""
        start = time.perf_counter()
        if bucket not in self._agreed:
            self._agree_bucket(bucket, spans, buf.device, buf.dtype)   # raises on an error
        comp = [buf[a:b] for a, b, fp32, _ in spans if not fp32]
        plain = [buf[a:b] for a, b, fp32, _ in spans if fp32]
        # an id the model does not name cannot be a parameter of the hook's model
        # (register refuses such a model): named apart all the same
        if bucket not in self._per_param.layouts:
            self._per_param.lay_out(bucket, [(self._names.get(i, f"?{i}"), b - a)
                                             for i, (a, b, fp32, _) in zip(bucket, spans)
                                             if not fp32])
        # the compressed part first: its round checks that every rank is reducing this
        # bucket; the FP32 spans' all-reduce checks nothing (unlike lengths abort Gloo)
        used = None
        if comp:
            try:
                flat = comp[0] if len(comp) == 1 else torch.cat(comp)
                position = None
                if self.wants_positions:
                    position = torch.cat([torch.full((b - a,), pos)
                                          for a, b, fp32, pos in spans if not fp32])
                if idle is not None:
                    idle = [was for was, span in zip(idle, spans) if not span[2]]
                    used = unused.used_here(comp, idle)
            except BaseException as e:
                # this rank's own failure before its round went out: its peers wait in that
                # round, which its next (a step later, if it goes on) would pair with
                self._abandon(f"a bucket of backward failed before its compressed round "
                              f"({type(e).__name__}: {e})")
                raise
            names, kept = [], {}
            if idle is not None:
                names = self._per_param.names(bucket)
                kept = unused.keep(names, idle, comp, self._per_param.one)
            out = self.reduce(bucket, flat, [v.numel() for v in comp], position, stretches)
        try:
            i = 0
            for view in comp:
                view.copy_(out[i: i + view.numel()])   # each reducer holds a half's range
                i += view.numel()
            if plain or used is not None:
                anywhere = self._reduce_fp32(plain, place, stretches, used, buf.device)
                if anywhere is not None:
                    unused.give_back(names, kept, anywhere, comp, self._per_param.one)
        except BaseException as e:
            # this rank's own failure: its peers wait in the FP32 spans' all-reduce, or go on
            # to their next collective or round, either of which would pair with its next
            self._abandon(f"a bucket of backward failed after its compressed round "
                          f"({type(e).__name__}: {e})")
            raise
        end = time.perf_counter()
        with self._stats_lock:
            self._comm += end - start
            self._last_done = end
        return buf

    def _reduce_fp32(self, plain: list[torch.Tensor], place: tuple[int, int] | None,
                     stretches: int = 0, used: torch.Tensor | None = None,
                     device=None) -> list[bool] | None:
        """The mean of a bucket's FP32 spans, summed in float32 (float64 where the gradients
        are) whatever the gradients' dtype. ``used``: per compressed parameter, whether this
        rank used it (:func:`unused.used_here`); given, one lane each is summed too, and the
        result says which any rank used. Lanes after them (:func:`agreement.sum_tags`) carry
        the hook, the bucket's place (``place``: the backward step and DDP's index of
        the bucket), the model's ``no_sync`` stretches (:meth:`reduce`) and the spans'
        length: where a rank's spans paired with another collective (a peer failed after a
        round that used no collective of the group, through an aggregator, and went on to its
        next bucket or step) or with another step's (a rank accumulated a step alone, in a
        bucket with no compressed round to refuse it), every rank refuses the sum. The lanes
        are read on the host: on a GPU the hook's thread waits for the spans' sum."""
        n = sum(v.numel() for v in plain)
        k = 0 if used is None else used.numel()
        key = agreement.key_of("fp32 spans", self.index, place, stretches, n, k)
        out = torch.empty(n + k + agreement.sum_tag_lanes(self.world),
                          device=plain[0].device if plain else device,
                          dtype=torch.promote_types(plain[0].dtype if plain else torch.float32,
                                                    torch.float32))
        i = 0
        for view in plain:
            out[i: i + view.numel()].copy_(view)
            i += view.numel()
        out[:n] /= self.world   # before the sum, as DDP's own hook
        if k:
            out[n:n + k] = used
        agreement.sum_tags(key, self.world, out[n + k:])
        DistTransport.check_group(self.group)   # a THC round left its peers mid-round
        dist.all_reduce(out, group=self.group)
        self.fp32_elements += n
        self.bytes_sent += ring_bytes(out, self.world)
        if not agreement.sum_tags_agree(out[n + k:], key, self.world):
            step, index = place if place is not None else ("?", "?")
            raise RuntimeError(f"the FP32 spans of backward {step}'s bucket {index} were "
                               f"summed with another collective of a peer rank (one that "
                               f"failed after a round through an aggregator and went on, is "
                               f"in another step or bucket, or accumulated a step under "
                               f"no_sync alone or split a stretch with a forward outside "
                               f"it): no value of the sum is used")
        i = 0
        for view in plain:
            view.copy_(out[i: i + view.numel()])
            i += view.numel()
        return None if used is None else (out[n:n + k] > 0).tolist()

    def _count_round(self, reducer, stretches: int) -> None:
        """Move ``reducer``'s next round :data:`STRETCH_ROUNDS` ahead for each ``no_sync``
        stretch since its last: its round number is then its calls plus that many times the
        stretches, alike on ranks in step, apart in the high part (the round lanes carry it
        apart from the low) on one that accumulated alone."""
        seen = self._stretches_of.get(id(reducer), 0)
        if stretches != seen:
            reducer.skip_to(reducer.round + (stretches - seen) * STRETCH_ROUNDS)
            self._stretches_of[id(reducer)] = stretches

    def rescale_residuals(self, factor: float) -> None:
        """The gradients' scale changed by ``factor`` (new scale / old): every residual the
        hook keeps follows it, so that it adds in the new scale's units. Under
        ``torch.amp.GradScaler`` call it after each ``scaler.update()`` with the new scale over
        the old (a skipped step halves it). A hook without residuals (FP32) has none to scale."""
        factor = scale_factor(factor)
        for ar in self.reducers.values():
            ar.rescale_residual(factor)
        self._per_param.rescale_carried(factor)

    def reduce(self, bucket, flat: torch.Tensor, sizes: list[int],
               position: torch.Tensor | None = None, stretches: int = 0) -> torch.Tensor:
        """The workers' mean of ``flat``, the bucket's compressed parameters (of ``sizes``);
        ``bucket``: the bucket's identity (hashable; the hook's: its parameters' ids, in
        order), which keys residuals; ``position``: each element's layer place (only when
        :attr:`wants_positions`); ``stretches``: the model's ``no_sync`` stretches when its
        backward reached the bucket, which its round counts (:meth:`_count_round`)."""
        raise NotImplementedError
