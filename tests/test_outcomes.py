"""What a round ends with: a short round is told from a full one, and a refusal's message
shows only a detail that names something."""
from __future__ import annotations

import numpy as np

from thc.net.outcomes import AggregationRefused, AggregationResult
from thc.wire import protocol as P


def _result(counts) -> AggregationResult:
    counts = np.asarray(counts, np.int64)
    return AggregationResult(np.zeros(4), counts, np.zeros_like(counts), "python")


def test_a_round_is_short_only_where_a_chunk_counted_fewer_than_every_worker():
    """A round of no chunks (nothing to send) lost nothing; one whose every chunk counted
    every worker is full, one chunk short of a worker makes it short."""
    assert not _result([]).short(3)
    assert not _result([3, 3]).short(3)
    assert _result([3, 2]).short(3)


def test_a_wrong_shard_detail_outside_its_count_is_not_shown():
    """A wrong_shard detail names shard and count; a shard index at or past the count is
    no shard of that map, and shown it would mislead: it is left out."""
    good = str(AggregationRefused("chunk 3", "wrong_shard", P.shard_detail(1, 2)))
    assert "(shard 1 of 2)" in good
    for shard in (2, 3):
        bad = str(AggregationRefused("chunk 3", "wrong_shard", P.shard_detail(shard, 2)))
        assert f"shard {shard} of 2" not in bad and "the shard does not own" in bad
