"""The compiled datapath extension (``_fastagg``, built by ``pip install`` where a compiler
exists), loaded once and checked against protocol.json; :data:`UNAVAILABLE` says why it
cannot run here (None when it can). The aggregator, the client window and the load generator
wrap it."""
from __future__ import annotations

from thc.built import stale
from thc.net.server import DATAGRAM_BYTES
from thc.net.window import RECV_BYTES
from thc.wire import protocol as P

try:
    from thc.net import _fastagg
except ImportError as e:
    _fastagg = None
    UNAVAILABLE: str | None = (f"the compiled datapath is not built ({e}); "
                               f"`pip install -e .` with a C compiler builds it")
else:
    if why := stale(_fastagg, "compiled datapath"):
        UNAVAILABLE = why
    elif tuple(tuple(f) for f in _fastagg.HEADER_LAYOUT) != tuple(map(tuple, P.HEADER_FIELDS)):
        UNAVAILABLE = "the compiled datapath was built for another header layout: rebuild it"
    elif (set(_fastagg.REASONS) != set(P.DropReason.__members__)
          or set(_fastagg.COUNTERS) != set(P.JOB_COUNTERS)):
        UNAVAILABLE = ("the compiled datapath names other drop reasons or counters than "
                       "protocol.json: rebuild it")
    elif _fastagg.MAX_WORKERS != P.MAX_WORKERS:
        UNAVAILABLE = (f"the compiled datapath takes {_fastagg.MAX_WORKERS} workers a job, "
                       f"protocol.json {P.MAX_WORKERS}: rebuild it, after setting MAX_WORKERS "
                       f"in _fastagg.h where protocol.json changed")
    elif (_fastagg.TAG_SHIFT, _fastagg.SHARD_SHIFT) != (P.EPOCH_TAG_SHIFT,
                                                        P.SHARD_DETAIL_SHIFT):
        UNAVAILABLE = (f"the compiled datapath splits an epoch at bit {_fastagg.TAG_SHIFT} and "
                       f"a wrong_shard detail at bit {_fastagg.SHARD_SHIFT}, protocol.py at "
                       f"{P.EPOCH_TAG_SHIFT} and {P.SHARD_DETAIL_SHIFT}: rebuild it, after "
                       f"setting TAG_SHIFT and SHARD_SHIFT in _fastagg.h")
    elif (_fastagg.RECV_BYTES, _fastagg.CLIENT_RECV_BYTES) != (DATAGRAM_BYTES, RECV_BYTES):
        UNAVAILABLE = (f"the compiled datapath reads {_fastagg.RECV_BYTES} bytes of a "
                       f"datagram at an aggregator and {_fastagg.CLIENT_RECV_BYTES} at a "
                       f"client, the Python one {DATAGRAM_BYTES} and {RECV_BYTES}: they would "
                       f"cut long datagrams apart; make _fastagg.h and _fastagg_stream.c agree "
                       f"and rebuild it")
    else:
        UNAVAILABLE = None

TYPE_CODES = tuple(int(P.PktType[t]) for t in
                   ("DATA", "MAX", "RESULT", "MAX_RESULT", "PENDING", "RESET", "FLUSH",
                    "REFUSED"))
"""The packet type codes, from protocol.json, in the order the extension takes them."""
