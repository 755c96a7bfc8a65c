"""A whole THC all-reduce of one tensor: norm round, encode, sum on the wire, decode.

The codec is the same whatever adds the integers; a transport
(:mod:`thc.collective.transports`: the switch or software aggregator, or torch.distributed)
does the two collective steps. When a round closed short (DLCP's bounded loss) the decoder
counts every missing contribution as zero (in the rotated domain) and error feedback keeps
this worker's lost part for the next round.
"""
from __future__ import annotations

import numbers
import secrets
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from thc.codec.common import (NonFiniteInput, as_float32, cast_estimate, cast_moved, check_float,
                              check_generator, check_key, norm_limit)
from thc.codec.params import THCParams
from thc.codec.thc import ErrorFeedback, THCCodec, table_values
from thc.collective import agreement, checkpoint
from thc.collective.transports import AggregatorTransport, DistTransport, Short, holding
from thc.collective.worker import device_of
from thc.net.priority import magnitude_rank, priority_class


def _inline(fn, *args) -> Future:
    """fn(*args) run now, as a done future (one piece: no helper thread to hand it to)."""
    fut: Future = Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed on to whoever reads the future
        fut.set_exception(e)
    return fut


class _HandedOn(Exception):
    """A round whose failed encode every worker hands on as NaN (``nonfinite="propagate"``)."""


@dataclass
class RoundStats:
    calls: int = 0
    elements: int = 0
    overflows: int = 0
    """Rounds handed on as NaN (``nonfinite="propagate"``): some worker's input held NaN or
    Inf."""
    seconds: dict = field(default_factory=lambda: {"norms": 0.0, "encode": 0.0, "sum": 0.0,
                                                   "decode": 0.0, "feedback": 0.0})


def check_positions(position, numel: int) -> torch.Tensor:
    """The layer positions of a round's elements as floats: one per element, in [0, 1]."""
    pos = torch.as_tensor(position).detach().reshape(-1).float().cpu()
    if pos.numel() != numel:
        raise ValueError(f"{pos.numel()} layer positions for {numel} elements")
    if not bool(((pos >= 0) & (pos <= 1)).all()):
        raise ValueError("layer positions must lie in [0, 1] (0: needed first by the next "
                         "forward pass)")
    return pos


class THCAllReduce:
    """Callable that returns the THC estimate of the mean of a tensor across workers.

    Every worker must call it on same-shaped tensors in the same order: the round number
    (part of the shared rotation seed) advances with each call. Drive a reducer from one
    thread: its lock keeps a call's exchanges together, but not the order in which threads
    reach it, which may differ between workers (each worker's call then pairs with its
    peers' other tensor, shapes alike). Every worker builds its
    reducers on a group in the same order too: a round's fingerprint names the reducer by
    that order, so a call one worker skipped is refused, not paired with another reducer's.
    With ``error_feedback`` a reducer serves one gradient (one parameter or bucket, step
    after step): its residual, the last call's rounding error, joins the next call's input,
    so two tensors through one reducer would each take the other's (make one reducer per
    tensor). ``generator``: this worker's rounding draws (see :func:`thc.codec.thc.encode`);
    by default keyed by its rank, group and name (:func:`agreement.rounding_key`), as a
    graphed reducer's, not by torch's global generator: training scripts seed that alike on
    every rank, and workers drawing alike would leave the mean's rounding error as large as
    one worker's; reducers of one worker drawing alike would correlate their errors.

    ``nonfinite``: a round in which some worker's input holds NaN or Inf (or a slice norm
    beyond :func:`norm_limit`) is refused on every worker ("raise"), or returns NaN in every
    element on every worker ("propagate"), the residual kept as it was: non-finite, as an
    all-reduce of the floats would be, which ``torch.amp.GradScaler`` needs to skip the step
    on every rank. A float64 input's finite value beyond float32's range is no overflow of
    the round: it is refused on every worker in either mode (the exchange computes in
    float32).
    Every worker of a job sets it alike (its rounds' fingerprint holds it).

    ``name``: what tells this reducer's rounds from other reducers' on its process group
    (or client), alike on every worker; by default its build order there (a name given is
    never taken for a build order, and a name given again there is told apart as its
    second use: :func:`agreement.identify`).
    """

    def __init__(self, transport, params: THCParams | None = None, error_feedback: bool = True,
                 generator=None, pipeline_elements: int = 1 << 21, backend: str = "auto",
                 nonfinite: str = "raise", name=None):
        self.nonfinite = agreement.nonfinite_mode(nonfinite)
        self.params = params or THCParams()
        if generator is not None:
            check_key(generator)   # here, not in a round's encode, where peers would wait
        if not isinstance(pipeline_elements, numbers.Integral) \
                or isinstance(pipeline_elements, bool) or pipeline_elements < 1 \
                or pipeline_elements % self.params.slice_size:
            raise ValueError(f"pipeline_elements ({pipeline_elements!r}) must be a positive "
                             f"multiple of the slice size ({self.params.slice_size})")
        self.pipeline_elements = int(pipeline_elements)
        self._pool: ThreadPoolExecutor | None = None
        self.transport = transport
        transport.check(self.params)
        # the table every round's fingerprint holds is made on first use: here, where a
        # failure (out of memory) is this worker's alone, not in a round its peers wait in
        agreement.fingerprint(self.params)
        # on a GPU nothing in a round waits for the device until its end (see __call__)
        self.codec = THCCodec(self.params, backend=backend, deferred_checks=True)
        self.feedback = ErrorFeedback(self.params) if error_feedback else None
        self.round = 0
        self._open = self._summed = self._taken = False
        self._sizes: set[int] = set()
        """Tensor sizes every worker's rounds have agreed on (:meth:`_agree_size`)."""
        self.stats = RoundStats()
        self._domain = agreement.domain_of(transport)
        self.name = agreement.identify(self._domain, name)
        """What tells this reducer's rounds from other reducers' (:func:`agreement.identify`)."""
        if generator is None and not isinstance(getattr(transport, "rank", None), int):
            generator = secrets.randbits(62)
        self._generator = generator

    @property
    def generator(self):
        """The key of this worker's rounding draws: the one given, else
        :func:`agreement.rounding_key` of its transport and its name as it is now (a DDP hook
        names its reducers once built)."""
        if self._generator is not None:
            return self._generator
        return agreement.rounding_key(self.transport, self.name)

    def skip_to(self, rnd: int) -> None:
        """Take round ``rnd`` next where it is ahead (rounds never go back: each draws its
        own rotation and rounding); a DDP hook's ``no_sync`` count (``BaseHook._count_round``).
        Refused as :func:`agreement.skipped_to` says."""
        self.round = agreement.skipped_to(self.round, rnd)

    @property
    def kept_residual(self) -> torch.Tensor | None:
        """The error-feedback residual the next round adds (None: none yet, or no feedback)."""
        return self.feedback.residual if self.feedback else None

    @property
    def state_owner(self) -> dict:
        """Whose state this reducer keeps (:func:`thc.collective.checkpoint.owner`)."""
        t = self.transport
        return checkpoint.owner(t.rank, t.n_workers, t.members, self.name)

    def state_dict(self) -> dict:
        """What a restarted worker needs to go on as this reducer would (:mod:`thc.collective.
        checkpoint`): its next round, a copy of its error-feedback residual and its owner."""
        return checkpoint.state(self.round, self.kept_residual, self.state_owner)

    def load_state_dict(self, state: dict) -> None:
        """Take :meth:`state_dict`'s state before the first round (this reducer's own); a
        graphed reducer's residual without the padding past its tensor's ``elements``."""
        what = type(self).__name__
        rnd, residual = checkpoint.loaded(state, self.round, self.feedback is not None, what,
                                          self.state_owner)
        checkpoint.within_codec(residual, self.params, what)
        n = checkpoint.elements(state, residual, what)
        if n is not None:
            residual = residual[:n].clone()
        self.round = rnd
        if self.feedback is not None:
            self.feedback.residual = residual

    @classmethod
    def through_aggregator(cls, client, params: THCParams | None = None, group=None, **kw):
        return cls(AggregatorTransport(client, group), params, **kw)

    @classmethod
    def through_torch_distributed(cls, group=None, params: THCParams | None = None, **kw):
        return cls(DistTransport(group), params, **kw)

    @property
    def n_workers(self) -> int:
        return self.transport.n_workers

    def rescale_residual(self, factor: float) -> None:
        """The gradients' scale changed by ``factor`` (new / old: a loss scaler's update):
        the error-feedback residual follows it. Call between rounds."""
        if self.feedback is not None:
            self.feedback.rescale(factor)

    def priority_classes(self, position, max_norms: torch.Tensor, numel: int) -> np.ndarray:
        """DLCP class of each slice: its earliest layer position and its agreed RMS magnitude.

        ``position`` (per element, in [0, 1], 0 = needed first by the next forward pass).
        A slice mixes its coordinates (the rotation), so classes are per slice: set
        ``THCParams.slice_size`` to a layer's size or less for per-layer classes."""
        return self._classes(check_positions(position, numel), max_norms, numel)

    def _classes(self, pos: torch.Tensor, max_norms: torch.Tensor, numel: int) -> np.ndarray:
        """:meth:`priority_classes` of positions already checked (:func:`check_positions`)."""
        size = self.params.slice_size
        n_slices = -(-numel // size)
        pad = n_slices * size - numel
        pos = torch.nn.functional.pad(pos, (0, pad), value=1.0).reshape(n_slices, size)
        lengths = np.full(n_slices, float(size))
        lengths[-1] = size - pad
        rms = max_norms.detach().cpu().double().numpy()[:n_slices] / np.sqrt(lengths)
        return priority_class(pos.amin(1).numpy(), magnitude_rank(rms))

    def _short_decode(self, sums, short: Short, idx, norms, numel: int, rnd: int):
        """Decode a round that closed short, and this worker's own counted contribution.

        A missing worker counts as zero in the rotated domain, i.e. as table value g/2; in
        doubled units (2S + (n - k) g over 2n workers) that is exact for odd g too."""
        g, n = self.params.granularity, self.n_workers
        counts = torch.from_numpy(short.counts.astype(np.int32)).to(sums.device)
        est = self.codec.decode(2 * sums + (n - counts) * g, 2 * n, norms, numel, rnd)
        own = None
        if self.feedback is not None:
            vals = 2 * table_values(idx, self.params).to(torch.int32)
            mine = torch.from_numpy(short.mine).to(vals.device)
            own = self.codec.decode(torch.where(mine, vals, g), 2, norms, numel, rnd)
        return est, own

    def __call__(self, tensor: torch.Tensor, position=None) -> torch.Tensor:
        """Stream piece k while a helper thread encodes piece k+1 and decodes piece k-1.

        Pieces are ``pipeline_elements`` long (whole slices), so every worker cuts a tensor
        the same way; each piece is encoded as a tensor of its own, its slices from index 0,
        under a codec round of its own (:meth:`_codec_round`). torch releases the GIL while
        it computes, so the codec overlaps the transport. A tensor up to one piece long is a
        single piece, and so is every tensor when the transport adds in the device's stream
        order (NCCL).

        Bad input never becomes a sum a worker accepts, and no worker waits for one whose
        input was bad or that failed before its norms: see :meth:`_max_round`. One that fails
        after its MAX round with nothing to mark abandons the process group
        (:meth:`DistTransport.abandon`): its peers' collectives time out (after the sums, the
        peers' round went well, and their next collective would pair with its). On the GPU the
        codec's checks are read once, at the round's end (on a stream-ordered transport) or
        after the MAX round (elsewhere).

        ``position``: per element, its layer's place in the next forward pass (0 first .. 1
        last); given, every chunk is marked with its DLCP priority class.
        """
        agreement.check_domain(self._domain, agreement.domain_of(self.transport))
        tensor, refusal = agreement.input_of(tensor, device_of(self._domain))
        with holding(self.transport):
            return self._call(tensor, position, refusal)

    def _call(self, tensor: torch.Tensor, position, refusal) -> torch.Tensor:
        """:meth:`__call__` of a checked input (``refusal``: why it is refused)."""
        if tensor.numel() == 0:
            # a round of the agreement alone: a peer whose tensor is not empty refuses it
            if refusal is None:   # checked as any input: an empty one is no exception
                refusal = self._checked(tensor, position)[2]
            rnd, self.round = self.round, self.round + 1
            key = agreement.fingerprint(self.params, 0, 0, reducer=self.name,
                                        shape=tensor.shape, refused=refusal is not None)
            agreement.empty_round(self.transport, rnd, key, tensor.device, refusal)
            return tensor.clone()
        self._open = self._summed = self._taken = False
        try:
            return self._round(tensor, position, refusal)
        except BaseException as e:
            self.codec.discard_checks()   # this round's flags are not the next one's
            if self._open and hasattr(self.transport, "abandon"):
                # peers wait in a sum this worker will not join, or, after the sums, go on
                # to their next collective: none of its later collectives may pair with theirs
                self.transport.abandon(f"round {self.round - 1} failed after its MAX round "
                                       f"({type(e).__name__}: {e})", self._summed)
            elif self._taken and not isinstance(e, Exception):
                # Ctrl-C or an exit between the round's agreement and its MAX round (an
                # Exception there sends the MAX round marked): its peers wait in that round
                agreement.owed(self.transport, self.round - 1, "MAX round", e)
            raise

    def _key(self, flat, pieces, like: torch.Tensor) -> int:
        """The round's fingerprint; ``like``: the caller's tensor (its dtype and shape)."""
        # one piece of the whole tensor, as a graphed round's: on a stream-ordered
        # transport (NCCL) the two may be peers (a graphed one that defers its checks not)
        try:
            backend = self.codec.choice(flat).name
        except Exception:  # noqa: BLE001 - raised again once the round went out, refused
            backend = "unresolved"
        steps = "sum" if getattr(self.transport, "stream_ordered", False) else "check"
        return agreement.fingerprint(self.params, flat.numel(), pieces[0][1] - pieces[0][0],
                                     backend=backend, steps=steps, nonfinite=self.nonfinite,
                                     reducer=self.name, dtype=like.dtype, shape=like.shape)

    def _agree_size(self, flat, pieces, rnd: int, like: torch.Tensor) -> None:
        """:func:`agreement.agree` before the first round of a tensor size, and before every
        round on a transport that asks for it (Gloo: a size new to one worker but known to
        another would pair unlike lengths). Sizes are added only once agreed, so every worker
        keeps the same set. Through an aggregator, workers that call sizes they all know in
        different orders pair MAX rounds of unlike lengths, whose tag lanes (first in every
        MAX round) differ in fingerprint: every worker refuses them. On NCCL their sums of
        unlike lengths go out before that check, and wait until the group's timeout (NCCL
        checks no lengths). It is part of round ``rnd``, which
        every worker counts however it ends."""
        try:
            agreement.agree(self.transport, rnd, self._key(flat, pieces, like), flat.device)
        except RuntimeError:
            self.codec.choice(flat)   # a backend this worker lacks: its own error, not "unlike"
            raise
        self._sizes.add(flat.numel())

    def _overflowed(self, max_norms, tags) -> bool:
        """Whether this round is handed on as NaN (``nonfinite="propagate"``)."""
        return self.nonfinite == "propagate" and agreement.overflowed(
            max_norms, tags, norm_limit(self.params))

    def _hint(self, max_norms, tags) -> str:
        """What a refusal adds: the way to hand the round on, where that would."""
        return agreement.PROPAGATE_HINT if self.nonfinite == "raise" and agreement.overflowed(
            max_norms, tags, norm_limit(self.params)) else ""

    def _max_round(self, flat, pieces, rnd: int, whole: bool, like, refusal=None):
        """Each piece's prepare, and the MAX round of their slice norms with the round number
        (:mod:`thc.collective.agreement`). A worker whose prepare fails still sends its MAX
        round, its bad slices marked (and on a stream-ordered transport joins the sum), then
        raises. Where the max norms reach the host, every worker refuses a marked round or
        one out of step here, before any sum; on a stream-ordered transport the kernels flag
        a mark and the rounds are compared at the round's end (:meth:`_round`).
        ``refusal``: this worker's input was refused; its round goes out, every slice marked.
        A round handed on as NaN (:meth:`_overflowed`) returns None for its preps."""
        layout_of = self.codec.layout
        key = self._key(flat, pieces, like)
        y = flat
        try:
            if refusal is not None:
                raise refusal
            y = self.feedback.compensate(flat) if self.feedback else flat
            preps = [self.codec.prepare(y[a:b], self._codec_round(rnd, a)) for a, b in pieces]
            norms = preps[0].norms if len(preps) == 1 else torch.cat([p.norms for p in preps])
            vector = agreement.tagged(norms, rnd, key)
        except Exception as e:
            overflow = refusal is None and isinstance(e, NonFiniteInput)
            try:
                bad = agreement.marks(y, pieces, layout_of, norm_limit(self.params), overflow)
                marked = agreement.tagged(bad, rnd, key)
            except BaseException as lost:   # owed: its peers wait in the round
                agreement.owed(self.transport, rnd, "marked MAX round", lost)
                raise
            self._open = whole   # on a stream-ordered transport a sum follows the MAX round
            # a Ctrl-C in the collective surfaces as it returns: the marked round went out,
            # and every peer refuses it
            self._taken = False
            max_norms, tags = agreement.untag(self.transport.max(marked))
            if whole:
                self._join_sum(y, pieces)
            self._open = False
            if refusal is not None:
                raise
            if self._overflowed(max_norms, tags):
                return y, None, max_norms, tags
            if overflow:
                hint = self._hint(max_norms, tags)
                if not bool(torch.isfinite(y).all()):
                    raise NonFiniteInput(f"input contains NaN or Inf in slice "
                                         f"{agreement.first_marked(bad)}{hint}") from e
                if hint:
                    raise NonFiniteInput(f"{e}{hint}") from e
            raise
        self._open = True   # from here the MAX round may have left: peers may wait in a sum
        max_norms, tags = agreement.untag(self.transport.max(vector))
        if not whole:
            if self._overflowed(max_norms, tags):
                self._open = False   # every worker hands it on here: no sum is pending
                return y, None, max_norms, tags
            if agreement.refused(max_norms, tags):
                self._open = False   # every worker refuses here: no sum is pending
                agreement.refuse_marked(norms, max_norms, self.params,
                                        hint=bool(self._hint(max_norms, tags)))
                agreement.check_rounds(tags)
            self.codec.check()
        return y, preps, max_norms, tags

    def _overflow(self, tensor: torch.Tensor) -> torch.Tensor:
        """A round handed on as NaN: no sum of it is used, the residual keeps its value."""
        self.codec.discard_checks()
        self.stats.overflows += 1
        self.stats.calls += 1
        self.stats.elements += tensor.numel()
        return torch.full_like(tensor, float("nan"))

    def _join_sum(self, y, pieces) -> None:
        """Zeros into a stream-ordered sum that every worker will refuse: its peers do not
        wait for this worker."""
        count = sum(self.codec.layout(b - a).total_padded for a, b in pieces)
        zeros = torch.zeros(count, dtype=torch.uint8, device=y.device)
        self.transport.sum(zeros, count, self.params)

    def _checked(self, tensor: torch.Tensor, position, refusal=None):
        """(flat input, checked positions, refusal): a refused input's round still goes out,
        from a stand-in of its length, marked, so that its peers refuse it too."""
        try:
            if refusal is not None:
                raise refusal
            flat = tensor.detach().reshape(-1)   # a sparse tensor has no flat view
            check_float(flat)
            if flat.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                flat = as_float32(flat)   # half types reach the kernels as they are
            check_generator(self.generator, flat)   # in encode, after the MAX round: too late
            if position is not None:
                position = check_positions(position, flat.numel())
            return flat, position, None
        except Exception as e:  # noqa: BLE001 - torch.as_tensor raises RuntimeError too
            try:   # the stand-in of its marked round
                return agreement.stand_in(tensor.numel, tensor.device), position, e
            except BaseException as lost:   # Ctrl-C: its peers wait in the round
                agreement.owed(self.transport, self.round, "marked round", lost)
                raise

    def _round(self, tensor: torch.Tensor, position, refusal=None) -> torch.Tensor:
        """``refusal``: input refused; its round still goes out, marked, so peers refuse it."""
        t0 = time.perf_counter()
        flat, position, refusal = self._checked(tensor, position, refusal)
        if refusal is not None and flat.numel() == 0:   # too large to hold: the empty round
            return self._call(flat, position, refusal)
        # a GPU tensor whose sums the transport adds in stream order gains nothing from
        # pieces: every step queues on the device anyway, and each piece costs host time
        whole = getattr(self.transport, "stream_ordered", False)
        step = max(flat.numel(), 1) if whole else self.pipeline_elements
        pieces = [(a, min(a + step, flat.numel())) for a in range(0, flat.numel(), step)]
        # every worker counts the round as taken, whatever happens in it (its agreement
        # included): a worker that fails part-way stays in step with those that do not (and
        # the MAX round checks it)
        rnd = self.round
        self.round += 1
        self._taken = True
        if getattr(self.transport, "agree_each_round", False) or \
                flat.numel() not in self._sizes:
            try:
                self._agree_size(flat, pieces, rnd, tensor)
            except RuntimeError as e:
                if refusal is not None:
                    raise refusal from e   # this worker's own error, as a marked round's
                raise
        # the fused encode: each piece's norms now, its wire form from them after the MAX round
        y, preps, max_norms, tags = self._max_round(flat, pieces, rnd, whole, tensor, refusal)
        if preps is None:
            return self._overflow(tensor)
        self._open = True   # until the round's end, or a refusal every worker reaches
        self.stats.seconds["norms"] += time.perf_counter() - t0
        slice_cls = (None if position is None or self.transport.lanes is None else
                     self._classes(position, max_norms, flat.numel()))
        try:
            est, own = self._exchange(flat, pieces, preps, max_norms, tags, rnd, whole,
                                      slice_cls)
        except _HandedOn:
            return self._overflow(tensor)
        return self._finish(tensor, flat, y, est, own, max_norms, tags, whole)

    def _encode_piece(self, prep, norms) -> torch.Tensor:
        """One piece's wire form, from its prepare and its slices' max norms."""
        t = time.perf_counter()
        wire = self.codec.encode_prepared(prep, norms, self.generator, self.transport.packed)
        self.stats.seconds["encode"] += time.perf_counter() - t
        return wire

    def _codec_round(self, rnd: int, a: int) -> int:
        """The codec round of round ``rnd``'s piece from element ``a``: piece k draws under
        ``rnd mod 2^40 + k * 2^40`` (mod 2^64), as each piece's slices restart at index 0:
        pieces of one round under one round drew the same rotation and rounding (equal pieces
        came out equal, errors a piece apart correlated). A round draws under its number
        modulo 2^40, what its round lanes carry (:func:`agreement.round_draw`); piece 0, and
        a whole tensor, under that alone."""
        return (agreement.round_draw(rnd) + a // self.pipeline_elements * agreement.ROUNDS) \
            % (1 << 64)

    def _decode_piece(self, est, own, a: int, b: int, sums, wire, short, norms,
                      rnd: int) -> None:
        """Elements ``a:b`` of the estimate (and of this worker's own decode, for the
        residual) from one piece's sums; ``short``: the chunks a loss bound closed short."""
        secs = self.stats.seconds
        t = time.perf_counter()
        rnd = self._codec_round(rnd, a)
        idx = wire
        if self.transport.packed and own is not None:
            idx = self.codec.unpack(wire, self.codec.layout(b - a).total_padded)
        if short is not None:
            est[a:b], own_ab = self._short_decode(sums, short, idx, norms, b - a, rnd)
            if own is not None:
                own[a:b] = own_ab
            secs["decode"] += time.perf_counter() - t
            return
        est[a:b] = self.codec.decode(sums, self.n_workers, norms, b - a, rnd)
        secs["decode"] += time.perf_counter() - t
        if own is not None:
            t = time.perf_counter()
            own[a:b] = self.codec.decode_own(idx, norms, b - a, rnd)
            secs["feedback"] += time.perf_counter() - t

    def _exchange(self, flat, pieces, preps, max_norms, tags, rnd: int, whole: bool,
                  slice_cls):
        """(estimate, own decode or None): each piece encoded, summed and decoded, the next
        piece's encode and the last one's decode on the codec thread while a sum is out.
        Raises :class:`_HandedOn` where a failed encode's round is handed on as NaN."""
        slice_size = self.params.slice_size
        norms_of = lambda a, b: max_norms[a // slice_size: -(-b // slice_size)]  # noqa: E731
        est = torch.empty_like(flat, dtype=torch.float32)
        own = torch.empty_like(flat, dtype=torch.float32) if self.feedback else None
        if self._pool is None and len(pieces) > 1:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="thc-codec")
        submit = self._pool.submit if len(pieces) > 1 else _inline

        def encode(k):
            a, b = pieces[k]
            wire = self._encode_piece(preps[k], norms_of(a, b))
            preps[k] = None
            return wire

        queued = [submit(encode, 0)]
        try:
            return self._pieces(flat, pieces, max_norms, tags, rnd, whole, slice_cls, est,
                                own, submit, encode, queued, norms_of)
        except BaseException:
            # nothing of a failed round may run on after it: its flags would be blamed on
            # the next round, and its encodes would draw from the generator beside that one's
            futures.wait([f for f in queued if not f.cancel()])
            raise

    def _pieces(self, flat, pieces, max_norms, tags, rnd, whole, slice_cls, est, own, submit,
                encode, queued: list[Future], norms_of):
        """:meth:`_exchange`'s loop: each piece's sum while the next piece's encode and the
        last one's decode run, every future put in ``queued``."""
        slice_size = self.params.slice_size
        lanes = self.transport.lanes
        next_wire, decodes = queued[0], []
        for k, (a, b) in enumerate(pieces):
            try:
                wire = next_wire.result()
            except Exception:
                over = whole and self._overflowed(max_norms, tags)
                if whole and (over or agreement.first_marked(max_norms) is not None):
                    self._join_sum(flat, pieces)   # every peer refuses this round: let them end
                    self._open = False
                    if over:
                        raise _HandedOn from None
                raise
            if k + 1 < len(pieces):
                next_wire = submit(encode, k + 1)
                queued.append(next_wire)
            count = self.codec.layout(b - a).total_padded
            classes = None
            if slice_cls is not None and lanes is not None:
                lane_slice = np.minimum(np.arange(0, count, lanes) // slice_size,
                                        len(slice_cls) - 1 - a // slice_size) + a // slice_size
                classes = slice_cls[lane_slice]
            t = time.perf_counter()
            sums, short = self.transport.sum(wire, count, self.params, classes)
            self.stats.seconds["sum"] += time.perf_counter() - t
            decodes.append(submit(self._decode_piece, est, own, a, b, sums, wire, short,
                                  norms_of(a, b), rnd))
            queued.append(decodes[-1])
        self._summed = True   # every sum of this worker's went out and came back
        try:
            for f in decodes:
                f.result()   # a failure here is this worker's alone: still open
        except ValueError:
            # the codec's checks of the sums, made in decode on the CPU: every worker holds
            # the same sums and refuses them alike
            self._open = False
            raise
        return est, own

    def _finish(self, tensor, flat, y, est, own, max_norms, tags, whole: bool):
        """The round's deferred checks (every worker reaches their refusals alike), then the
        residual and the estimate in the input's dtype."""
        self._open = False
        try:
            self.codec.check()
            if whole:
                agreement.check_rounds(tags)
        except ValueError as e:
            # read only now: a stream-ordered round's max norms reach the host at its end
            if not agreement.overflowed(max_norms, tags, norm_limit(self.params)):
                raise
            if self.nonfinite == "propagate":
                return self._overflow(tensor)
            raise NonFiniteInput(f"{e}{agreement.PROPAGATE_HINT}") from e
        self._open = True   # a failure from here on is this worker's alone
        out = cast_estimate(est.reshape(tensor.shape), tensor.dtype)
        if self.feedback:
            self.feedback.keep(y, own)
            moved = cast_moved(est, out)   # not applied: kept, alike on every worker
            if moved is not None:
                self.feedback.residual += moved
        self._open = False
        self.stats.calls += 1
        self.stats.elements += flat.numel()
        return out
