"""What a RESULT must hold whatever the order of events: the sum (a MAX_RESULT: the maximum)
of the lanes of exactly the workers its bitmap names, for its run and seq. The fuzz's
workers send the same lanes in every copy of a chunk (``lanes``), so the oracle knows them
without the model; tests/tna/interleave.py applies it when the Tofino program's passes
after pass 0 run late (``--delay``), where its replies may differ from the model's.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from thc.codec.packing import unpack_bits
from thc.wire import protocol as P

T = P.PktType


def wrong_sum(job, replies, lanes: Callable[[str, int, int, int], bytes]) -> str | None:
    """The first RESULT or MAX_RESULT in ``replies`` that is not what its bitmap's workers
    sent, described; None if every one is right."""
    for reply, dst in replies:
        h = P.Header.unpack(reply[:P.HEADER_BYTES])
        if h.pkt_type not in (T.RESULT, T.MAX_RESULT):
            continue
        who = [w for w in range(job.n_workers) if h.bitmap >> w & 1]
        body = reply[P.HEADER_BYTES:]
        if h.pkt_type == T.RESULT:
            got = np.frombuffer(body, P.sum_dtype(job.sum_bits)).astype(np.int64)
            want = sum((np.asarray(job.table)[unpack_bits(
                np.frombuffer(lanes("DATA", w, h.run, h.seq), np.uint8), P.INDEX_BITS,
                job.lanes)] for w in who), np.zeros(job.lanes, np.int64))
        else:
            got = np.frombuffer(body, ">u4").astype(np.int64)
            want = np.zeros(len(got), np.int64)
            for w in who:
                want = np.maximum(want, np.frombuffer(lanes("MAX", w, h.run, h.seq), ">u4"))
        if len(got) != len(want) or not np.array_equal(got, want):
            return (f"{T(h.pkt_type).name} of run {h.run} seq {h.seq} to {dst} with bitmap "
                    f"{h.bitmap:#x} holds other sums than its workers {who} sent")
    return None
