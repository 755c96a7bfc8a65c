"""What the workers of a THC all-reduce round must agree on before any of them trusts its
sums, and how a worker that cannot go on lets its peers end the round with an error instead of
a wait.

- A worker whose gradient holds NaN or Inf still sends its MAX round, its bad slices' norms
  replaced by :data:`NORM_MARK` (above any real norm): every worker refuses those slices.
- The round number travels beside the norms as two more MAX lanes, ``r`` and
  ``ROUND_SPAN - r``: their maxima give every worker the largest and the smallest round
  number of the job, which differ only when some worker missed a round.
- On a stream-ordered transport (NCCL) the peers do not read the max norms before the sum, so
  a worker that stops between the MAX round and the sum first joins the sum with zeros, but
  only where a mark makes every peer refuse that sum anyway.
"""
from __future__ import annotations

import torch

from thc.codec.common import NORM_MARK

ROUND_SPAN = 1 << 20
"""Round numbers travel modulo this (exact in float32)."""


def tagged(norms: torch.Tensor, rnd) -> torch.Tensor:
    """The MAX round's vector: the slice norms (non-finite ones marked) and the round's two
    lanes. ``rnd``: an int, or an int64 tensor on the device (a graphed round's)."""
    if isinstance(rnd, torch.Tensor):
        r = (rnd.reshape(1) % ROUND_SPAN).float()
        tags = [r, ROUND_SPAN - r]
    else:
        r = float(rnd % ROUND_SPAN)
        # filled on the device: a copy from the host would wait for it
        tags = [torch.full((1,), v, dtype=torch.float32, device=norms.device)
                for v in (r, ROUND_SPAN - r)]
    marked = torch.nan_to_num(norms.float(), nan=NORM_MARK, posinf=NORM_MARK)
    return torch.cat([marked] + tags)


def untag(maxima: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max norms, the two round lanes) of a MAX round's result."""
    return maxima[:-2], maxima[-2:]


def in_step(tags: torch.Tensor) -> torch.Tensor:
    """Whether the job's workers are all in the same round, as a boolean on the device."""
    return tags.double().sum() == ROUND_SPAN   # as exact as check_rounds on the host


def refused(max_norms: torch.Tensor, tags: torch.Tensor) -> bool:
    """Whether every worker refuses the round once the MAX round's result is read on the host
    (a marked slice, or workers out of step): what :func:`refuse_marked` and
    :func:`check_rounds` raise on."""
    high, low = tags.tolist()
    return first_marked(max_norms) is not None or high + low != ROUND_SPAN


def check_rounds(tags) -> None:
    """Raise on every worker when the job's workers are not all in the same round
    (``tags``: the two round lanes, a tensor or a list)."""
    high, low = tags.tolist() if isinstance(tags, torch.Tensor) else tags
    if high + low != ROUND_SPAN:
        raise RuntimeError(f"the workers are in different rounds ({ROUND_SPAN - low:g} to "
                           f"{high:g}, modulo {ROUND_SPAN}): a worker missed a round, so "
                           f"their rotations differ and no sum of this round is used")


def marks(y: torch.Tensor, pieces, layout_of) -> torch.Tensor:
    """The norms a worker that could not compute its own sends: :data:`NORM_MARK` for each
    slice holding NaN or Inf, 0 (no say) elsewhere; every slice marked where none does (the
    worker failed for another reason, so no slice of its may be summed) or even this fails."""
    n = sum(layout_of(b - a).n_slices for a, b in pieces)
    try:
        out = []
        for a, b in pieces:
            lay = layout_of(b - a)
            for start, length in zip(lay.starts, lay.lengths):
                bad = not bool(torch.isfinite(y[a + start: a + start + length]).all())
                out.append(NORM_MARK if bad else 0.0)
        if NORM_MARK in out:
            return torch.tensor(out, dtype=torch.float32).to(y.device)
    except Exception:  # noqa: BLE001, S110 - a worker out of memory still owes its peers
        pass
    return torch.full((n,), NORM_MARK, dtype=torch.float32, device=y.device)


def first_marked(values: torch.Tensor) -> int | None:
    """The first slice whose value is a mark (or NaN), if any (reads the device)."""
    hit = (~(values < NORM_MARK)).nonzero()
    return int(hit[0]) if hit.numel() else None


def refuse_marked(norms: torch.Tensor, max_norms: torch.Tensor) -> None:
    """Raise, on the host, if this worker's or any worker's slice is marked: this worker's
    own input first."""
    own = first_marked(norms)
    if own is not None:
        raise ValueError(f"input contains NaN or Inf (or values whose squares overflow "
                         f"float32) in slice {own}")
    other = first_marked(max_norms)
    if other is not None:
        raise ValueError(f"slice {other}'s max norm is the mark of a worker whose input holds "
                         f"NaN or Inf there: the round is refused")
