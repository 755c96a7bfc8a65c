"""What a reducer carries from one round to the next, saved and restored: its round count and
its error-feedback residual. A training job restarted from a checkpoint without them starts
every residual at zero and every round count at 0, and goes on unlike the run it resumes (the
residual holds up to a few steps' rounding error); with them, it goes on as that run would.

Every worker saves and loads its own state. The round count is part of each round's
agreement, so workers that loaded unlike states (one restored, one not) refuse their first
round instead of summing different rounds' rotations.
"""
from __future__ import annotations

import torch


def state(rnd: int, residual: torch.Tensor | None) -> dict:
    """A reducer's state: its next round and a copy of its residual (None: none yet, or no
    error feedback)."""
    return {"round": int(rnd),
            "residual": None if residual is None else residual.detach().clone()}


def loaded(saved: dict, rnd: int, feedback: bool, what: str) -> tuple[int, torch.Tensor | None]:
    """The round and residual of ``saved`` (a :func:`state`), for a reducer ``what`` whose next
    round is ``rnd`` and that keeps a residual where ``feedback``: refused unless the reducer
    has taken no round, and unless the state is one it can take."""
    if rnd != 0:
        raise ValueError(f"{what}: a state is loaded before the first round (this reducer "
                         f"has taken {rnd})")
    if not isinstance(saved, dict) or set(saved) != {"round", "residual"}:
        raise ValueError(f"{what}: not a reducer's state (a dict of round and residual, as "
                         f"state_dict() gives), got {type(saved).__name__}")
    r, residual = saved["round"], saved["residual"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"{what}: the state's round must be an int, 0 or more, got {r!r}")
    if residual is not None:
        if not feedback:
            raise ValueError(f"{what}: the state holds an error-feedback residual, and this "
                             f"reducer keeps none (built without error feedback)")
        if not isinstance(residual, torch.Tensor) or residual.dim() != 1 \
                or not residual.is_floating_point():
            raise ValueError(f"{what}: the state's residual must be a 1-D floating-point "
                             f"tensor, got {type(residual).__name__}")
        residual = residual.clone()
    return r, residual


def named(key: tuple, names: dict[int, str]) -> tuple:
    """A DDP hook's bucket key (its parameters' ids, its compressed length) as the
    parameters' names: ids are this process's alone."""
    ids, numel = key
    return tuple(names.get(i, "?") for i in ids), numel
