"""What a reducer carries from one round to the next, saved and restored. A training job
restarted from a checkpoint without it starts every error-feedback residual at zero, and
loses what they held (the error of the last rounds; for TopK, the coordinates not sent).

A reducer's state is its round count and its residual (a Marsit reducer's, its coins' state
too): a reducer restored from it goes on bit for bit as the one saved (given the same rounding
key). Every worker saves and loads its own: a residual is the rounding error of one rank's
rounds of one reducer, so a state names its owner (its rank in its group, the group's
members and the reducer's given name) and is refused by another (another rank's residual,
added to this rank's gradient, would sum to another mean on every rank alike). Reducers
named only by their build order, or given one name twice, are not told apart: name them
apart to have one's state refused by another. The round count is part of each round's
agreement, so workers that loaded unlike states (one restored, one not) refuse their first
round instead of summing different rounds' rotations.

A DDP hook's state is a residual per parameter, by name: DDP buckets its first iteration
apart from the later ones, and a hook built anew (another bucket size, other uncompressed
parameters) buckets them apart again. Each bucket's reducer, when built, takes its
parameters' residuals (from the loaded state, or from the reducers of the buckets DDP rebuilt)
and starts at round 0 on every rank, so a resumed run keeps the residuals' error but draws new
rotations: statistically, not bitwise, the run it resumes.
"""
from __future__ import annotations

import torch

from thc.codec.common import NonFiniteInput, norm_limit
from thc.codec.params import THCParams
from thc.codec.thc import slice_norms
from thc.collective import agreement


def owner(rank: int, world: int, members, identity=None) -> dict:
    """Whose state: rank ``rank`` of a group of ``world`` whose ``members`` are its global
    ranks (or an aggregator job's id: :func:`thc.collective.transports.members`), and the
    name the reducer was given, as its repr (from its :func:`thc.collective.agreement.
    identify` identity; None for a DDP hook's state or a reducer named by its build order)."""
    given = agreement.given_name(identity)
    return {"rank": int(rank), "world": int(world), "group": tuple(members),
            "reducer": None if given is None else repr(given)}


def state(rnd: int, residual: torch.Tensor | None, own: dict) -> dict:
    """A reducer's state: its next round, a copy of its residual (None: none yet, or no
    error feedback) and its :func:`owner`."""
    return {"round": int(rnd),
            "residual": None if residual is None else residual.detach().clone(),
            "owner": None if own is None else dict(own)}


def check_owner(saved: dict, own: dict, what: str) -> None:
    """Refuses a state that another rank, group or reducer saved, or that names none."""
    theirs = _as_owner(saved.get("owner"))
    if theirs is None:
        raise ValueError(f"{what}: the state names no owner (the rank, group and reducer that "
                         f"saved it, as state_dict() gives), got {saved.get('owner')!r:.80}: "
                         f"a residual is one rank's own and is not loaded unchecked")
    if theirs != own:
        raise ValueError(f"{what}: the state was saved by {_who(theirs)}, and this is "
                         f"{_who(own)}: a residual is the rounding error of the rank and "
                         f"reducer that kept it, so each rank loads the state it saved (to "
                         f"start afresh, load none)")


def _as_owner(o) -> dict | None:
    """``o`` as an :func:`owner` (its group a tuple), or None where it is not one."""
    if not isinstance(o, dict) or set(o) != {"rank", "world", "group", "reducer"}:
        return None
    group = o["group"]
    if type(o["rank"]) is not int or type(o["world"]) is not int \
            or not isinstance(group, (tuple, list)) \
            or not all(type(m) in (int, str) for m in group) \
            or not (o["reducer"] is None or isinstance(o["reducer"], str)):
        return None
    return {**o, "group": tuple(group)}


def _who(own: dict) -> str:
    reducer = own["reducer"]
    return (f"rank {own['rank']} of {own['world']} in group {own['group']}"
            + ("" if reducer is None else f" (reducer {reducer})"))


def loaded(saved: dict, rnd: int, feedback: bool, what: str,
           own: dict) -> tuple[int, torch.Tensor | None]:
    """The round and residual of ``saved`` (a :func:`state`), for a reducer ``what`` whose next
    round is ``rnd``, that keeps a residual where ``feedback`` and whose :func:`owner` is
    ``own``: refused unless the reducer has taken no round, and unless the state is its own
    and one it can take."""
    if rnd != 0:
        raise ValueError(f"{what}: a state is loaded before the first round (this reducer "
                         f"has taken {rnd})")
    if not isinstance(saved, dict) or not {"round", "residual"} <= set(saved):
        raise ValueError(f"{what}: not a reducer's state (a dict of round and residual, as "
                         f"state_dict() gives), got {type(saved).__name__}")
    check_owner(saved, own, what)
    r, residual = saved["round"], saved["residual"]
    # any count: past 2^40 (a DDP hook jumps 2^20 a no_sync stretch) a round draws as its
    # number modulo 2^40 does (agreement.round_draw), which is all a device keeps of it
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"{what}: the state's round must be a non-negative int, got {r!r}")
    if residual is not None:
        if not feedback:
            raise ValueError(f"{what}: the state holds an error-feedback residual, and this "
                             f"reducer keeps none (built without error feedback)")
        if not isinstance(residual, torch.Tensor) or residual.dim() != 1 \
                or not residual.is_floating_point():
            raise ValueError(f"{what}: the state's residual must be a 1-D floating-point "
                             f"tensor, got {type(residual).__name__}")
        _finite(residual, what)
        residual = residual.clone()
    return r, residual


def elements(saved: dict, residual: torch.Tensor | None, what: str) -> int | None:
    """The length of the tensor whose residual ``saved`` holds (a graphed reducer's is padded
    past it), checked; None where the state does not say."""
    n = saved.get("elements") if residual is not None else None
    if n is not None and (type(n) is not int or not 0 <= n <= residual.numel()):
        raise ValueError(f"{what}: the state's elements (its tensor's length) must be an int "
                         f"up to its residual's {residual.numel()}, got {n!r:.80}")
    return n


def joined(residuals: dict, layout: list[tuple[str, int]], device) -> torch.Tensor | None:
    """A bucket's residual from its parameters' (zeros for one that has none, or one of
    another length); None where none of them has one."""
    if not any(name in residuals for name, _ in layout):
        return None
    parts = [residuals[name].to(device, torch.float32)
             if name in residuals and residuals[name].numel() == n else
             torch.zeros(n, device=device) for name, n in layout]
    return torch.cat(parts)


def residuals_of(state: dict, what: str) -> dict:
    """The per-parameter residuals of a DDP hook's state, checked."""
    residuals = state.get("residuals") if isinstance(state, dict) else None
    if not isinstance(residuals, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) and v.dim() == 1
            and v.is_floating_point() for k, v in residuals.items()):
        raise ValueError(f"a {what}'s state holds a 1-D floating-point residual per "
                         f"parameter name (its state_dict())")
    for name, residual in residuals.items():
        _finite(residual, f"a {what}'s residual of {name}")
    return {k: v.detach().clone() for k, v in residuals.items()}


def _finite(residual: torch.Tensor, what: str) -> None:
    """A residual with NaN or Inf would make every later round of its reducer refused, or NaN
    under ``nonfinite="propagate"`` (a scaler then skips every step), blamed on the input.
    Checked as float32, the dtype it is taken in: a float64 1e300 is Inf there."""
    if not bool(torch.isfinite(residual.to(torch.float32)).all()):
        raise ValueError(f"{what}: the state's residual holds NaN or Inf, as float32 (a saved "
                         f"run's overflow, or a damaged checkpoint): it is not loaded")


def within_codec(residual: torch.Tensor | None, params: THCParams, what: str) -> None:
    """A THC residual whose slice norm is past the codec's limit would make every later round
    of its reducer refused, or NaN under "propagate", blamed on the input: no round keeps
    one, so the state is damaged or another codec's."""
    if residual is None or not residual.numel():
        return
    try:
        slice_norms(residual.detach(), params, "reference")   # the codec's own check
    except NonFiniteInput:
        raise ValueError(f"{what}: the state's residual holds a slice norm past the codec's "
                         f"limit of {norm_limit(params):.3g} (a damaged checkpoint, or one of "
                         f"other codec settings): it is not loaded") from None


def within(residual: torch.Tensor | None, limit: float, what: str) -> None:
    """A residual with a magnitude past ``limit``, which no round keeps (see
    :func:`within_codec`)."""
    if residual is not None and residual.numel() and float(residual.abs().max()) > limit:
        raise ValueError(f"{what}: the state's residual holds a magnitude of "
                         f"{float(residual.abs().max()):.3g}, past the {limit:.3g} a round "
                         f"keeps (a damaged checkpoint): it is not loaded")
