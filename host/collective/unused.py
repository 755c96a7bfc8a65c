"""Parameters a step leaves unused, where DDP may (``find_unused_parameters``,
``static_graph``): which of a bucket's compressed parameters this rank used, and what a
parameter no rank used gets back.

Why: DDP leaves a parameter no rank used as it was, or applies what the bucket holds (a
joined rank's shadow step; a gradient that is the bucket's view); a compressing hook that
took its estimate off the residual as if applied lost that mass. :class:`UseCount` counts a
use as DDP does (a gradient held after it accumulated, since the bucket's last reduction);
the hook sums one lane per compressed parameter across the ranks, and puts back the span and
residual of a parameter no rank used (:func:`give_back`).
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch


class UseCount:
    """The parameters a gradient accumulated into since their bucket's last reduction, of
    those it watches. One frozen since the hook was registered is not watched yet (autograd
    takes no hook on it) and counts as unused: a frozen parameter takes no gradient."""

    def __init__(self, on_gradient: Callable):
        self._on_gradient = on_gradient
        self.handles: list = []
        self._accumulated: set[int] = set()
        self._watched: set[int] = set()
        self._frozen: list = []

    def watch_all(self, params) -> None:
        """Watch every parameter that needs a gradient now; the others from the first
        :meth:`watch_unfrozen` after they need one."""
        for p in params:
            if p.requires_grad:
                self._watch(p)
            else:
                self._frozen.append(weakref.ref(p))

    def watch_unfrozen(self) -> None:
        """Called before each forward: start watching a frozen parameter that needs a
        gradient now."""
        for ref in list(self._frozen):
            if (p := ref()) is None or p.requires_grad:
                self._frozen.remove(ref)
                if p is not None:
                    self._watch(p)

    def _watch(self, p: torch.Tensor) -> None:
        """A gradient ``p`` holds already (a backward outside DDP's forward, which DDP
        counts) counts as accumulated."""
        self.handles.append(p.register_post_accumulate_grad_hook(self._on_gradient))
        self._watched.add(id(p))
        if p.grad is not None:
            self._accumulated.add(id(p))

    def saw(self, param: torch.Tensor) -> None:
        """A post-accumulate hook ran: it runs for an undefined gradient too, and DDP counts
        a parameter used only where it holds one."""
        if param.grad is not None:
            self._accumulated.add(id(param))

    def take(self, ids: tuple[int, ...], counting: bool) -> tuple[bool, ...] | None:
        """Per parameter of a bucket (by id), whether it is idle here (None: not
        ``counting``); its count starts again."""
        frozen = {id(p) for ref in self._frozen if (p := ref()) is not None} if counting else ()
        idle = tuple(i in frozen or (i in self._watched and i not in self._accumulated)
                     for i in ids) if counting else None
        self._accumulated.difference_update(ids)
        return idle


def used_here(comp: list[torch.Tensor], idle: list[bool]) -> torch.Tensor:
    """Per compressed span, 1 where its parameter is not idle or the span is not all zeros,
    on the device. The span's test keeps the replicas alike whatever the count misses: a
    span given back is then zeros on every rank. What it costs: a gradient left from an
    earlier synced step (no ``zero_grad``) counts as a use, and loses its estimate's mass
    from the residual where DDP applies nothing."""
    one = torch.ones((), dtype=torch.bool, device=comp[0].device)
    return torch.stack([v.ne(0).any() if was else one for v, was in zip(comp, idle)])


def keep(names: list[str], idle: list[bool], comp: list[torch.Tensor],
         residual_of: Callable) -> dict[str, tuple]:
    """Copies of the idle parameters' spans and residuals (None: none kept yet), taken
    before their round. ``residual_of(name)``: the residual the hook keeps, or None."""
    out = {}
    for name, was, view in zip(names, idle, comp):
        if was:
            have = residual_of(name)
            out[name] = (view.clone(), None if have is None else have.clone())
    return out


def give_back(names: list[str], kept: dict, used: list[bool], comp: list[torch.Tensor],
              residual_of: Callable) -> None:
    """A parameter no rank used gets its span and its residual as they were before the
    round, so that no mass is lost or counted twice whether DDP applies the bucket to it or
    not (the estimate, counted as applied, had been taken off the residual)."""
    for name, is_used, view in zip(names, used, comp):
        if is_used or name not in kept:
            continue
        span, residual = kept[name]
        view.copy_(span)
        live = residual_of(name)
        if live is not None and residual is not None:
            live.copy_(residual)
        elif live is not None:
            live.zero_()
