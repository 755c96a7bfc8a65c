"""DLCP's priority classes: which DATA packets a congested network should drop first.

A chunk's class depends on where its layer sits in the next forward pass (layers it needs
first rank highest: their updates gate the start of the next iteration) and on the chunk's
gradient magnitude (large coordinates carry most of the update, small ones lose least when
dropped; what is dropped goes back through error feedback anyway). Classes are marked in
the IPv4 DSCP field (``protocol.json``'s ``priority_dscp``, lowest class first).
"""
from __future__ import annotations

import numpy as np

from thc.wire import protocol as P

N_CLASSES = len(P.PRIORITY_DSCP)
FLUSH_CLASS = N_CLASSES - 1
"""FLUSH packets (a round closing short) are tiny and end a wait: always the top class."""

LAYER_WEIGHT = 0.5
"""Share of the class score that comes from the layer's position (the rest: magnitude)."""


def priority_class(layer_position, magnitude_rank) -> np.ndarray:
    """Class (0 = dropped first .. N_CLASSES-1 = kept longest) of each chunk.

    ``layer_position``: 0 for the layer the next forward pass needs first, 1 for the last
    one (a chunk spanning layers takes its earliest). ``magnitude_rank``: the chunk's
    gradient magnitude as a quantile among the round's chunks, 0 smallest, 1 largest. The
    score ``LAYER_WEIGHT * (1 - position) + (1 - LAYER_WEIGHT) * rank`` in [0, 1] is cut
    into N_CLASSES equal bands. Every worker computes it from agreed values (layer order,
    the agreed slice norms), so all copies of a chunk share one class.
    """
    pos = np.asarray(layer_position, dtype=np.float64)
    rank = np.asarray(magnitude_rank, dtype=np.float64)
    if not (np.all((pos >= 0) & (pos <= 1)) and np.all((rank >= 0) & (rank <= 1))):  # NaN too
        raise ValueError("layer_position and magnitude_rank must lie in [0, 1]")
    score = LAYER_WEIGHT * (1.0 - pos) + (1.0 - LAYER_WEIGHT) * rank
    return np.minimum((score * N_CLASSES).astype(np.int64), N_CLASSES - 1).astype(np.uint8)


def magnitude_rank(magnitudes) -> np.ndarray:
    """Quantile in [0, 1] of each magnitude among all of them (ties share the lower rank)."""
    m = np.asarray(magnitudes, dtype=np.float64).reshape(-1)
    if m.size <= 1:
        return np.ones(m.size)
    order = np.searchsorted(np.sort(m), m, side="left")
    return order / (m.size - 1)


def tos_of(cls: int) -> int:
    """The IPv4 TOS byte (DSCP << 2, ECN 0) that marks class ``cls``."""
    return P.PRIORITY_DSCP[int(cls)] << 2
