"""A vote job on the Tofino program, run on paper (tests/tna/passes.py): the generated parser
state, the three spread actions of pass 0, the passes after it and the words' lookups
(p4src/generated/thc_tna_*.p4) are read as text and executed here on random sign payloads,
with the controller's entries for the job (controller/targets/tofino.py); the counts must
be the +1 votes of every lane (protocol.json: the first lane in the high bit of the first
byte).

Bits the program leaves undefined (index header bits that no spread writes) hold random
garbage, different for every worker: the entries must not depend on them. No compiler is
needed; the compiled program's fit is in p4src/build/tofino/REPORT.json.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.tna import lanes
from tests.test_tna_lanes import aggregate
from thc.wire import protocol as P
from thc.wire.jobs import Job, Worker


def test_the_program_reads_sign_words_and_spreads_every_index_header():
    words, actions = lanes.state("parse_signs"), lanes.actions("thc_tna_spread.p4", "thc_spread")
    assert len(words) * 32 == P.LANES
    assert len(actions) == 3
    written = {st[1] for a in actions for st in a if st[0] == "set"}
    assert len(written) == P.LANES // 8, "every index header of the packet"
    assert len(lanes.lookups()) == 2 * 32


@pytest.mark.parametrize("n_workers", [1, 5, 31])
def test_a_vote_job_counts_every_lanes_plus_ones(n_workers):
    workers = tuple(Worker(i, f"10.0.0.{i + 1}", 20000 + i, f"02:00:00:00:00:{i + 1:02x}", 256 + i)
                    for i in range(n_workers))
    job = Job.vote(6, workers).validate()
    rng = np.random.default_rng(n_workers)
    signs = rng.integers(0, 256, (n_workers, P.LANES // 8), dtype=np.uint8)
    signs[0] = 0xFF                                        # one worker votes +1 everywhere
    walks, counts = aggregate(job, [row.tobytes() for row in signs], seed=n_workers)
    assert walks[0].passes == ["parse_idx8_1", "parse_idx8_0"]
    np.testing.assert_array_equal(counts, np.unpackbits(signs, axis=1).sum(axis=0))


def test_the_spread_means_the_same_read_in_order_or_all_at_once():
    """bf-p4c runs an action's statements at once, P4 in order: the spread reads each sign
    word before any statement overwrites it, so both give the same packet."""
    workers = (Worker(0, "10.0.0.1", 20000, "02:00:00:00:00:01", 256),)
    job = Job.vote(6, workers).validate()
    signs = np.random.default_rng(7).integers(0, 256, (3, P.LANES // 8), dtype=np.uint8)
    payloads = [row.tobytes() for row in signs]
    _, at_once = aggregate(job, payloads, seed=1)
    _, in_order = aggregate(job, payloads, seed=1, parallel=False)
    np.testing.assert_array_equal(at_once, in_order)
