"""What the workers of a THC all-reduce round must agree on before any of them trusts its
sums, and how a worker that cannot go on lets its peers end the round with an error instead of
a wait.

- A worker whose gradient holds NaN or Inf still sends its MAX round, its bad slices' norms
  replaced by :data:`OVERFLOW_MARK` (above any real norm): every worker refuses those slices,
  or, where its reducer hands overflows on (``nonfinite="propagate"``), returns NaN
  (:func:`overflowed`). A worker that failed otherwise marks every slice with
  :data:`NORM_MARK`, one step higher: the max norms then say failure, and every worker refuses.
- The round number travels in the MAX round's first lanes as two parts below
  ``ROUND_SPAN``, each as a pair ``v`` and ``ROUND_SPAN - v``: their maxima give every worker
  the largest and the smallest part of the job, which differ only when some worker missed a
  round (40 bits: a worker 2^20 rounds behind is seen too). The next two pairs carry a 48-bit
  fingerprint of what the round's sums assume alike (:func:`fingerprint`: the codec's
  parameters and the tensor's cut) the same way: workers whose rotations, tables or lengths
  differ refuse the round instead of decoding each other's indices as their own. The norms
  follow the eight tag lanes, so that every worker reads the tags from the same lanes
  whatever its tensor's slice count.
- On a stream-ordered transport (NCCL) the peers do not read the max norms before the sum, so
  a worker that stops between the MAX round and the sum first joins the sum with zeros, but
  only where a mark makes every peer refuse that sum anyway.
"""
from __future__ import annotations

import hashlib
import threading
import weakref

import numpy as np
import torch
import torch.distributed as dist

from thc.codec import rng
from thc.codec.common import (BAD_INPUT_TEXT, NORM_MARK, OVERFLOW_MARK, NonFiniteInput,
                              norm_limit)
from thc.collective.transports import DistTransport, ring_bytes

ROUND_SPAN = 1 << 20
"""A round number travels as two parts below this (each exact in float32): 40 bits."""
ROUNDS = ROUND_SPAN * ROUND_SPAN
"""Round numbers the agreement tells apart: the round lanes carry a round modulo it."""
KEY_SPAN = 1 << 24
"""A fingerprint travels as two parts below this (float32 holds every integer up to it)."""
SPANS = (ROUND_SPAN, ROUND_SPAN, KEY_SPAN, KEY_SPAN)
"""The span of each tag pair: the round's low and high parts, the fingerprint's."""

TAG_LANES = 2 * len(SPANS)
"""The lanes before the norms: the round number's pairs, then the fingerprint's."""


NONFINITE = ("raise", "propagate")
"""What a reducer does with a round in which some worker's input holds NaN or Inf: refuse it
(raise), or hand it on as NaN on every worker (non-finite, as an all-reduce of the floats
would be), so that ``torch.amp.GradScaler`` skips the step."""


def nonfinite_mode(value: str) -> str:
    """``value`` if it is one of :data:`NONFINITE`, else a ValueError naming them."""
    if value not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {value!r}")
    return value


def input_of(obj, device="cpu") -> tuple[torch.Tensor, Exception | None]:
    """A reducer's input and its refusal. A non-tensor (a numpy array, a list) is refused,
    but its round still goes out: zeros on ``device`` (where the reducer's collectives take
    their tensors: NCCL moves device tensors only) stand in for it (:func:`stand_in`). A
    meta tensor, which has a size but no values (and which Gloo "sums" without sending), is
    refused and stood in for alike, and so is a nested tensor, which has no one shape. The
    stand-in takes the input's shape where it can be read (:func:`shape_of`)."""
    if isinstance(obj, torch.Tensor) and not obj.is_meta and not obj.is_nested:
        return obj, None
    error = (ValueError("a reducer takes a tensor with values, got one on the meta device")
             if isinstance(obj, torch.Tensor) and obj.is_meta else
             ValueError("a reducer takes a dense tensor, got a nested one")
             if isinstance(obj, torch.Tensor) else
             TypeError(f"a reducer takes a torch.Tensor, got {type(obj).__name__}"))
    try:
        # of the input's half type, which a round's key holds (:func:`half_type`): its peers
        # then see its refusal, not unlike keys
        dtype = getattr(obj, "dtype", None)
        dtype = torch.float16 if isinstance(dtype, np.dtype) and dtype.kind == "f" and \
            dtype.itemsize == 2 else dtype
        dtype = dtype if half_type(dtype) else torch.float32
    except Exception:  # noqa: BLE001 - a dtype that cannot be read or compared: float32
        dtype = torch.float32
    size = obj.numel if isinstance(obj, torch.Tensor) else lambda: int(np.size(obj))
    zeros = stand_in(size, device, dtype)
    try:   # its peers' keys hold the shape too
        shape = obj.shape if isinstance(obj, torch.Tensor) else np.shape(obj)
        return zeros.reshape(shape_of(shape) or zeros.shape), error
    except Exception:  # noqa: BLE001 - a shape that cannot be read or held: as it stands
        return zeros, error


def stand_in(size, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """Zeros in place of a refused input, so that its round still goes out: ``size()`` of
    them, or none where that count cannot be read (no size, a ragged or lying one) or held
    (too large, on this worker or every one). A peer whose tensor is not empty refuses the
    empty round as unlike (on NCCL, which checks no lengths, it waits in its sum until the
    group's timeout instead); workers that all stand in as empty refuse it alike. Making the
    stand-in must not fail: that would leave this worker a round behind its peers, each later
    sum paired with their previous one. Ctrl-C propagates, for the caller to abandon."""
    try:
        return torch.zeros(size(), device=device, dtype=dtype)
    except Exception:  # noqa: BLE001 - see above: it stands in as empty
        return torch.zeros(0, device=device, dtype=dtype)


_built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_built_lock = threading.Lock()


def ordinal(domain, kind: str = "reducer") -> int:
    """How many ``kind`` (reducers, hooks) this process built on ``domain`` (the process group
    or client their rounds pair on) before this one."""
    with _built_lock:
        counts = _built.setdefault(domain, {})
        n = counts[kind] = counts.get(kind, -1) + 1
    return n


def domain_of(transport):
    """What ``transport``'s rounds pair on (its ``domain``: a process group, a client); a
    transport that names none pairs on itself."""
    return getattr(transport, "domain", transport)


def identify(domain, name=None):
    """A reducer's name: what tells its rounds from other reducers' on ``domain``, in every
    round's fingerprint. Round numbers count per reducer, so a worker that skipped one call
    of two like-sized reducers would pair one's rounds with the other's for good, each a
    valid-looking sum; named apart, they are refused. ``name`` alike on every worker, or by
    default the reducer's build order on ``domain``, which every worker then keeps alike (a
    DDP hook names its reducers itself). A given name is kept apart from the build orders
    (``name=0`` is not the first unnamed reducer), and counts its own builds on ``domain``:
    two reducers given one name (one rebuilt, or given it twice) are told apart as the
    name's first and second, alike on workers that build alike, whatever the first's life."""
    if name is None:
        return ordinal(domain)
    return ("named", name, ordinal(domain, f"named {name!r}"))


def given_name(identity):
    """The name an :func:`identify` identity was given (None: a build order, which tells
    reducers apart within one process, not across a restart)."""
    return identity[1] if isinstance(identity, tuple) and identity[0] == "named" else None


def rounding_key(transport, identity) -> int:
    """A reducer's default key of its rounding draws: its worker's rank, what its rounds pair
    on (a process group's name, an aggregator job) and its :func:`identify` identity, hashed.
    Keyed by the rank alone, every reducer of a worker drew alike in a round (a DDP hook's
    buckets, reducers on two groups: one set of uniforms), their errors correlated."""
    domain = domain_of(transport)
    group = getattr(domain, "group_name", None)
    where = group if isinstance(group, str) else getattr(transport, "members", None)
    return key_of("rounding", int(transport.rank), where, identity)


def round_draw(rnd: int) -> int:
    """What round ``rnd`` draws its rotation and rounding under: its number modulo ROUNDS,
    as its round lanes carry it. Rounds whose lanes pair then draw alike, however far apart
    their numbers (a worker that skipped 2^40 rounds alone, in one jump or several): their
    sums add values of one rotation."""
    return rnd % ROUNDS


def skipped_to(current: int, rnd) -> int:
    """The round a reducer at round ``current`` takes next after ``skip_to(rnd)``: ``rnd``
    where it is ahead (rounds never go back: each draws its own rotation and rounding).
    Refused where it is no int, or ROUNDS or more ahead: no count of rounds jumps so far (a
    DDP hook jumps by a ``no_sync`` stretch's rounds), and the round lanes, which carry the
    round modulo ROUNDS, could not tell its peers of it (its draws pair with theirs as the
    lanes do: :func:`round_draw`)."""
    if isinstance(rnd, bool) or not isinstance(rnd, int):
        raise ValueError(f"skip_to takes an int round, got {rnd!r}")
    if rnd - current >= ROUNDS:
        raise ValueError(f"skip_to({rnd}) from round {current}: a jump of 2^40 rounds or more "
                         f"carries the round lanes of one that did not jump")
    return max(current, rnd)


def check_domain(built_on, now) -> None:
    """Raise where a reducer's rounds would pair on another group than the one it was built
    and named on (the default group replaced: destroy_process_group, then init again)."""
    if now is not built_on:
        raise RuntimeError("the process group this reducer was built on was replaced (the "
                           "default group was destroyed and made again): build a new "
                           "reducer, on every worker in the same order")


def fingerprint(params, *cut: int, backend: str = "", steps: str = "",
                nonfinite: str = "raise", reducer=0, dtype=None, shape=(),
                refused: bool = False) -> int:
    """What the workers' rounds must share for their sums to mean one thing, as a 48-bit
    value (:func:`key_of`): the codec's parameters (rotation seed, slice size, table), ``cut``, the
    numbers that cut the tensor (its length, the pipeline's piece length), the codec
    backend that decodes (the backends' estimates differ in their last bits, and workers must
    all return the same one), and ``steps``: whether a refused round still sums ("sum": a
    stream-ordered or graphed round) or stops after its MAX round ("check"), so that a
    worker of one kind never waits in a sum its peer of the other skips; and ``nonfinite``
    (:data:`NONFINITE`), so that none raises where a peer hands on NaN and goes on;
    ``reducer``: the reducer's name (:func:`identify`); the codec generator's key schedule
    (``rng.SCHEDULE``); ``dtype``: the input's, which the
    estimate is cast to (:func:`half_type`); ``shape``: the input's (:func:`shape_of`);
    ``refused``: an empty round whose input this worker refused (:func:`empty_round`)."""
    key = (params.bits, params.granularity, float(params.p), params.seed, params.slice_size,
           tuple(int(t) for t in params.table)) + tuple(int(c) for c in cut) + (backend, steps)
    key += ("schedule", rng.SCHEDULE)
    if nonfinite != "raise":
        key += (nonfinite,)
    if reducer != 0:
        key += ("reducer", reducer)
    cast = half_type(dtype)
    if cast:
        key += ("dtype", cast)
    if shape := shape_of(shape):
        key += ("shape", shape)
    if refused:
        key += ("refused",)
    return key_of(*key)


def shape_of(shape) -> tuple:
    """What a round's key holds of its input's shape: the shape where it has other than one
    dimension (a one-dimensional input's is its length, in the key already), else (). Inputs
    of one length in unlike shapes, (2, 3) and (3, 2), would sum one's rows with the other's
    columns, and each worker would read the mean back in its own shape. Never raises: a key
    made before the round goes out must not fail (its peers would wait in the round); a
    shape that cannot be read is ()."""
    try:
        shape = tuple(int(d) for d in shape)
    except Exception:  # noqa: BLE001 - see above
        return ()
    return shape if len(shape) != 1 else ()


def half_type(dtype) -> str:
    """The name of ``dtype`` where an estimate's cast to it gives other values than its cast
    to float32 (narrower types: rounded, float16 and float8 held to their range), else "":
    what a round's key holds of its input's dtype (float32 and float64 results are the same
    numbers)."""
    narrow = (isinstance(dtype, torch.dtype) and dtype.is_floating_point
              and dtype not in (torch.float32, torch.float64))
    return str(dtype) if narrow else ""


FIRST_VALUES = 8
"""Values of each parameter :func:`model_key` reads: enough to tell two initializations of
one architecture apart (a copy of a model is alike: thc.collective.ddp_base warns of it)."""


def model_key(module: torch.nn.Module, ignore=()) -> int:
    """Which model a hook serves, alike on every rank: the names, shapes, dtypes and first
    values of the parameters DDP makes alike when it wraps the model (all but ``ignore``,
    its ``parameters_to_ignore``). Two models of one architecture (twin critics) differ in
    their values alone, and hooks built in another order on each rank took each other's
    places: one model's gradients summed with the other's, on every rank, with no error."""
    parts = [(name, tuple(p.shape), str(p.dtype),
              p.detach().resolve_conj().resolve_neg().reshape(-1)[:FIRST_VALUES]
              .contiguous().view(torch.uint8).cpu().numpy().tobytes())
             for name, p in module.named_parameters() if name not in ignore]
    return key_of(*parts)


def key_of(*parts) -> int:
    """A 48-bit fingerprint (below KEY_SPAN^2) of ``parts``: numbers, strings, tuples."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=6).digest(), "big")


SUM_TAG_BITS = 48
"""The bits of a :func:`key_of` fingerprint that :func:`sum_tags` carries."""


def _sum_tag_values(key: int, world: int) -> list[int]:
    """:func:`sum_tags`'s lane values: the key cut into parts small enough that ``world`` of
    them add up exactly in float32 (below 2^24)."""
    bits = 24 - (world - 1).bit_length()
    if bits < 1:
        raise ValueError(f"{world} workers' sums of a tag lane do not fit in float32")
    lanes = -(-SUM_TAG_BITS // bits)
    key %= 1 << SUM_TAG_BITS
    return [(key >> (bits * j)) & ((1 << bits) - 1) for j in range(lanes)]


def sum_tags(key: int, world: int, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (:func:`sum_tag_lanes` lanes, float32 or wider: they must add up
    exactly) with lanes to append to a SUM all-reduce whose values carry no tag of their own
    (a DDP hook's FP32 spans): after it, :func:`sum_tags_agree` says whether every one of
    ``world`` workers sent them with the same ``key`` (:func:`key_of`), so that a worker
    whose sum paired with another collective (a peer out of step, in another bucket or step)
    refuses it. Filled on the device: a copy from the host would wait for it."""
    for lane, v in zip(out, _sum_tag_values(key, world), strict=True):
        lane.fill_(v)
    return out


def sum_tags_agree(summed: torch.Tensor, key: int, world: int) -> bool:
    """Whether the lanes of :func:`sum_tags` after the sum are ``world`` times this worker's
    own (read on the host): workers with another key leave some lane off, but for a 2^-48
    chance."""
    return summed.tolist() == [world * v for v in _sum_tag_values(key, world)]


def sum_tag_lanes(world: int) -> int:
    """How many lanes :func:`sum_tags` appends among ``world`` workers."""
    return len(_sum_tag_values(0, world))


def tagged(norms: torch.Tensor, rnd, key: int) -> torch.Tensor:
    """The MAX round's vector: the round's four lanes, the fingerprint's four, then the slice
    norms (non-finite ones marked as overflows). ``rnd``: an int, or an int64 tensor on the
    device (a graphed round's); ``key``: :func:`fingerprint`."""
    key %= KEY_SPAN * KEY_SPAN
    # filled on the device: a copy from the host would wait for it
    parts = [torch.full((1,), float(v), dtype=torch.float32, device=norms.device)
             for v in (key % KEY_SPAN, key // KEY_SPAN)]
    if isinstance(rnd, torch.Tensor):
        r = rnd.reshape(1)
        parts[:0] = [(r % ROUND_SPAN).float(), (r // ROUND_SPAN % ROUND_SPAN).float()]
    else:
        parts[:0] = [torch.full((1,), float(v), dtype=torch.float32, device=norms.device)
                     for v in (rnd % ROUND_SPAN, rnd // ROUND_SPAN % ROUND_SPAN)]
    tags = [lane for v, span in zip(parts, SPANS) for lane in (v, span - v)]
    marked = torch.nan_to_num(norms.float(), nan=OVERFLOW_MARK, posinf=OVERFLOW_MARK)
    return torch.cat(tags + [marked])


def untag(maxima: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max norms, the tag lanes) of a MAX round's result."""
    return maxima[TAG_LANES:], maxima[:TAG_LANES]


def in_step(tags: torch.Tensor) -> torch.Tensor:
    """Whether the job's workers are all in the same round with the same fingerprint, as a
    boolean on the device (as exact as check_rounds on the host): what a graphed round's
    kernel (thc.collective.round_kernels) is held to."""
    pairs = tags.double().reshape(len(SPANS), 2).sum(dim=1)
    return (pairs == torch.tensor(SPANS, dtype=torch.float64, device=tags.device)).all()


def agreed(tags) -> bool:
    """Whether the tag lanes (read on the host) say: one round, one fingerprint."""
    return all(tags[2 * i] + tags[2 * i + 1] == span for i, span in enumerate(SPANS))


def overflowed(max_norms: torch.Tensor, tags, limit: float) -> bool:
    """Whether every worker sees a round refused for overflow alone, read on the host: the
    workers in step and alike, some max norm at or beyond ``limit`` (:func:`norm_limit`; a
    worker's :data:`OVERFLOW_MARK`, or a norm too large for THC), and none a failure's
    :data:`NORM_MARK` (or NaN). The same on every worker: it reads only what they share."""
    tags = tags.tolist() if isinstance(tags, torch.Tensor) else list(tags)
    if not agreed(tags) or not max_norms.numel():
        return False
    top = float(max_norms.max())
    return limit <= top < NORM_MARK


def overflowed_on_device(max_norms: torch.Tensor, tags: torch.Tensor,
                         limit: float) -> torch.Tensor:
    """:func:`overflowed` as a boolean on the device, read nowhere: what a graphed round's
    kernel (thc.collective.round_kernels) is held to."""
    top = max_norms.max() if max_norms.numel() else max_norms.new_zeros(())
    return in_step(tags) & (top >= limit) & (top < NORM_MARK)


def refused(max_norms: torch.Tensor, tags: torch.Tensor) -> bool:
    """Whether every worker refuses the round once the MAX round's result is read on the host
    (a marked slice, workers out of step or unlike): what :func:`refuse_marked` and
    :func:`check_rounds` raise on."""
    return first_marked(max_norms) is not None or not agreed(tags.tolist())


THC_ALIKE = ("their THC parameters (bits, granularity, p, seed, slice size, table), the "
             "tensor's length, shape, dtype or piece length, their codec backend, their nonfinite "
             "mode, how a refused round ends (a graphed or stream-ordered round still sums, "
             "an eager one on Gloo stops; a graphed one with deferred checks raises its "
             "refusal a call later), or which reducer it is (the order the reducers were "
             "built in, or its name), or, in an empty tensor's round, whether a worker "
             "refused its input")
"""What a THC round's fingerprint covers, as :func:`check_rounds` names it."""


def check_rounds(tags, alike: str = THC_ALIKE) -> None:
    """Raise on every worker when the job's workers are not all in the same round, or their
    rounds differ in fingerprint (``tags``: the tag lanes, a tensor or a list; ``alike``:
    what the fingerprint covers)."""
    tags = tags.tolist() if isinstance(tags, torch.Tensor) else list(tags)
    # per part: (smallest, largest) over the workers
    lo, hi, klo, khi = [(span - tags[2 * i + 1], tags[2 * i]) for i, span in enumerate(SPANS)]
    if lo[0] != lo[1] or hi[0] != hi[1]:
        raise RuntimeError(f"the workers are in different rounds (low 20 bits {lo[0]:.0f} "
                           f"to {lo[1]:.0f}, high {hi[0]:.0f} to {hi[1]:.0f}): a worker missed "
                           f"a round (under a DDP hook, whose rounds also count the model's "
                           f"stretches under no_sync: a rank accumulated a step under no_sync "
                           f"alone, or split a stretch with a forward outside it), or loaded "
                           f"a state saved at another round than its peers', so their "
                           f"rotations differ and no sum of this round is used")
    if klo[0] != klo[1] or khi[0] != khi[1]:
        raise RuntimeError(f"the workers' rounds differ in {alike} (fingerprints "
                           f"{klo[0]:.0f}..{klo[1]:.0f}, {khi[0]:.0f}..{khi[1]:.0f}): what they "
                           f"send means different things, so no sum of this round is used")


def agree(transport, rnd: int, key: int, device) -> None:
    """The tag lanes alone in a MAX round, the same length on every worker whatever its
    tensor: raises on every worker unless all are in round ``rnd`` with fingerprint ``key``.
    A reducer runs it in the round before its MAX round, for the first round of a size (on
    Gloo for every round), so that workers whose tensors differ in slice count do not pair
    MAX rounds of different lengths (Gloo ends that by aborting a process), and as the whole
    round of an empty tensor, whose peers must not pass their round unpaired. A worker
    that fails before its lanes went out abandons the transport (:func:`owed`)."""
    try:
        vector = tagged(torch.zeros(0, device=device), rnd, key)
    except BaseException as e:
        owed(transport, rnd, "agreement", e)
        raise
    check_rounds(transport.max(vector))


def empty_round(transport, rnd: int, key: int, device, refusal: Exception | None) -> None:
    """The whole round of an empty tensor: the agreement alone. An empty round has no slice
    to mark, so ``key`` holds the worker's refusal (``fingerprint(..., refused=True)``): where
    one worker's input was refused, every worker raises, that one its own error."""
    try:
        agree(transport, rnd, key, device)
    except Exception as e:
        if refusal is not None:
            raise refusal from e   # this worker's own error, as a marked round's
        raise
    if refusal is not None:
        raise refusal


def owed(transport, rnd: int, what: str, error: BaseException) -> None:
    """This worker failed before round ``rnd``'s ``what`` went out, its peers waiting in it:
    its next round would pair with theirs (round numbers a round apart, every later round
    refused; or, where a round number was not yet taken, a sum of two rounds). The transport
    is abandoned, so that none of its later rounds goes out, named by ``error``."""
    abandon = getattr(transport, "abandon", None)
    if callable(abandon):
        abandon(f"round {rnd} failed before its {what} went out "
                f"({type(error).__name__}: {error})")


def together(group, rnd: int, key: int, device, failure: Exception | None = None,
             alike: str = "the scheme's settings, the tensor's length, shape or segments, or "
                          "which reducer it is") -> int:
    """For schemes whose collectives carry no tag lanes (TopK's all-gathers, Marsit's scales
    and ring): the tag lanes and a mark lane in one fixed-length MAX all-reduce before
    them. A worker that failed first (``failure``), is out of step or unlike makes every
    worker raise here, instead of leaving its peers waiting in a collective or pairing theirs
    with its next call's. A ``failure`` that is the input's overflow (:class:`NonFiniteInput`)
    sends :data:`OVERFLOW_MARK`: then, and only when no worker failed otherwise and all are
    in step, every worker raises :class:`NonFiniteInput`, which a scheme that hands
    overflows on turns into NaN. Returns the bytes a ring all-reduce sends for it."""
    try:
        DistTransport.check_group(group)   # a round left its peers mid-round: no collective
    except RuntimeError as e:
        raise e from failure   # this worker's own error stays in the chain
    overflow = isinstance(failure, NonFiniteInput)
    mark = OVERFLOW_MARK if overflow else NORM_MARK if failure is not None else 0.0
    try:
        out = tagged(torch.full((1,), mark, device=device), rnd, key)
    except BaseException as e:
        DistTransport.abandon_group(group, f"round {rnd} failed before its agreement went "
                                           f"out ({type(e).__name__}: {e})")
        raise
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    marked, tags = untag(out)
    top = float(marked[0])
    # decided from what every worker shares alone, so that all decide alike
    if not top < NORM_MARK:
        if failure is not None and not overflow:
            raise failure
        raise RuntimeError("a worker failed before this round's collectives (its own error "
                           "says why): the round is refused on every worker") from failure
    try:
        check_rounds(tags, alike)
    except RuntimeError as e:
        raise e from failure
    if top == OVERFLOW_MARK:
        if failure is not None:
            raise failure
        raise NonFiniteInput("a worker's input holds NaN or Inf: the round is refused on "
                             "every worker" + PROPAGATE_HINT)
    return together_bytes(dist.get_world_size(group))


def together_bytes(world: int) -> int:
    """What one :func:`together` sends, as a ring all-reduce of its lanes among ``world``."""
    return ring_bytes(torch.zeros(TAG_LANES + 1), world)


def marks(y: torch.Tensor, pieces, layout_of, limit: float,
          overflow: bool = True) -> torch.Tensor:
    """The norms a worker that could not compute its own sends. Where its error was the
    input's overflow (``overflow``): :data:`OVERFLOW_MARK` for each slice holding NaN or Inf
    or whose norm (as float32) is not below ``limit`` (``norm_limit``), 0 (no say)
    elsewhere. Every slice is marked :data:`NORM_MARK` where the worker failed for another
    reason (so no slice of its may be summed, and its error is not mistaken for an overflow
    however its input looks), where no slice is bad, or where even this fails."""
    n = sum(layout_of(b - a).n_slices for a, b in pieces)
    failure = torch.full((n,), NORM_MARK, dtype=torch.float32, device=y.device)
    if not overflow:
        return failure
    try:
        out = []
        for a, b in pieces:
            lay = layout_of(b - a)
            for start, length in zip(lay.starts, lay.lengths):
                seg = y[a + start: a + start + length]
                # NaN or Inf in the slice makes its norm NaN or Inf: not below the limit
                norm = torch.linalg.vector_norm(seg, dtype=torch.float64).float()
                bad = not bool(norm < limit)
                out.append(OVERFLOW_MARK if bad else 0.0)
        if OVERFLOW_MARK in out:
            return torch.tensor(out, dtype=torch.float32).to(y.device)
    except Exception:  # noqa: BLE001, S110 - a worker out of memory still owes its peers
        pass
    return failure


def first_marked(values: torch.Tensor) -> int | None:
    """The first slice whose value is a mark (either) or NaN, if any (reads the device)."""
    hit = (~(values < OVERFLOW_MARK)).nonzero()
    return int(hit[0]) if hit.numel() else None


def refuse_marked(norms: torch.Tensor, max_norms: torch.Tensor, params,
                  hint: bool = True) -> None:
    """Raise, on the host, if this worker's or any worker's slice is marked: this worker's
    own input first. ``hint``: name the way to hand an overflow on (:data:`PROPAGATE_HINT`)."""
    more = PROPAGATE_HINT if hint else ""
    own = first_marked(norms)
    if own is not None:
        raise NonFiniteInput(BAD_INPUT_TEXT.format(limit=norm_limit(params)) + f", in slice {own}"
                             + more)
    other = first_marked(max_norms)
    if other is not None:
        if bool(torch.isnan(max_norms[other])):
            raise ValueError(f"slice {other}'s max norm is NaN, which no worker sends: a peer "
                             f"or the aggregator is broken, and the round is refused")
        if float(max_norms[other]) == OVERFLOW_MARK:
            raise NonFiniteInput(f"slice {other}'s max norm is the mark of a worker whose input "
                                 f"holds NaN or Inf there (or a slice norm beyond "
                                 f"{norm_limit(params):.3g}): the round is refused" + more)
        raise ValueError(f"slice {other}'s max norm is the mark of a worker that failed "
                         f"before its sums (a wrong dtype or layer positions, or an error "
                         f"of its own, which it raises): the round is refused")


PROPAGATE_HINT = ("; with torch.amp.GradScaler, build every worker's reducer with "
                  "nonfinite='propagate': such a round then gives NaN, and the scaler skips "
                  "the step")
"""What a refusal for NaN or Inf input adds: the way to hand it on instead."""
