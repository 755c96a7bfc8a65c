"""Wire protocol of THC aggregation, read from ``protocol.json``.

The JSON file is the single definition: the P4 generator reads the same file, so the
header layout, packet types and drop-reason codes cannot drift between host and switch.
"""
from __future__ import annotations

import json
import os
import secrets
import struct
import time
from collections.abc import Collection
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np

SPEC_PATH = Path(__file__).with_name("protocol.json")
SPEC = json.loads(SPEC_PATH.read_text())

UDP_PORT: int = SPEC["udp_port"]
LANES: int = SPEC["lanes"]
INDEX_BITS: int = SPEC["index_bits"]
SUM_WIDTHS: tuple[int, ...] = tuple(sorted(SPEC["sum_bits"]))
"""Allowed widths of a job's sums (bits); a job takes the narrowest its sums fit."""
MAX_LANES: int = SPEC["max_lanes"]
GROUP_LANES: int = SPEC["group_lanes"]
"""Lanes of one switch lane group (its own lookup tables and sum registers)."""
KEY_BYTE_ENTRIES: int = 1 << 2 * INDEX_BITS
"""A job's entries in a lookup table: its key byte holds two lanes' indices, and every value
has its entry."""
BMV2_MAX_GROWTH: int = SPEC["bmv2_max_growth"]
"""Bytes BMv2 lets a packet grow by (a header-only FLUSH answered with a whole RESULT)."""
MAX_WORKERS: int = SPEC["max_workers"]
MAX_JOBS: int = SPEC["max_jobs"]
SWITCH_SLOTS: int = SPEC["switch_slots"]
CPU_PORT: int = SPEC["cpu_port"]
RUN_JUMP: int = SPEC["run_jump"]
"""How much newer (serially) a run id may be than the job's run and still take a job whose
run is active: the default clock id of a later launch is (2^24 x 100 ms: 19 days), one
hostile or random far-future id is not."""
RUN_IDLE_S: float = SPEC["run_idle_s"]
"""Seconds after which a job's run counts as idle: then any run id takes the job over."""
PRIORITY_DSCP: tuple[int, ...] = tuple(SPEC["priority_dscp"])
"""DSCP of each priority class, lowest class first (DLCP): the switch maps these to queue
priorities 1..len; DSCP 0 and any other DSCP are best effort (priority 0), the others
counted by the switch."""
PRIORITY_QUEUES: int = len(PRIORITY_DSCP) + 1
"""Queues per port a switch needs (BMv2: ``simple_switch_grpc -- --priority-queues``): one
per class plus best effort. BMv2 drops a packet whose priority has no queue."""
HEADER_FIELDS: list[tuple[str, int]] = [(n, w) for n, w in SPEC["header"]]
SLOT_MOD: int = 1 << dict(HEADER_FIELDS)["slot"]
"""Slots a header can name: a job's pool_base + pool_size stays within it."""

PktType = IntEnum("PktType", SPEC["pkt_types"])
PKT_TYPE_CODES = frozenset(int(t) for t in PktType)
"""Every packet type's code, as it appears in a header."""
DropReason = IntEnum("DropReason", SPEC["drop_reasons"])
JOB_COUNTERS: dict[str, int] = SPEC["job_counters"]
AGGREGATIONS: dict[str, int] = {name: a["code"] for name, a in SPEC["aggregations"].items()
                                if name != "comment"}
"""A job's aggregation type by name -> code (set_job's ``aggregation``): ``thc`` sums table
values of 4-bit indices, ``vote`` counts +1 sign bits (one bit a lane)."""
LANE_BITS: dict[str, int] = {name: a["lane_bits"] for name, a in SPEC["aggregations"].items()
                             if name != "comment"}
"""Bits a DATA lane takes on the wire, per aggregation type."""

_FMT_CODES = {8: "B", 16: "H", 32: "I"}
HEADER_STRUCT = struct.Struct("!" + "".join(_FMT_CODES[w] for _, w in HEADER_FIELDS))
HEADER_BYTES = HEADER_STRUCT.size


def header_span(name: str) -> slice:
    """The bytes of header field ``name`` in a datagram."""
    at = 0
    for field, width in HEADER_FIELDS:
        if field == name:
            return slice(at, at + width // 8)
        at += width // 8
    raise KeyError(name)


MTU, ETH_BYTES, IP_UDP_BYTES = 1500, 14, 20 + 8
"""The IP packet a link carries whole, and the headers around a UDP payload."""
ETH_IP_UDP_BYTES = ETH_BYTES + IP_UDP_BYTES
TCP_MSS, TCP_FRAME = 1448, 1514
"""Linux TCP payload per full segment with timestamps at a 1500-byte MTU, and its Ethernet
frame: what the baselines' Gloo rings put on a link."""
SEQ_MOD = 1 << 32
SEQ_RESET = SEQ_MOD - 1
"""Value a reset slot holds: every sequence number in [0, 2^31 - 1) counts as newer."""

assert HEADER_BYTES * 8 == sum(w for _, w in HEADER_FIELDS)
assert INDEX_BITS == 4 and SUM_WIDTHS == (8, 16), "wire packing: 4-bit indices, 8/16-bit sums"


def sum_bits_for(n_workers: int, granularity: int) -> int:
    """Narrowest allowed sum width that holds n_workers x granularity; ValueError if none."""
    top = n_workers * granularity
    for bits in SUM_WIDTHS:
        if top <= (1 << bits) - 1:
            return bits
    raise ValueError(f"{n_workers} workers x granularity {granularity} = {top} overflows "
                     f"even {SUM_WIDTHS[-1]}-bit sums (max {(1 << SUM_WIDTHS[-1]) - 1})")


def sum_dtype(sum_bits: int) -> np.dtype:
    """Big-endian unsigned dtype of RESULT sums of this width."""
    if sum_bits not in SUM_WIDTHS:
        raise ValueError(f"sum width {sum_bits} not in {SUM_WIDTHS}")
    return np.dtype(f">u{sum_bits // 8}")


def max_software_lanes(sum_bits: int = SUM_WIDTHS[0]) -> int:
    """Most lanes whose RESULT of this width fits a 1500-byte MTU (the software aggregator's
    limit), an even number."""
    return (MTU - IP_UDP_BYTES - HEADER_BYTES) * 8 // sum_bits // 2 * 2


MAX_SOFTWARE_LANES = max_software_lanes(SUM_WIDTHS[0])
"""Most lanes whose 8-bit result fits a 1500-byte MTU; 16-bit jobs take half as many."""


@dataclass(frozen=True)
class Header:
    """The THC header; field names match the P4 header ``thc_h`` and protocol.json."""

    pkt_type: int
    worker_id: int
    job_id: int
    slot: int
    version: int
    count: int
    seq: int
    offset: int
    bitmap: int
    run: int = 0
    epoch: int = 0

    def pack(self) -> bytes:
        return HEADER_STRUCT.pack(self.pkt_type, self.worker_id, self.job_id, self.slot,
                                  self.version, self.count, self.seq, self.offset, self.bitmap,
                                  self.run, self.epoch)

    @classmethod
    def unpack(cls, buf, offset: int = 0) -> "Header":
        return cls(*HEADER_STRUCT.unpack_from(buf, offset))


class ProtocolError(ValueError):
    """A packet that does not follow the protocol."""


def check_aggregation(aggregation: str) -> str:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation {aggregation!r} unknown; protocol.json defines "
                         f"{sorted(AGGREGATIONS)}")
    return aggregation


def payload_bytes(pkt_type: int, lanes: int = LANES, sum_bits: int = SUM_WIDTHS[0],
                  aggregation: str = "thc") -> int:
    """Payload length that a packet of this type must carry (RESULT: of ``sum_bits`` sums;
    DATA: of the job's aggregation type, 4-bit indices or 1-bit signs a lane)."""
    if pkt_type == PktType.DATA:
        return lanes * LANE_BITS[check_aggregation(aggregation)] // 8
    if pkt_type == PktType.RESULT:
        return lanes * sum_bits // 8
    if pkt_type in (PktType.MAX, PktType.MAX_RESULT):
        return MAX_LANES * 4
    return 0


def check_lanes(lanes: int, switch: bool = False, sum_bits: int = SUM_WIDTHS[0],
                aggregation: str = "thc") -> int:
    """Lane counts must fill whole bytes and a RESULT of ``sum_bits`` sums must fit one MTU;
    on BMv2 (``switch``) lanes come in groups of 8 and a packet may also grow by at most
    BMV2_MAX_GROWTH bytes. The software aggregator has no growth limit."""
    if lanes < 2 or lanes % 2:
        raise ValueError(f"lanes must be a positive even number, got {lanes}")
    if lanes * LANE_BITS[check_aggregation(aggregation)] % 8:
        raise ValueError(f"{lanes} lanes of {aggregation} do not fill whole bytes (sign "
                         f"bits: a multiple of 8 lanes)")
    if switch and lanes % GROUP_LANES:
        raise ValueError(f"{lanes} lanes: the switch takes lanes in groups of {GROUP_LANES}")
    growth = payload_bytes(PktType.RESULT, lanes, sum_bits)   # a header-only FLUSH's
    if switch and growth > BMV2_MAX_GROWTH:
        raise ValueError(f"{lanes} lanes of {sum_bits}-bit sums grow a FLUSH by {growth} "
                         f"bytes into its RESULT (> {BMV2_MAX_GROWTH}, BMv2's limit)")
    if IP_UDP_BYTES + HEADER_BYTES + payload_bytes(PktType.RESULT, lanes, sum_bits) > MTU:
        raise ValueError(f"{lanes} lanes of {sum_bits}-bit sums do not fit a 1500-byte MTU "
                         f"(at most {max_software_lanes(sum_bits)})")
    return lanes


def slot_of(seq: int, pool_size: int) -> tuple[int, int]:
    """Chunk sequence number -> (slot, version), as SwitchML assigns them."""
    return seq % pool_size, (seq // pool_size) % 2


SHARD_DETAIL_SHIFT = 16
"""A ``wrong_shard`` REFUSED's detail: the shard count above these bits, the shard below."""
MAX_SHARDS = (1 << SHARD_DETAIL_SHIFT) - 1


def shard_detail(shard: int, n_shards: int) -> int:
    """A ``wrong_shard`` REFUSED's detail: which shard of how many refused (never 0)."""
    return n_shards << SHARD_DETAIL_SHIFT | shard


def shard_in_detail(detail: int) -> tuple[int, int]:
    """(shard, n_shards) of a ``wrong_shard`` REFUSED's detail."""
    return detail & MAX_SHARDS, detail >> SHARD_DETAIL_SHIFT


def seq_newer(a: int, b: int) -> bool:
    """RFC 1982 serial-number order on 32 bits: is ``a`` newer than ``b``?"""
    d = (a - b) % SEQ_MOD
    return 0 < d < (1 << 31)


RUN_ENV = "THC_RUN"
"""Environment variable through which a launcher gives every worker of a run the same id."""


def check_run(run: int) -> int:
    """A run id is a nonzero 32-bit integer (0 means "no run" and is dropped as malformed)."""
    if not isinstance(run, int) or isinstance(run, bool) or not 0 < run < SEQ_MOD:
        raise ValueError(f"a run id must be an integer in 1..{SEQ_MOD - 1}, got {run!r}")
    return run


def run_from_clock(now: float | None = None) -> int:
    """The default run id: wall clock in units of 100 ms, mod 2^32, 0 skipped.

    A later run gets a newer id (serial order) without asking the aggregator; only one
    process (rank 0) may draw it, the others must receive it (clocks differ)."""
    run = int((time.time() if now is None else now) * 10) % SEQ_MOD
    return run or 1


def run_from_env(environ=None) -> int | None:
    """The run id a launcher gave in ``THC_RUN``, or None; a bad value is an error.

    The launcher must give a fresh id to every launch and restart of the workers: a reused
    id would let a new incarnation's seq 0 meet its predecessor's slot uses. torchrun keeps
    the environment across the restarts it makes, so its ``TORCHELASTIC_RESTART_COUNT`` is
    added: each restart runs as a newer run (so launches given ids one apart, 7 then 8,
    meet where the first restarted: give launches ids further apart than their restarts,
    as the default, the wall clock in 100 ms, does)."""
    env = os.environ if environ is None else environ
    text = env.get(RUN_ENV)
    if text is None or text.strip() == "":
        return None
    text = text.strip()
    try:
        base = check_run(int(text, 10) if text.isdecimal() else int(text, 0))
    except ValueError:
        raise ValueError(f"{RUN_ENV}={text!r} is not a run id (an integer in "
                         f"1..{SEQ_MOD - 1})") from None
    return after_restarts(base, env)


def after_restarts(base: int, environ=None) -> int:
    """A run id given to every launch alike (``THC_RUN``, a worker's ``--run-id``) as this
    incarnation's: torchrun's ``TORCHELASTIC_RESTART_COUNT`` added (:func:`run_from_env`)."""
    env = os.environ if environ is None else environ
    restarts = env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    if not restarts.isdecimal():
        raise ValueError(f"TORCHELASTIC_RESTART_COUNT={restarts!r} is not a count")
    return (base - 1 + int(restarts)) % (SEQ_MOD - 1) + 1   # 1..2^32-1: run 0 skipped


def new_epoch(previous: int | None = None) -> int:
    """A nonzero random 32-bit value unlike ``previous``: a client's incarnation nonce."""
    while True:
        epoch = secrets.randbelow(SEQ_MOD - 1) + 1
        if epoch != previous:
            return epoch


EPOCH_TAG_SHIFT = 16
"""A job's epoch (the value every reply carries, set at each install by the control plane;
the data plane returns it as it is): the job's configuration tag (``Job.config_tag``) in its
high 16 bits, so that a client sees an aggregator installed with another table, width,
lanes, pool or workers than its own, and a nonce drawn at each install in the low 16 bits,
so that it sees the job's slot state installed anew."""
NONCE_MASK = (1 << EPOCH_TAG_SHIFT) - 1
NONCE_STEP = 4096
"""A re-install's random nonce lies 1..NONCE_STEP places past the job's last epoch's in the
order :func:`nonce_at` puts the 65535 nonces in, so none of the job's last 15 epochs comes
back: a switch tells the RESETs still queued from any of those installs from the new one's
(thc_install)."""
NONCE_MIX = 40507
"""A multiplier prime to 65535 that scatters neighbouring places over the nonces: a Tofino
keys a worker's record on run xor epoch, and two runs' ids often differ in low bits only,
as epochs a few places apart would in plain order (with the mix, no more often than any
two random epochs)."""
_UNMIX = pow(NONCE_MIX, -1, NONCE_MASK)


def nonce_at(place: int) -> int:
    """The nonce at ``place`` (any integer, taken mod 65535) of the order re-installs step in."""
    return place * NONCE_MIX % NONCE_MASK + 1


def nonce_place(nonce: int) -> int:
    """Where ``nonce`` (1..0xFFFF; a legacy 0 as 0xFFFF) is in that order."""
    return (nonce - 1) * _UNMIX % NONCE_MASK


def epoch_tag(epoch: int) -> int:
    return epoch >> EPOCH_TAG_SHIFT


def upstream_tag(bitmap: int) -> int:
    """The configuration tag an upstream packet (DATA, MAX, FLUSH) carries in its ``bitmap``
    field: the sender's ``Job.config_tag`` in the low 16 bits (the high 16 are sent as 0 and
    not read). An aggregator refuses a packet whose tag is not its install's (``wrong_config``),
    so a worker configured with another table, width, lanes, pool or workers is never summed
    into its peers' rounds, even where its payload has the job's size."""
    return bitmap & NONCE_MASK


def job_epoch(tag: int, nonce: int | None = None, previous: int | None = None,
              avoid: Collection[int] = ()) -> int:
    """The epoch of an install of a job whose configuration tag is ``tag``: with ``nonce``
    (1..0xFFFF) or a random one, unlike ``previous`` (the job's last epoch there) either
    way: a client whose run spans the install must see it. A random one steps on from
    ``previous`` (:data:`NONCE_STEP`) and is none of ``avoid`` (a switch's earlier installs,
    whose RESETs may still be queued)."""
    if nonce is not None:
        if not 0 < nonce <= NONCE_MASK or isinstance(nonce, bool):
            raise ValueError(f"an install's nonce is 1..{NONCE_MASK:#x}, got {nonce!r}")
        if tag << EPOCH_TAG_SHIFT | nonce == previous:
            raise ValueError(f"nonce {nonce:#x} repeats the job's last epoch {previous:#010x}: "
                             f"a client whose run spans the install would not see it")
        return tag << EPOCH_TAG_SHIFT | nonce
    for _ in range(1 << 16):
        if previous is None:
            fresh = secrets.randbelow(NONCE_MASK) + 1
        else:
            fresh = nonce_at(nonce_place(previous & NONCE_MASK) + 1
                             + secrets.randbelow(NONCE_STEP))
        epoch = tag << EPOCH_TAG_SHIFT | fresh
        if epoch != previous and epoch not in avoid:
            return epoch
    raise ValueError(f"no epoch of tag {tag:#06x} left to draw past {previous!r} that is "
                     f"none of the {len(avoid)} to avoid")


def encode(hdr: Header, payload: bytes | np.ndarray = b"") -> bytes:
    """Header + payload as the UDP datagram body."""
    if isinstance(payload, np.ndarray):
        payload = payload.tobytes()
    return hdr.pack() + payload


def decode(datagram: bytes | memoryview) -> tuple[Header, memoryview]:
    """Split a UDP body into header and payload; raise ProtocolError on a short or unknown
    packet."""
    if len(datagram) < HEADER_BYTES:
        raise ProtocolError(f"datagram of {len(datagram)} bytes is shorter than the "
                            f"{HEADER_BYTES}-byte THC header")
    hdr = Header.unpack(datagram)
    if hdr.pkt_type not in PKT_TYPE_CODES:
        raise ProtocolError(f"unknown packet type {hdr.pkt_type}")
    return hdr, memoryview(datagram)[HEADER_BYTES:]


MAX_LANE_TOP = int(np.array(np.finfo(np.float32).max, dtype=np.float32).view(np.uint32))
"""The largest MAX lane a worker sends (the largest finite float's bits): a MAX_RESULT lane
above it is no worker's value (a negative, infinite or NaN pattern), and is refused."""


def floats_to_ordered_u32(x: np.ndarray) -> np.ndarray:
    """Non-negative IEEE-754 floats order like their bit patterns: a switch takes max of raw
    bits."""
    x = np.asarray(x, dtype=np.float32)
    if np.any(~np.isfinite(x)) or np.any(x < 0):
        raise ValueError("MAX values must be finite and non-negative")
    return (x + np.float32(0.0)).view(np.uint32)   # -0.0 as +0.0: its sign bit orders last


def ordered_u32_to_floats(u: np.ndarray) -> np.ndarray:
    return np.asarray(u, dtype=np.uint32).view(np.float32)
