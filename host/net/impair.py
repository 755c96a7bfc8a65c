"""Packet impairments injected in the transport: loss, duplication, reordering and jitter.

Used on both sides (worker sends, aggregator sends) so exactly-once aggregation can be
tested under every kind of misbehaviour a network shows, without root or netem. Jitter is
a random per-packet delay (what netem's ``delay 0 J`` would add): the sender's loop asks
:meth:`Impairment.next_release` how long it may sleep and calls :meth:`Impairment.flush`
to send what is due, so kernels without sch_netem can still be tested under jitter.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Impairment:
    loss: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    """Probability that a packet is held back and released after the next ``reorder_gap``
    packets."""
    reorder_gap: int = 3
    jitter: float = 0.0
    """Every sent packet waits a random delay drawn uniformly from [0, jitter] seconds (so
    packets also overtake each other, as under netem jitter); late, never lost."""
    seed: int | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _rng: random.Random = field(init=False, repr=False)
    _held: list = field(init=False, repr=False, default_factory=list)
    _delayed: list = field(init=False, repr=False, default_factory=list)
    _order: itertools.count = field(init=False, repr=False, default_factory=itertools.count)
    stats: dict = field(init=False, default_factory=lambda: {"lost": 0, "duplicated": 0,
                                                              "reordered": 0, "delayed": 0})

    def __post_init__(self):
        for name in ("loss", "dup", "reorder"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"impairment {name}={v} must lie in [0, 1)")
        if not 0.0 <= self.jitter <= 10.0:
            raise ValueError(f"impairment jitter={self.jitter} s must lie in [0, 10]")
        self._rng = random.Random(self.seed)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, sent: str) -> None:
        """The flags of an impairment of the ``sent`` packets (testing)."""
        group = parser.add_argument_group("impairments (testing)")
        for name in ("loss", "dup", "reorder"):
            group.add_argument(f"--{name}", type=float, default=0.0, metavar="PROB",
                               help=f"inject {name} with this probability, in [0, 1), on "
                                    f"sent {sent} (not a percent)")
        group.add_argument("--jitter", type=float, default=0.0, metavar="SECONDS",
                           help=f"delay each of the sent {sent} by a random 0..SECONDS")

    @classmethod
    def from_args(cls, args: argparse.Namespace, seed: int | None = None) -> "Impairment":
        """The impairment the flags of :meth:`add_arguments` ask for."""
        return cls(loss=args.loss, dup=args.dup, reorder=args.reorder, jitter=args.jitter,
                   seed=seed)

    @property
    def active(self) -> bool:
        return bool(self.loss or self.dup or self.reorder or self.jitter)

    def _out(self, deliver: Callable[..., None], args: tuple) -> None:
        if self.jitter:
            self.stats["delayed"] += 1
            due = self.clock() + self._rng.uniform(0.0, self.jitter)
            heapq.heappush(self._delayed, (due, next(self._order), deliver, args))
        else:
            deliver(*args)

    def send(self, deliver: Callable[..., None], *args) -> None:
        """Pass one packet through the impairment; ``deliver(*args)`` sends it for real."""
        rng = self._rng
        self.release_due()
        due = []
        for held in self._held:
            held[0] -= 1
        while self._held and self._held[0][0] <= 0:
            due.append(self._held.pop(0)[1:])
        if rng.random() < self.loss:
            self.stats["lost"] += 1
        elif rng.random() < self.reorder:
            self.stats["reordered"] += 1
            self._held.append([self.reorder_gap, deliver, args])
        else:
            self._out(deliver, args)
            if rng.random() < self.dup:
                self.stats["duplicated"] += 1
                self._out(deliver, args)
        for held_deliver, held_args in due:  # each through its own (a DSCP mark rides it)
            self._out(held_deliver, held_args)

    def next_release(self) -> float | None:
        """Seconds until the next delayed packet is due (0 if one is late), None if none waits."""
        if not self._delayed:
            return None
        return max(0.0, self._delayed[0][0] - self.clock())

    def release_due(self) -> None:
        """Send the delayed packets whose time has come."""
        delayed, now = self._delayed, self.clock()
        while delayed and delayed[0][0] <= now:
            _, _, deliver, args = heapq.heappop(delayed)
            deliver(*args)

    def flush(self, everything: bool = False) -> None:
        """Release held packets (a reordered packet is late, never lost) and the delayed
        packets that are due; with ``everything``, every delayed packet too (at shutdown)."""
        held, self._held = self._held, []
        for _, deliver, args in held:
            self._out(deliver, args)
        self.release_due()
        if everything:
            while self._delayed:
                _, _, late_deliver, args = heapq.heappop(self._delayed)
                late_deliver(*args)
