"""Where a DDP hook's error-feedback residual of each compressed parameter lives: in the
reducer of the bucket that holds the parameter, or carried from a loaded state until a
bucket's reducer takes it.

Why per parameter: DDP buckets its first iteration apart from the later ones, and a hook
built anew (another bucket size, other uncompressed parameters) buckets them apart again; a
residual keyed by bucket would move to other parameters (:mod:`thc.collective.checkpoint`).
"""
from __future__ import annotations

from typing import Callable

import torch

from thc.collective import checkpoint


class ParamResiduals:
    """Each compressed parameter's place in its bucket's residual, and the residuals a load
    carries. ``residual_of((bucket, length))``: the residual that bucket's reducer keeps (not a
    copy), None where it keeps none."""

    def __init__(self, compressed: dict[str, int], residual_of: Callable):
        self.compressed = compressed
        """The length of each parameter the hook compresses, by name: what a loaded residual
        may be the residual of."""
        self._residual_of = residual_of
        self.layouts: dict[tuple, list[tuple[str, int]]] = {}
        """Per bucket, its compressed parameters' names and lengths, in order."""
        self.layout_names: dict[tuple, frozenset] = {}
        self.offsets: dict[tuple, dict[str, tuple[int, int, int]]] = {}
        """Per bucket, each compressed parameter's offset and length in its residual, and the
        residual's length."""
        self.owner: dict[str, tuple] = {}
        """Per compressed parameter, the bucket whose reducer keeps its residual."""
        self.carried: dict[str, torch.Tensor] = {}
        """Per parameter name, a residual :meth:`load` took that no bucket's reducer has
        taken yet."""

    def lay_out(self, bucket, layout: list[tuple[str, int]]) -> None:
        """Bucket ``bucket``'s compressed parameters, by name and length."""
        self.layouts[bucket] = layout
        self.layout_names[bucket] = frozenset(n for n, _ in layout)
        total = sum(n for _, n in layout)
        at, self.offsets[bucket] = 0, {}
        for name, n in layout:
            self.offsets[bucket][name] = (at, n, total)
            at += n

    def names(self, bucket) -> list[str]:
        return [name for name, _ in self.layouts[bucket]]

    def load(self, residuals: dict[str, torch.Tensor]) -> None:
        """Carry a state's residuals (checked by :func:`checkpoint.residuals_of`): refused
        where one names no compressed parameter or has another length."""
        for name, r in residuals.items():
            if name not in self.compressed:
                raise ValueError(
                    f"the state holds a residual of {name!r}, but the hook compresses no "
                    f"parameter of that name (it is kept in FP32, or named otherwise: "
                    f"a hook built on the DDP wrapper names them 'module.'...): it would never "
                    f"be applied; drop it from the state to go on without it")
            if r.numel() != self.compressed[name]:
                raise ValueError(f"the residual of {name!r} holds {r.numel()} elements, the "
                                 f"parameter {self.compressed[name]}: a state of another "
                                 f"model; drop it from the state to go on without it")
        self.carried = residuals

    def named(self, wanted=None) -> dict[str, torch.Tensor]:
        """Each compressed parameter's residual (of the names ``wanted`` alone, where given):
        the one its bucket keeps, the bucket last built with it (DDP rebuilds its buckets
        after the first iteration; none where that bucket's reducer keeps none: a refused
        round may drop it), or one still carried from a load."""
        names = set(self.owner) | set(self.carried) if wanted is None else wanted
        out = {}
        for name in names:
            bucket = self.owner.get(name)
            if bucket is None:
                if name in self.carried:
                    out[name] = self.carried[name]
                continue
            start, n, total = self.offsets[bucket][name]
            residual = self._residual_of((bucket, total))
            if residual is not None:
                out[name] = residual[start:start + n]
        return out

    def one(self, name: str) -> torch.Tensor | None:
        """The residual kept for parameter ``name`` (not a copy), or None."""
        return self.named({name}).get(name)

    def seed(self, bucket, device) -> torch.Tensor | None:
        """The residual bucket ``bucket``'s new reducer starts from: its parameters' (see
        :meth:`named`), None where none has one."""
        layout = self.layouts.get(bucket)
        if layout is None:   # a bucket reduced by hand, not through DDP
            return None
        return checkpoint.joined(self.named(self.layout_names[bucket]), layout, device)

    def taken(self, bucket) -> None:
        """Bucket ``bucket``'s new reducer is agreed on every rank: its parameters'
        residuals, loaded or another bucket's, are its own now."""
        for name, _ in self.layouts.get(bucket, ()):
            self.carried.pop(name, None)
            self.owner[name] = bucket

    def rescale_carried(self, factor: float) -> None:
        self.carried = {name: r * factor for name, r in self.carried.items()}
