"""A THC all-reduce round of one tensor, replayed from a CUDA graph.

Why: called from Python, a round costs the host about a millisecond (argument checks and some
twenty launches), more than its kernels at DDP's bucket sizes (docs/results.md). Captured
once, a round is one replay. A graph fixes everything but the contents of memory, so:

- the reducer owns its buffers: a call copies the tensor into its input (with error
  feedback, the tensor plus the residual; padded where a tail slice is too short for the
  kernels) and the estimate out of its output;
- the round number lives on the device: the kernels derive the rotation and rounding keys
  from it, the MAX round's two round lanes come from it, and each round adds one to it;
- nothing inside a round waits for the device: the codec flags bad input into its status word
  (``THCCodec(deferred_checks=True)``), the round lanes are compared on the device, and the
  error-feedback residual changes only where the round was clean. One read after the round
  fetches all of it and raises what it names, as :class:`THCAllReduce` does at a round's end
  on a stream-ordered transport: every worker refuses a round with a marked slice or workers
  out of step.

That read waits for the round to finish, and the wait costs a DDP step more than the round:
the host stops running ahead of the device (docs/results.md). With ``deferred_checks`` a call
returns as soon as its round is launched: the estimate of a refused round is zeros (no wrong
sum reaches the model; the residual keeps its value), and what refused it is raised by the
next call, before that one takes a round, or by :meth:`GraphedAllReduce.check`. A deadline
still holds: the next call waits for the round no longer than ``timeout`` after its launch,
and :mod:`thc.collective.watchdog` ends the process a little later, raised or not (the
stream stays stuck; the loop may be waiting on it). A worker whose own call fails before its
MAX round (an error, once that round is owed) returns zeros too, and its next call raises
its error, as its peers raise the refusal: every worker skips the same step. (The type of
the error differs: the peers' is the refusal's ``ValueError``, this worker's a
``RuntimeError`` from its own.) A refusal that no call or ``check()`` raised by the time the
process ends (the last step's, where nothing checked after it), or by the time its reducer
is dropped, is told then, as a ``RuntimeWarning``, and so is a round not finished by then.

The rounding draws are keyed by a fixed int (``generator``) and the round, so with the same
int :class:`THCAllReduce` gives the same estimates, bit for bit, where no tail is padded and
it takes the tensor in one piece (on NCCL, or up to its ``pipeline_elements``). Every worker
of a job uses the same class: a padded tail changes the length of what is summed.

A graph is captured where one can run: CUDA tensors on a stream-ordered transport (NCCL). The
first round runs eagerly (it compiles the kernels and opens the communicator), the second is
captured, and every round from then on is a replay. Elsewhere (CPU tensors under Triton's
interpreter, Gloo) every round runs the same steps eagerly: how the tests check them.

A worker that fails before its MAX round could leave (a refused tensor, a failed capture, an
error in its own steps) still sends that round, every slice marked, and a sum of zeros, so its
peers refuse the round instead of waiting. One that fails between its MAX round and its sum
abandons the process group (``DistTransport.abandon``): none of its later rounds (a replay
is checked before it is launched) may pair with a peer's pending one, and the peers' time
out; so does one whose owed MAX round left without its zero sum, and one that fails after
its sum (its peers go on to their next collective). No NCCL watchdog watches a
replayed collective, so a replay is waited for with a deadline (``timeout``). While a round
is being captured (once per reducer), no other thread may issue collectives on the same
process group: DDP's own (``find_unused_parameters=True``) would land in the graph.
"""
from __future__ import annotations

import atexit
import sys
import time
import warnings
import weakref
from contextlib import nullcontext as _nothing
from dataclasses import dataclass

import torch

from thc.codec import kernels
from thc.codec.backends import kernels_for
from thc.codec.common import (NORM_MARK, STATUS_WORDS, WHOLE, NonFiniteInput, as_float32,
                              cast_estimate, cast_moved, check_float, check_key, norm_limit,
                              raise_status, scale_factor)
from thc.codec.params import THCParams
from thc.codec.thc import THCCodec, check_feedback
from thc.collective import agreement, checkpoint, replay
from thc.collective.allreduce import RoundStats
from thc.collective.transports import DistTransport, holding
from thc.collective.worker import device_of

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Input types the kernels read as they are."""
REPORT_LANES = STATUS_WORDS + agreement.TAG_LANES + 1
"""What a round reports to the host: its status word, its tag lanes, whether it overflowed."""


_DEFERRING: weakref.WeakSet = weakref.WeakSet()
"""The reducers with deferred checks: what they hold when the process ends is read then."""


def _check_input(flat: torch.Tensor, position) -> None:
    """Raise where a graphed round cannot take ``flat`` (of any length) with ``position``."""
    if position is not None:
        raise ValueError("DLCP priority classes travel through the aggregator's transport, "
                         "which a graphed round does not use")
    check_float(flat)


def _tell_unread(ar: "GraphedAllReduce", when: str) -> None:
    """Warn of the refusal ``ar``'s deferred round still holds (a round after which nothing
    was called or checked), or that it had not finished, ``when`` nothing can read it any
    more: without this it would go unseen. A round not finished is not waited for."""
    pending = ar._pending
    if pending is None:
        return
    try:
        if pending.failure is None and pending.done is not None and not pending.done.query():
            ar._pending = None
            what = "had not finished"
        else:
            ar.check()
            return
    except Exception as e:  # noqa: BLE001 - each reducer's round is told
        ar._pending = None   # once: a query that failed here would fail again at the drop
        what = f"was refused ({type(e).__name__}: {e})"
    told = (f"round {pending.round} of graphed reducer {ar.name!r} {what} when {when}, and "
            f"no check() after the last step read it")
    try:
        warnings.warn(told, RuntimeWarning, stacklevel=1)
    except Warning:   # warnings made errors (-W error): told all the same
        print(f"RuntimeWarning: {told}", file=sys.stderr)


@atexit.register
def _read_at_exit() -> None:
    """Tell each deferred round nothing read (:func:`_tell_unread`) as the process ends."""
    for ar in list(_DEFERRING):
        _tell_unread(ar, "the process ended")


@dataclass
class _Buffers:
    """What a captured round reads and writes: fixed addresses for the graph's life."""
    numel: int
    dtype: torch.dtype
    """The tensor's type, which the reducer serves."""
    shape: tuple
    """The tensor's shape, which its rounds' fingerprint names (agreement.shape_of)."""
    x: torch.Tensor
    """The round's input, padded: the tensor or, with error feedback, the tensor plus the
    residual (float32), both written by the call before the replay."""
    residual: torch.Tensor | None
    out: torch.Tensor
    round: torch.Tensor
    report: torch.Tensor
    """float64: the status word's ints, the tag lanes, then 1 where the round
    overflowed (:func:`agreement.overflowed_on_device`), else 0."""
    clean: torch.Tensor
    """Whether the round is clean (a bool on the device)."""
    overflow: torch.Tensor
    """Whether the round was refused for overflow alone (a bool on the device)."""
    host: torch.Tensor
    """The report copied to the host (pinned memory on CUDA) for deferred checks."""


class GraphedAllReduce:
    """Callable like :class:`THCAllReduce` (one tensor size a reducer), its rounds replayed
    from a CUDA graph where one can be captured (``capture``: None decides, and runs eagerly
    after a failed capture; True insists, and tries again each round; False never).
    ``generator``: this worker's key of the rounding draws (default: its rank, group and
    name hashed, as :class:`THCAllReduce`'s); give each worker its own
    (``base + rank``): workers that share one round alike, and the mean gets noisier.
    ``deferred_checks``: return without waiting for the round, raise its refusal later
    (module docstring); every worker of a job sets it alike (its rounds' fingerprint holds
    it). ``nonfinite``: as :class:`THCAllReduce`'s; a round handed on gives NaN, deferred or
    not, and raises nothing later. ``name``: as :class:`THCAllReduce`'s."""

    def __init__(self, transport, params: THCParams | None = None, error_feedback: bool = True,
                 generator: int | None = None, capture: bool | None = None,
                 timeout: float = 600.0,
                 deferred_checks: bool = False, nonfinite: str = "raise", name=None):
        self.nonfinite = agreement.nonfinite_mode(nonfinite)
        if generator is not None:
            if isinstance(generator, bool) or not isinstance(generator, int):
                raise TypeError(f"a graphed round keys its rounding draws by a fixed int and "
                                f"the round; got generator={generator!r}")
            check_key(generator)
        if transport.packed:
            raise ValueError("a graphed round sums through torch.distributed: the "
                             "aggregator's client runs on the host")
        self.params = params or THCParams()
        kernels.check_granularity(self.params)
        self.transport = transport
        transport.check(self.params)
        agreement.fingerprint(self.params)   # its table made here, as THCAllReduce's
        if error_feedback:
            check_feedback(self.params)
        self.error_feedback = error_feedback
        self.capture = capture
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.timeout = float(timeout)
        """Seconds a replayed round may take (NCCL's own default: 10 minutes)."""
        self.codec = THCCodec(self.params, backend="triton", deferred_checks=True)
        self.deferred_checks = deferred_checks
        if deferred_checks:
            _DEFERRING.add(self)
        self._pending: replay.Pending | None = None
        """A deferred round whose report is still to be read."""
        self.round = 0
        """Rounds taken (every call takes one, as in :class:`THCAllReduce`)."""
        self.stats = RoundStats()
        self.stats.seconds["graph"] = 0.0
        self.graph = None
        self._warm = False
        self._bufs: _Buffers | None = None
        self._loaded: torch.Tensor | None = None
        """A residual loaded before the buffers were made (:meth:`load_state_dict`)."""
        self._loaded_elements: int | None = None
        """The length of the tensor whose residual ``_loaded`` is (it may hold padding)."""
        self._agreed = False
        """Whether the workers agreed on this reducer's size (:meth:`_agree_size`)."""
        self._round_bytes = 0
        self._capturing = False
        self._sent = 0
        """How far this round got: 1 from when its MAX round may have left this worker, 2
        once its sum is done (left at 0 while capturing: a capture sends nothing)."""
        self._domain = agreement.domain_of(transport)
        self.name = agreement.identify(self._domain, name)
        """What tells this reducer's rounds from other reducers' (:func:`agreement.identify`)."""
        self._key = generator

    @property
    def key(self) -> int:
        """The key of this worker's rounding draws: the one given, else
        :func:`agreement.rounding_key` of its transport and its name as it is now (a DDP hook
        names its reducers once built)."""
        if self._key is not None:
            return self._key
        return agreement.rounding_key(self.transport, self.name)

    @classmethod
    def through_torch_distributed(cls, group=None, params: THCParams | None = None, **kw):
        return cls(DistTransport(group), params, **kw)

    @property
    def n_workers(self) -> int:
        return self.transport.n_workers

    @property
    def kept_residual(self) -> torch.Tensor | None:
        """As :attr:`THCAllReduce.kept_residual`: the rounds' buffer, padded."""
        b = self._bufs
        return b.residual if b is not None else self._loaded

    @property
    def state_owner(self) -> dict:
        """As :attr:`THCAllReduce.state_owner`."""
        t = self.transport
        return checkpoint.owner(t.rank, t.n_workers, t.members, self.name)

    def state_dict(self) -> dict:
        """As :meth:`THCAllReduce.state_dict`; the residual as the rounds keep it, padded
        (read once the rounds launched so far are done), and the length of its tensor."""
        b = self._bufs
        return {**checkpoint.state(self.round, self.kept_residual, self.state_owner),
                "elements": b.numel if b is not None else self._loaded_elements}

    def load_state_dict(self, state: dict) -> None:
        """As :meth:`THCAllReduce.load_state_dict`: the residual is copied into the rounds'
        buffer when the first call makes it, for a tensor of the saved one's length (a state
        without ``elements``, as a THCAllReduce's: of its residual's, padded or not)."""
        what = type(self).__name__
        rnd, loaded = checkpoint.loaded(state, self.round, self.error_feedback, what,
                                        self.state_owner)
        checkpoint.within_codec(loaded, self.params, what)
        elements = checkpoint.elements(state, loaded, what)
        self.round, self._loaded, self._loaded_elements = rnd, loaded, elements

    def rescale_residual(self, factor: float) -> None:
        """As :meth:`THCAllReduce.rescale_residual`: in place (the graph reads the buffer at
        its address), queued on the current CUDA stream: call it on the stream the rounds
        run on (the default one, unless the caller chose another), so that it follows every
        round launched so far."""
        factor = scale_factor(factor)
        b = self._bufs
        if b is not None and b.residual is not None:
            with torch.cuda.device(b.x.device) if b.x.is_cuda else _nothing():
                b.residual.mul_(factor)
        elif self._loaded is not None:   # loaded, not yet in a buffer
            self._loaded = self._loaded * factor

    def _padded(self, numel: int, like: torch.Tensor) -> int:
        """The length of an input of ``numel`` elements on ``like``'s device, padded so that
        every slice runs in the kernels."""
        kern = kernels_for(like, "triton")
        size = self.params.slice_size
        if not kern.supports(size):
            raise ValueError(f"a graphed round needs slices the kernels take; slice_size "
                             f"{size} is not one")
        if all(kern.supports(g.padded) for g in self.codec.layout(numel).groups(WHOLE)):
            return numel
        low = next(1 << k for k in range(size.bit_length()) if kern.supports(1 << k))
        return numel - numel % size + low

    def _buffers(self, flat: torch.Tensor, shape) -> _Buffers:
        b = self._bufs
        if b is None:
            n, dev = self._padded(flat.numel(), flat), flat.device
            ef = self.error_feedback
            loaded = self._loaded
            if loaded is not None and (self._loaded_elements not in (None, flat.numel()) or
                                       loaded.numel() not in (flat.numel(), n)):
                held = (f"holds {loaded.numel()} elements" if self._loaded_elements is None
                        else f"is of a tensor of {self._loaded_elements} elements "
                             f"({loaded.numel()} kept)")
                raise ValueError(f"the loaded residual {held}, this tensor {flat.numel()} "
                                 f"({n} padded)")
            residual = torch.zeros(n, device=dev) if ef else None
            if loaded is not None:
                residual[:loaded.numel()] = loaded.to(dev, torch.float32)
            b = self._bufs = _Buffers(
                flat.numel(), flat.dtype, tuple(shape),
                torch.zeros(n, dtype=torch.float32 if ef else flat.dtype, device=dev),
                residual,
                torch.empty(n, device=dev),
                torch.full((1,), agreement.round_draw(self.round - 1), dtype=torch.int64,
                           device=dev),
                torch.zeros(REPORT_LANES, dtype=torch.float64, device=dev),
                torch.zeros((), dtype=torch.bool, device=dev),
                torch.zeros((), dtype=torch.bool, device=dev),
                torch.zeros(REPORT_LANES, dtype=torch.float64, pin_memory=dev.type == "cuda"))
            self._loaded = None
        elif (b.numel, b.dtype, b.x.device, b.shape) != (flat.numel(), flat.dtype, flat.device,
                                                         tuple(shape)):
            raise ValueError(f"a graphed all-reduce serves one tensor: {list(b.shape)} "
                             f"{b.dtype} on {b.x.device}, got {list(shape)} {flat.dtype} on "
                             f"{flat.device}")
        return b

    @staticmethod
    def _take(b: _Buffers, flat: torch.Tensor) -> None:
        """The round's input into ``b.x``, in the launch that copied the tensor there (one
        more for a padded tail): with error feedback, the tensor plus the residual, and the
        padding (zeros) plus its residual, -0.0 made 0.0 as that sum makes it."""
        if b.residual is None:
            b.x[:b.numel].copy_(flat)
            return
        torch.add(flat, b.residual[:b.numel], out=b.x[:b.numel])
        if b.numel < b.x.numel():
            torch.add(b.residual[b.numel:], 0.0, out=b.x[b.numel:])

    def _step(self, b: _Buffers) -> None:
        """One round on the buffers, nothing read on the host: what the graph captures."""
        from thc.collective import round_kernels   # needs triton, as the codec's kernels do
        c, n, y = self.codec, b.x.numel(), b.x
        word = c.status(y)
        word.zero_()   # each round's flags are its own, cleared in its stream order
        prep = c.prepare(y, b.round)
        vector = round_kernels.tagged(prep.norms, b.round,
                                      self._fingerprint(b.numel, b.x, b.dtype, b.shape))
        self._check_usable()
        self._sent = 0 if self._capturing else 1   # from here the MAX round may have left
        maxima = self.transport.max(vector).contiguous()
        max_norms = agreement.untag(maxima)[0]
        wire = c.encode_prepared(prep, max_norms, self.key, pack=False)
        sums, _ = self.transport.sum(wire, wire.numel(), self.params)
        self._sent = 0 if self._capturing else 2
        c.decode(sums, self.n_workers, max_norms, n, b.round, out=b.out)
        own = c.decode_own(wire, max_norms, n, b.round) if b.residual is not None else None
        # after every kernel flagged; moves the device's round on
        round_kernels.settle(word, maxima, b.clean, b.overflow, b.report, b.round,
                             norm_limit(self.params))
        if own is not None:
            round_kernels.keep_residual(y, own, b.clean, b.residual)

    def skip_to(self, rnd: int) -> None:
        """Take round ``rnd`` next where it is ahead (rounds never go back: each draws its
        own rotation and rounding); a DDP hook's ``no_sync`` count (``BaseHook._count_round``).
        Refused as :func:`agreement.skipped_to` says."""
        ahead = agreement.skipped_to(self.round, rnd)
        if ahead > self.round:
            self.round = ahead
            self._round_on_device()

    def _round_on_device(self) -> None:
        """A round that ended without its step: the device's number stays the host's."""
        if self._bufs is not None:
            self._bufs.round.fill_(agreement.round_draw(self.round))

    def _fingerprint(self, numel: int, like: torch.Tensor, dtype, shape) -> int:
        """A round's fingerprint, as an eager reducer's of the same tensor (one piece on a
        stream-ordered transport): the two may be peers, unless this one pads a short tail
        slice (its sums are longer: the padded length stands for the piece's) or defers its
        checks (it raises a refusal a call later)."""
        try:
            backend = self.codec.choice(like).name
            summed = self._padded(numel, like)
        except Exception:  # noqa: BLE001 - raised again once the round went out, refused
            backend, summed = "unresolved", numel
        # a deferred round's refusal is raised a call later: its peers must defer alike
        steps = "sum, raised later" if self.deferred_checks else "sum"
        return agreement.fingerprint(self.params, numel, summed, backend=backend, steps=steps,
                                     nonfinite=self.nonfinite, reducer=self.name, dtype=dtype,
                                     shape=shape)

    def _agree_size(self, tensor: torch.Tensor, rnd: int) -> None:
        """:func:`agreement.agree` in round ``rnd`` before the first round, and before every
        round on a transport that asks for it (Gloo). A first round that failed after it
        still went out (owed). Every worker counts the round however the agreement ends."""
        n = tensor.numel()
        try:
            agreement.agree(self.transport, rnd,
                            self._fingerprint(n, tensor, tensor.dtype, tensor.shape),
                            tensor.device)
        except RuntimeError:
            self.codec.choice(tensor)   # a backend this worker lacks: its own error
            raise
        self._agreed = True

    def _capturable(self, flat: torch.Tensor) -> bool:
        can = flat.device.type == "cuda" and getattr(self.transport, "stream_ordered", False)
        if self.capture and not can:
            raise ValueError("a CUDA graph captures a round of CUDA tensors on a "
                             "stream-ordered transport (NCCL) only")
        return can if self.capture is None else bool(self.capture)

    def _run(self, b: _Buffers, flat: torch.Tensor) -> None:
        if self.graph is not None:
            self._check_usable()   # a replay's collectives run whatever Python thinks
            self._sent = 1
            self.graph.replay()
            self.transport.bytes_sent += self._round_bytes
            if not self.deferred_checks:
                replay.await_stream(b.x.device, self.round - 1, self.timeout)
            self._sent = 2
            return
        before = self.transport.bytes_sent
        capture = self._capturable(flat)
        if not self._warm or not capture:
            self._step(b)
            self._round_bytes = self.transport.bytes_sent - before
            self._warm = True
            return
        graph = torch.cuda.CUDAGraph()
        self._capturing = True
        try:
            # other threads (backward, while a DDP hook captures) go on launching meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._step(b)
        except BaseException:
            if self.capture is None:
                self.capture = False   # this reducer's rounds run eagerly from now on
            raise
        finally:
            self._capturing = False
            self.transport.bytes_sent = before   # capture sends nothing
        self.graph = graph
        self._run(b, flat)

    def __del__(self):
        """A reducer dropped (its hook freed, a model wrapped anew) tells what its last
        deferred round still holds, as the process's end would have."""
        if getattr(self, "_pending", None) is not None:
            _tell_unread(self, "its reducer was dropped")

    @property
    def owes_check(self) -> bool:
        """Whether a round's deferred checks are still to be read (by the next call or
        :meth:`check`)."""
        return self._pending is not None

    def check(self) -> None:
        """Raise what refused the last round whose checks were deferred, once it has run
        (waiting at most until its deadline); nothing to do otherwise."""
        pending = self._pending
        if pending is None:
            return
        if pending.failure is not None:
            self._pending = None
            raise RuntimeError(f"round {pending.round} was refused by every worker: this "
                               f"worker failed before its MAX round "
                               f"({type(pending.failure).__name__}: {pending.failure})"
                               ) from pending.failure
        if pending.done is not None:
            try:
                replay.await_done(pending.done, pending.launched, pending.round, self.timeout)
            except TimeoutError as e:
                self._pending = None
                if hasattr(self.transport, "abandon"):
                    self.transport.abandon(str(e))
                raise
        self._pending = None
        self._raise_report(self._bufs.host.tolist())

    def _raise_report(self, values: list[float]) -> bool:
        """Raise what refused the round of the report ``values``, if anything; whether the
        round was handed on as NaN instead (``nonfinite="propagate"``)."""
        tags = values[STATUS_WORDS:-1]
        if not values[0] and agreement.agreed(tags):
            return False
        if values[-1] and self.nonfinite == "propagate":
            self.stats.overflows += 1
            return True
        try:
            raise_status([int(v) for v in values[:STATUS_WORDS]], self.params)
        except ValueError as e:
            if values[-1]:
                raise NonFiniteInput(f"{e}{agreement.PROPAGATE_HINT}") from e
            raise
        agreement.check_rounds(tags)
        return False

    def _check_usable(self) -> None:
        check = getattr(self.transport, "usable", None)
        if check is not None:
            check()

    def _owe(self, tensor: torch.Tensor) -> bool:
        """What a worker that failed before its MAX round could leave owes its peers: that
        round with every slice marked and a sum of zeros (the peers' rounds sum without a
        host check between), so that every peer refuses the round instead of waiting.
        Whether both went out. ``tensor`` as given (a sparse one has no flat view)."""
        sent = False
        try:
            b = self._bufs
            numel = b.numel if b is not None else tensor.numel()
            n = b.x.numel() if b is not None else self._padded(
                numel, torch.empty(0, device=tensor.device))
            # the reducer's device, not the refused tensor's
            lay, dev = self.codec.layout(n), (b.x.device if b is not None else tensor.device)
            marks = torch.full((lay.n_slices,), NORM_MARK, device=dev)
            zeros = torch.zeros(lay.total_padded, dtype=torch.uint8, device=dev)
            key = self._fingerprint(numel, marks, *((b.dtype, b.shape) if b is not None
                                                    else (tensor.dtype, tensor.shape)))
            vector = agreement.tagged(marks, self.round - 1, key)
            sent = True
            self.transport.max(vector)
            self.transport.sum(zeros, lay.total_padded, self.params)
            return True
        except BaseException as e:  # noqa: BLE001 - the worker's own error is the one raised
            if not sent:   # its peers wait in the MAX round
                agreement.owed(self.transport, self.round - 1, "owed MAX round", e)
            elif hasattr(self.transport, "abandon"):
                self.transport.abandon(f"round {self.round - 1}: a failed worker's owed MAX "
                                       f"round may have left without its sum "
                                       f"({type(e).__name__}: {e})")
            if not isinstance(e, Exception):
                raise
            return False

    def _settle(self, tensor: torch.Tensor, error: BaseException) -> bool:
        """A round this worker cannot finish: its round number still moves on, and its peers
        neither wait for it nor pair a later collective of its with one of theirs. Before
        its MAX round could leave it owes that round (:meth:`_owe`); once it has left nothing
        can be marked any more, so the transport is abandoned (``DistTransport.abandon``):
        no collective of this worker follows on that process group, and the peers' time
        out. That holds after the sum too: the peers' round went well, and their next
        collective (a DDP hook's FP32 spans, the next round) would pair with this worker's.
        Whether the round was owed (and so refused by every worker)."""
        self._round_on_device()
        if self._sent == 0:
            return self._owe(tensor)
        self._abandon("between its MAX round and its sum" if self._sent == 1 else
                      "after its sum", error)
        return False

    def _abandon(self, where: str, error: BaseException) -> None:
        if hasattr(self.transport, "abandon"):
            self.transport.abandon(f"round {self.round - 1} failed {where} "
                                   f"({type(error).__name__}: {error})")

    @staticmethod
    def _keep_moved(b: "_Buffers", out: torch.Tensor, clean=None) -> torch.Tensor:
        """``out``, after the residual took what its cast moved (float16's hold at +-65504,
        a half type's rounding), which is not applied, as THCAllReduce's does; where the
        round was ``clean`` (a device flag) alone. On the rounds' stream, no wait."""
        moved = cast_moved(b.out[:b.numel], out)
        if b.residual is not None and moved is not None:
            b.residual[:b.numel] += moved if clean is None else torch.where(clean, moved, 0.0)
        return out

    def _after_sum(self, step):
        """``step()``, a step of this worker's own after its sum: where it fails, the group
        is abandoned, as :meth:`_settle` says why."""
        try:
            return step()
        except BaseException as e:
            self._abandon("after its sum", e)
            raise

    def __call__(self, tensor: torch.Tensor, position=None) -> torch.Tensor:
        """The THC estimate of the workers' mean of ``tensor``; raises, on every worker, what
        :class:`THCAllReduce` raises at a round's end (bad input anywhere, workers out of
        step); with deferred checks, zeros for that round and the error at the next call.
        ``position`` (DLCP classes) needs the aggregator's transport: refused, on every
        worker, as bad input is. The round holds its process group
        (:func:`thc.collective.transports.round_lock`): its sums carry no tag."""
        with holding(self.transport):
            return self._call(tensor, position)

    def _call(self, tensor: torch.Tensor, position) -> torch.Tensor:
        """:meth:`__call__` under the group's round lock."""
        agreement.check_domain(self._domain, agreement.domain_of(self.transport))
        self.check()   # the last round's refusal, before this one takes a round
        tensor, refusal = agreement.input_of(
            tensor, self._bufs.x.device if self._bufs is not None else device_of(self._domain))
        t0 = time.perf_counter()
        # every worker counts the round as taken, whatever happens in it (its agreement
        # included)
        rnd = self.round
        self.round += 1
        empty = tensor.numel() == 0
        if empty and refusal is None:   # checked as any input: an empty one is no exception
            try:
                _check_input(tensor, position)
            except Exception as e:  # noqa: BLE001 - raised by its round, on every worker
                refusal = e
        if empty or not self._agreed or getattr(self.transport, "agree_each_round", False):
            try:
                if empty:   # a round of the agreement alone: a peer with a tensor refuses it
                    agreement.empty_round(self.transport, rnd, agreement.fingerprint(
                        self.params, 0, 0, reducer=self.name, shape=tensor.shape,
                        refused=refusal is not None), tensor.device, refusal)
                else:
                    self._agree_size(tensor, rnd)
            except BaseException as e:
                self._round_on_device()
                if not empty and refusal is not None and isinstance(e, Exception):
                    raise refusal from e   # this worker's own error, as a marked round's
                raise
        if empty:
            self._round_on_device()
            return tensor.clone()
        self._sent = 0
        try:
            if refusal is not None:
                raise refusal
            flat = tensor.detach().reshape(-1)
            _check_input(flat, position)   # owed to the peers as a refused round
            if flat.dtype not in KERNEL_DTYPES:
                flat = as_float32(flat)
            b = self._buffers(flat, tensor.shape)
            with torch.cuda.device(b.x.device) if b.x.is_cuda else _nothing():
                self._take(b, flat)
                self._run(b, flat)
        except Exception as e:
            if self._settle(tensor, e) and self.deferred_checks:
                # as its peers do: zeros now, the refusal raised by the next call
                self._pending = replay.Pending(self.round - 1, time.monotonic(), failure=e)
                return torch.zeros_like(tensor)
            raise
        except BaseException as e:
            self._settle(tensor, e)
            raise
        if self.deferred_checks:
            try:
                # zeros where the round was refused: its refusal is raised by the next call;
                # NaN where it overflowed and is handed on
                refused = torch.where(b.overflow, float("nan"), 0.0) \
                    if self.nonfinite == "propagate" else 0.0
                out = cast_estimate(torch.where(b.clean, b.out[:b.numel], refused),
                                    tensor.dtype)
                self._keep_moved(b, out, b.clean)
                # after the reads of the buffers: its event covers them
                self._pending = replay.defer(b.report, b.host, self.round - 1, self.timeout)
            except BaseException as e:
                # the round went out, but whether it was refused is unknown here
                if hasattr(self.transport, "abandon"):
                    self.transport.abandon(f"round {self.round - 1}: its checks could not be "
                                           f"deferred ({type(e).__name__}: {e})")
                raise
        else:
            report = self._after_sum(lambda: b.report.tolist())
            if self._raise_report(report):   # a refusal every worker reaches alike
                out = torch.full_like(tensor, float("nan"))
            else:
                # a copy: the next round overwrites the buffer
                out = self._after_sum(lambda: self._keep_moved(b, cast_estimate(
                    b.out[:b.numel], tensor.dtype, copy=True)))
        self.stats.calls += 1
        self.stats.elements += b.numel
        self.stats.seconds["graph"] += time.perf_counter() - t0
        return out.reshape(tensor.shape)
