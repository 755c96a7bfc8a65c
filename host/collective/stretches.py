"""The DDP model's stretches of forwards under ``no_sync`` that a backward ran through, or
that a gradient accumulated in while the model was in ``no_sync``: what a bucket's rounds
count (:meth:`thc.collective.ddp_base.BaseHook.reduce`'s ``stretches``).

Why: a rank that accumulated a step under ``no_sync`` alone keeps every reducer's own round
count in step with its peers' while its sums hold two steps' gradients and theirs one; its
stretches tell. Not its forwards: ranks may run unlike numbers of them before a backward
(rollouts of unlike length, a probe loss), and DDP sums that; nor a stretch of forwards alone
(an evaluation under ``no_sync``), which adds no gradient.
"""
from __future__ import annotations

import threading
from dataclasses import fields, is_dataclass

import torch
from torch.autograd.graph import register_multi_grad_hook


def tensors_in(output) -> list[torch.Tensor] | None:
    """The tensors of a forward's output (nested lists, tuples, dicts, dataclasses); None
    where it holds an object of another kind, which may hold tensors unseen."""
    if isinstance(output, torch.Tensor):
        return [output]
    if output is None or isinstance(output, (str, bytes, int, float, bool)):
        return []
    if isinstance(output, dict):
        items = list(output.values())
    elif isinstance(output, (list, tuple)):
        items = list(output)
    elif is_dataclass(output) and not isinstance(output, type):
        items = [getattr(output, f.name) for f in fields(output)]
    else:
        return None
    found: list[torch.Tensor] = []
    for item in items:
        inner = tensors_in(item)
        if inner is None:
            return None
        found += inner
    return found


class StretchCount:
    """Counts the stretches from a DDP model's forward hooks and its parameters' gradients.
    DDP sets ``require_backward_grad_sync`` false inside ``no_sync`` (no public call says
    whether a forward is in one)."""

    def __init__(self):
        self.count = 0
        """Stretches a backward ran through, since the hooks were registered."""
        self._synced = True
        """Whether the last forward with autograd on would sync its backward."""
        self._stretch = 0
        """Stretches begun: forwards under ``no_sync`` after a synced one (or none) begin one."""
        self._counted = 0
        """The last begun stretch counted (a backward ran through it)."""
        self._open = False
        """Whether a forward of the current stretch returned what :func:`tensors_in` cannot
        see into: its stretch counts at the next gradient accumulated, as if a backward ran
        through it."""
        self._lock = threading.Lock()

    def forward(self, module) -> None:
        """A forward is about to run (a forward pre-hook)."""
        if torch.is_grad_enabled():
            synced = getattr(module, "require_backward_grad_sync", True)
            with self._lock:
                if not synced and self._synced:
                    self._stretch += 1
                    self._open = False
                self._synced = synced

    def output(self, module, output) -> None:
        """A forward returned (a forward hook): a backward through the outputs of a forward
        under ``no_sync`` counts its stretch, once. Not the forward itself: a forward whose
        output no backward runs through (a probe, an evaluation with autograd on) adds no
        gradient, and DDP syncs the next synced forward's backward as usual."""
        if not torch.is_grad_enabled() or getattr(module, "require_backward_grad_sync", True):
            return
        tensors = tensors_in(output)
        with self._lock:
            stretch = self._stretch
            if tensors is None:
                self._open = True
                return
        needs = [t for t in tensors if t.requires_grad]
        if needs:
            register_multi_grad_hook(needs, lambda _grad: self._ran_through(stretch),
                                     mode="any")

    def gradient(self, synced: bool = True) -> None:
        """A gradient accumulated (autograd's threads). ``synced`` false: the DDP model was in
        ``no_sync`` as it did, and the stretch counts, once; begun here where no forward of
        the model began one (a backward of ``ddp.module``'s output, or of a loss a forward
        kept aside, which runs through no output the model returned). Else a stretch whose
        outputs could not be seen counts, once."""
        if synced and not self._open:
            return
        with self._lock:
            if not synced:
                if self._synced:
                    self._stretch += 1
                    self._synced = False
                    self._open = False
                self._count(self._stretch)
            elif self._open and not self._synced:
                self._open = False
                self._count(self._stretch)

    def _ran_through(self, stretch: int) -> None:
        with self._lock:
            self._count(stretch)

    def _count(self, stretch: int) -> None:
        """Under the lock."""
        if self._counted < stretch:
            self._counted = stretch
            self.count += 1
