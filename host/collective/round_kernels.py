"""A graphed round's own steps on the device (thc.collective.graphed), as Triton kernels: the
MAX round's vector before it, the round's verdict after the decode, and the error-feedback
residual kept where the round was clean. Why: as small torch operations they were
thirty-four launches a round (two more with error feedback), each a node of the graph whose
latency, not bytes, is a small bucket's time (docs/results.md). Each kernel computes what
the torch steps it stands for compute (thc.collective.agreement's, a ``torch.where``), bit
for bit: a graphed worker and an eager one may be peers (unless the graphed one defers its
checks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from thc.codec.common import NORM_MARK, OVERFLOW_MARK, STATUS_WORDS
from thc.collective.agreement import KEY_SPAN, ROUND_SPAN, ROUNDS, TAG_LANES

BLOCK = 1024
_RSPAN, _KSPAN = tl.constexpr(ROUND_SPAN), tl.constexpr(KEY_SPAN)
_ROUNDS = tl.constexpr(ROUNDS)
_LANES, _WORDS = tl.constexpr(TAG_LANES), tl.constexpr(STATUS_WORDS)
_OVERFLOW, _MARK = tl.constexpr(OVERFLOW_MARK), tl.constexpr(NORM_MARK)


@triton.jit
def _pairs(v0, v1, v2, v3, j):
    """Lane ``j`` of the four tag pairs: value, then span - value."""
    part = j // 2
    v = tl.where(part == 0, v0, tl.where(part == 1, v1, tl.where(part == 2, v2, v3)))
    span = tl.where(part < 2, _RSPAN, _KSPAN).to(tl.float32)
    return tl.where(j % 2 == 0, v, span - v)


@triton.jit(do_not_specialize=["n", "key_lo", "key_hi"])
def _tagged(NORMS, ROUND, OUT, n, key_lo, key_hi, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(NORMS + i, mask=i < n, other=0.0)
    v = tl.where((v != v) | (v == float("inf")), _OVERFLOW,
                 tl.where(v == -float("inf"), -3.4028234663852886e38, v))
    tl.store(OUT + _LANES + i, v, mask=i < n)
    if tl.program_id(0) == 0:
        r = tl.load(ROUND)
        j = tl.arange(0, _LANES)
        lanes = _pairs((r % _RSPAN).to(tl.float32), (r // _RSPAN % _RSPAN).to(tl.float32),
                       key_lo.to(tl.float32), key_hi.to(tl.float32), j)
        tl.store(OUT + j, lanes)


@triton.jit(do_not_specialize=["n"])
def _settle(WORD, MAXIMA, n, CLEAN, OVERFLOW, REPORT, ROUND, limit, BLOCK: tl.constexpr):
    k = tl.arange(0, _LANES // 2)
    pair = tl.load(MAXIMA + 2 * k).to(tl.float64) + tl.load(MAXIMA + 2 * k + 1).to(tl.float64)
    span = tl.where(k < 2, _RSPAN, _KSPAN).to(tl.float64)
    in_step = tl.min((pair == span).to(tl.int32), 0) == 1
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    nan = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        v = tl.load(MAXIMA + _LANES + i, mask=i < n, other=float("-inf"))
        nan |= (v != v).to(tl.int32)
        top = tl.maximum(top, tl.where(v != v, float("-inf"), v))
    m = tl.max(top, 0)
    # as torch's max: a NaN anywhere is the max, and compares false
    over = in_step & (tl.max(nan, 0) == 0) & (m >= limit) & (m < _MARK)
    w = tl.arange(0, 8)
    word = tl.load(WORD + w, mask=w < _WORDS, other=0)
    clean = (tl.sum(tl.where(w == 0, word, 0), 0) == 0) & in_step
    tl.store(CLEAN, clean.to(tl.uint8))
    tl.store(OVERFLOW, over.to(tl.uint8))
    tl.store(REPORT + w, word.to(tl.float64), mask=w < _WORDS)
    j = tl.arange(0, _LANES)
    tl.store(REPORT + _WORDS + j, tl.load(MAXIMA + j).to(tl.float64))
    tl.store(REPORT + _WORDS + _LANES, over.to(tl.float64))
    tl.store(ROUND, (tl.load(ROUND) + 1) % _ROUNDS)   # agreement.round_draw


@triton.jit
def _keep(Y, OWN, CLEAN, RES, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = i < n * (tl.load(CLEAN) != 0).to(tl.int32)   # nothing where the round was not clean
    y = tl.load(Y + i, mask=keep, other=0.0)
    own = tl.load(OWN + i, mask=keep, other=0.0)
    tl.store(RES + i, y - own, mask=keep)


def tagged(norms: torch.Tensor, rnd: torch.Tensor, key: int) -> torch.Tensor:
    """agreement.tagged of float32 ``norms`` and the int64 round ``rnd`` on the device."""
    key %= KEY_SPAN * KEY_SPAN
    n = norms.numel()
    out = torch.empty(TAG_LANES + n, dtype=torch.float32, device=norms.device)
    _tagged[(max(1, triton.cdiv(n, BLOCK)),)](norms, rnd, out, n, key % KEY_SPAN,
                                              key // KEY_SPAN, BLOCK=BLOCK)
    return out


def settle(word, maxima, clean, overflow, report, rnd, limit: float) -> None:
    """The round's verdict from its status ``word`` and the MAX round's ``maxima`` (tag lanes,
    then max norms): ``clean`` (no flag, workers in step: agreement.in_step), ``overflow``
    (agreement.overflowed_on_device), the ``report`` the host reads (status words, tag
    lanes, overflow), and the round ``rnd`` moved on by one (modulo 2^40, as
    agreement.round_draw draws). ``clean`` and ``overflow``:
    bool tensors of one element."""
    _settle[(1,)](word, maxima, maxima.numel() - TAG_LANES, clean.view(torch.uint8),
                  overflow.view(torch.uint8), report, rnd, limit, BLOCK=BLOCK)


def keep_residual(y, own, clean, residual) -> None:
    """Error feedback's residual, ``y - own`` (float32: the round's input less this worker's
    own decode), where the round was ``clean`` (a bool tensor of one element); else left as
    it was: torch.where(clean, y - own, residual, out=residual) in one launch."""
    n = y.numel()
    _keep[(triton.cdiv(n, BLOCK),)](y, own, clean.view(torch.uint8), residual, n, BLOCK=BLOCK)
