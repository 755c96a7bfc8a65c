"""Packet impairments injected in the transport: loss, duplication and reordering.

Used on both sides (worker sends, aggregator sends) so exactly-once aggregation can be
tested under every kind of misbehaviour a network shows, without root or netem.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Impairment:
    loss: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    """Probability that a packet is held back and released after the next ``reorder_gap`` packets."""
    reorder_gap: int = 3
    seed: int | None = None
    _rng: random.Random = field(init=False, repr=False)
    _held: list = field(init=False, repr=False, default_factory=list)
    stats: dict = field(init=False, default_factory=lambda: {"lost": 0, "duplicated": 0,
                                                              "reordered": 0})

    def __post_init__(self):
        for name in ("loss", "dup", "reorder"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"impairment {name}={v} must lie in [0, 1)")
        self._rng = random.Random(self.seed)

    @property
    def active(self) -> bool:
        return bool(self.loss or self.dup or self.reorder)

    def send(self, deliver: Callable[..., None], *args) -> None:
        """Pass one packet through the impairment; ``deliver(*args)`` sends it for real."""
        rng = self._rng
        due = []
        for held in self._held:
            held[0] -= 1
        while self._held and self._held[0][0] <= 0:
            due.append(self._held.pop(0)[1])
        if rng.random() < self.loss:
            self.stats["lost"] += 1
        elif rng.random() < self.reorder:
            self.stats["reordered"] += 1
            self._held.append([self.reorder_gap, args])
        else:
            deliver(*args)
            if rng.random() < self.dup:
                self.stats["duplicated"] += 1
                deliver(*args)
        for held_args in due:
            deliver(*held_args)

    def flush(self, deliver: Callable[..., None]) -> None:
        """Release held packets (a reordered packet is late, never lost)."""
        held, self._held = self._held, []
        for _, args in held:
            deliver(*args)
