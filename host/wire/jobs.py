"""Job configuration: the same description programs the switch and the software aggregator.

A job is a set of workers (id, address), the THC lookup table their indices map through,
and a pool of aggregation slots. The controller turns it into table entries and multicast
groups; the software aggregator turns it into numpy state. Validation lives here so a bad
config is rejected with one clear message before it reaches either.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import ipaddress
import json
import numbers
import re
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from thc.codec.params import THCParams
from thc.wire import protocol as P

SWITCH_AGG_IP = "10.0.0.254"
SWITCH_AGG_MAC = "02:00:00:00:00:fe"
"""The address a switch answers as when it is the aggregator (no host owns it; workers get a
static ARP entry): the default of ``Cluster.agg_mac``, the controller and the testbeds."""


MAX_JOB_ID = (1 << 16) - 1
"""Job ids are 1..MAX_JOB_ID: the header's 16-bit ``job_id``, 0 meaning no job."""

VOTE_TABLE = (0, 1) + (0,) * ((1 << P.INDEX_BITS) - 2)
"""The table of a vote job: a sign bit b counts b. The switch widens each bit to an index
into it, so a vote job runs on the same lane groups as THC."""


class ConfigError(ValueError):
    """A job configuration that cannot be installed."""


@dataclass(frozen=True)
class Worker:
    id: int
    ip: str
    port: int
    mac: str = "00:00:00:00:00:00"
    switch_port: int | None = None
    """Switch port the worker hangs off: a switch sends its results out of it (the controller
    refuses a worker without one); the software aggregator does not use it."""


def _is_int(value) -> bool:
    """An integer (numpy's included), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_address(where: str, ip, port) -> None:
    """An IPv4 literal and a port in 1..65535: the switch keys on them, the compiled
    datapaths take nothing else, and a bad one would leave the node's packets dropped."""
    try:
        if not isinstance(ip, str):     # IPv4Address takes ints and packed bytes too
            raise TypeError(ip)
        addr = ipaddress.IPv4Address(ip)
    except (ipaddress.AddressValueError, ValueError, TypeError):
        raise ConfigError(f"{where}: ip {ip!r} is not an IPv4 address (a dotted-quad "
                          f"string)") from None
    if addr.is_unspecified or addr.is_multicast or addr == ipaddress.IPv4Address(
            "255.255.255.255"):
        raise ConfigError(f"{where}: ip {ip} is not one host's address (unspecified, "
                          f"multicast or broadcast): no packet comes from it")
    if not _is_int(port) or not 0 < port < 1 << 16:
        raise ConfigError(f"{where}: port {port!r} is not an integer in 1..65535")


def check_mac(where: str, mac) -> None:
    """Six bytes as hex pairs: the switch writes it into frames and routes by it."""
    if not isinstance(mac, str) or not re.fullmatch(r"[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2}){5}", mac):
        raise ConfigError(f"{where}: MAC {mac!r} is not six hex bytes (aa:bb:cc:dd:ee:ff)")


def _check_granularity(job_id, n_workers: int, granularity) -> None:
    """An integer whose sum over the workers fits the widest sums: checked before a table is
    computed from it, which for a huge one would try to allocate terabytes."""
    if not _is_int(granularity):
        raise ConfigError(f"job {job_id!r}: granularity {granularity!r} is not an integer")
    top = n_workers * granularity
    if top > (1 << P.SUM_WIDTHS[-1]) - 1:
        raise ConfigError(f"job {job_id}: {n_workers} workers x granularity {granularity} "
                          f"= {top} overflows even {P.SUM_WIDTHS[-1]}-bit sums (max "
                          f"{(1 << P.SUM_WIDTHS[-1]) - 1}); lower the granularity or the "
                          f"worker count")


def _objects(where: str, key: str, value) -> list:
    """``value`` as a list of JSON objects (workers, shards, jobs), else ConfigError."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{where}: {key} must be a list of JSON objects, got "
                          f"{value!r:.80}")
    return value


def check_loss_bound(value, where: str = "") -> float:
    """``value`` as a loss bound: a real number in [0, 1) (numpy's included), else
    ConfigError."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not 0.0 <= float(value) < 1.0:
        raise ConfigError(f"{where}loss_bound must be a fraction of a round's chunks in "
                          f"[0, 1), got {value!r}")
    return float(value)


def loss_bound_arg(text: str) -> float:
    """``--loss-bound`` as an argparse type: a number in [0, 1), else a usage error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    try:
        return check_loss_bound(value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class Shard:
    """One aggregator of a sharded job: it owns the chunks whose ``seq mod n_shards`` is its
    index in the job's shard map (docs/protocol.md, "Shards")."""

    ip: str
    port: int = P.UDP_PORT


@dataclass(frozen=True)
class Job:
    job_id: int
    workers: tuple[Worker, ...]
    table: tuple[int, ...]
    granularity: int
    pool_size: int = 64
    pool_base: int = 0
    lanes: int = P.LANES
    mcast_grp: int = 0
    """The multicast group of the job's results (P4's ``standard_metadata.mcast_grp``, the
    controller's ``set_job`` parameter of the same name); 0 means: job_id (switch multicast
    group ids must be non-zero), resolved when the job is made: ``dataclasses.replace`` of the
    job_id keeps it, so give both."""
    sum_bits: int = 0
    """Width of the job's sums (8 or 16); 0 means: the narrowest that holds n_workers x
    granularity, chosen when the job is made. RESULT payloads carry sums of this width."""
    shards: tuple[Shard, ...] = ()
    """The shard map: software aggregators that each own a share of the job's chunks (chunk
    ``seq`` belongs to ``shards[seq mod len(shards)]``), the same list on every worker and
    every shard. Empty: one aggregator (switch or central software aggregator) owns all."""
    loss_bound: float = 0.0
    """DLCP's bounded loss: the fraction of a round's chunks, in [0, 1), that a worker may
    close short (FLUSH) instead of retransmitting; 0 retransmits everything. Host-side only:
    the switch serves any FLUSH it gets."""
    aggregation: str = "thc"
    """What DATA lanes carry (protocol.json's ``aggregations``): ``thc`` 4-bit table indices,
    ``vote`` one sign bit each, counted (a vote job: :meth:`Job.vote`, table ``VOTE_TABLE``,
    granularity 1, so 8-bit counts for any job's at most 32 workers)."""

    def __post_init__(self):
        # a list or an array given: a tuple (hashable), of plain numbers (JSON's)
        object.__setattr__(self, "workers", tuple(self.workers))
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "table", tuple(v.item() if hasattr(v, "item") else v
                                                for v in self.table))
        if self.mcast_grp == 0:
            object.__setattr__(self, "mcast_grp", self.job_id)
        if self.sum_bits == 0:
            try:
                bits = P.sum_bits_for(len(self.workers), self.granularity)
            except (ValueError, TypeError):
                bits = P.SUM_WIDTHS[-1]   # validate() names the overflow or the bad value
            object.__setattr__(self, "sum_bits", bits)

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    @property
    def n_shards(self) -> int:
        """Aggregators the job's chunks are spread over (1 when it has no shard map)."""
        return len(self.shards) or 1

    def aggregator_shard(self, shard: int | None) -> tuple[int, int]:
        """(n_shards, index) of the aggregator run as ``shard``: a sharded job needs a shard
        index inside its map; a job without one has a single aggregator."""
        if not self.shards:
            return 1, 0
        if shard is None:
            raise ConfigError(f"job {self.job_id} is spread over {self.n_shards} aggregator "
                              f"shards; run this aggregator as one of them "
                              f"(--shard 0..{self.n_shards - 1})")
        if not 0 <= shard < self.n_shards:
            raise ConfigError(f"shard {shard} is not in job {self.job_id}'s shard map "
                              f"(shards 0..{self.n_shards - 1})")
        return self.n_shards, shard

    def shard_of(self, seq: int) -> int:
        """Index in the shard map of the aggregator that owns chunk ``seq`` (32-bit)."""
        return seq % self.n_shards

    @property
    def full_bitmap(self) -> int:
        return (1 << self.n_workers) - 1

    @functools.cached_property
    def config_tag(self) -> int:
        """16 bits of a digest of what an aggregator's sums of this job depend on (aggregation,
        table, granularity, sum width, lanes, pool, workers), carried in the high bits of
        every install's epoch (:data:`thc.wire.protocol.EPOCH_TAG_SHIFT`): a client refuses
        the replies of an aggregator that holds the job otherwise, whose sums would be
        possible and wrong."""
        what = [str(self.aggregation), [int(v) for v in self.table],
                *(int(v) for v in (self.granularity, self.sum_bits, self.lanes, self.pool_size)),
                sorted(int(w.id) for w in self.workers)]
        digest = hashlib.blake2b(json.dumps(what).encode(), digest_size=2).digest()
        return int.from_bytes(digest, "big")

    @functools.cached_property
    def pair_values(self) -> np.ndarray:
        """A packed index byte -> its two lanes' table values (high nibble first), in the
        sums' dtype."""
        lut = np.asarray(self.table, dtype=P.sum_dtype(self.sum_bits))
        every = np.arange(256)
        return np.stack([lut[every >> 4], lut[every & 0x0F]], axis=1)

    @functools.cached_property
    def reachable_sums(self) -> np.ndarray:
        """``reachable_sums[k, s]``: 1 where s is a sum of k of the table's values (repeats
        allowed), k in 0..n_workers, s in 0..n_workers x granularity; read-only uint8. A
        RESULT lane outside its row is no aggregator's sum: a range check alone passes a
        value no table sums to (1 with THC's default table, any odd one where every table
        value is even)."""
        n, values = self.n_workers, sorted({int(v) for v in self.table})
        top = n * int(self.granularity)
        reach = np.zeros((n + 1, top + 1), dtype=np.uint8)
        reach[0, 0] = 1
        for k in range(n):
            for v in values:
                if 0 <= v <= top:
                    reach[k + 1, v:] |= reach[k, :top + 1 - v]
        reach.flags.writeable = False
        return reach

    def lane_values(self, payload) -> np.ndarray:
        """What an aggregator adds for a DATA payload (bytes, or a uint8 array of payloads one
        after another): each 4-bit index's table value (high nibble first), or each sign bit
        of a vote job (first bit first)."""
        raw = payload.reshape(-1) if isinstance(payload, np.ndarray) else \
            np.frombuffer(payload, dtype=np.uint8)
        if self.aggregation == "vote":
            return np.unpackbits(raw)
        return self.pair_values[raw].reshape(-1)

    def new_epoch(self, previous: int | None = None, nonce: int | None = None,
                  avoid: Collection[int] = ()) -> int:
        """An install's epoch: this job's tag, and ``nonce`` or a random one (an epoch unlike
        ``previous``, and a random one none of ``avoid``)."""
        return P.job_epoch(self.config_tag, nonce, previous, avoid)

    def worker(self, worker_id: int) -> Worker:
        for w in self.workers:
            if w.id == worker_id:
                return w
        raise KeyError(worker_id)

    @classmethod
    def vote(cls, job_id: int, workers, **kw) -> "Job":
        """A sign-vote job: every lane counts the workers whose bit is 1 (+1)."""
        return cls(job_id=job_id, workers=tuple(workers), table=VOTE_TABLE, granularity=1,
                   aggregation="vote", **kw)

    def validate(self) -> "Job":
        numbers = {"job_id": self.job_id, "granularity": self.granularity, "lanes": self.lanes,
                   "sum_bits": self.sum_bits, "mcast_grp": self.mcast_grp}
        numbers.update({f"worker {i}'s id": w.id for i, w in enumerate(self.workers)})
        numbers.update({f"worker {i}'s switch_port": w.switch_port
                        for i, w in enumerate(self.workers) if w.switch_port is not None})
        numbers.update({f"table entry {i}": t for i, t in enumerate(self.table)})
        for name, value in numbers.items():
            if not _is_int(value):
                # packed into header fields and C integers: 3.0 would fail there, not here
                raise ConfigError(f"job {self.job_id!r}: {name} {value!r} is not an integer")
        if not 1 <= self.job_id <= MAX_JOB_ID:
            raise ConfigError(f"job_id {self.job_id} outside 1..{MAX_JOB_ID}")
        n = self.n_workers
        if not 1 <= n <= P.MAX_WORKERS:
            raise ConfigError(f"job {self.job_id}: {n} workers; 1..{P.MAX_WORKERS} supported")
        if sorted(w.id for w in self.workers) != list(range(n)):
            raise ConfigError(f"job {self.job_id}: worker ids must be 0..{n - 1}, "
                              f"got {sorted(w.id for w in self.workers)}")
        for kind, nodes in (("worker", self.workers), ("shard", self.shards)):
            for i, node in enumerate(nodes):
                check_address(f"job {self.job_id}: {kind} {getattr(node, 'id', i)}", node.ip,
                               node.port)
        for w in self.workers:
            check_mac(f"job {self.job_id}: worker {w.id}", w.mac)
        addrs = [(w.ip, w.port) for w in self.workers]
        if len(set(addrs)) != n:
            raise ConfigError(f"job {self.job_id}: two workers share an address")
        if len(self.table) != 1 << P.INDEX_BITS:
            raise ConfigError(f"job {self.job_id}: table has {len(self.table)} entries, "
                              f"the wire carries {P.INDEX_BITS}-bit indices "
                              f"({1 << P.INDEX_BITS} entries)")
        if any(not 0 <= t <= self.granularity for t in self.table):
            raise ConfigError(f"job {self.job_id}: table values must lie in 0..{self.granularity}")
        if self.sum_bits not in P.SUM_WIDTHS:
            raise ConfigError(f"job {self.job_id}: sum_bits {self.sum_bits} not in "
                              f"{list(P.SUM_WIDTHS)}")
        _check_granularity(self.job_id, n, self.granularity)
        top = n * self.granularity
        if top > (1 << self.sum_bits) - 1:
            raise ConfigError(f"job {self.job_id}: {n} workers x granularity {self.granularity} "
                              f"= {top} overflows the requested {self.sum_bits}-bit sums (max "
                              f"{(1 << self.sum_bits) - 1}); leave sum_bits out to choose "
                              f"{P.sum_bits_for(n, self.granularity)}")
        check_loss_bound(self.loss_bound, f"job {self.job_id}: ")
        if not isinstance(self.aggregation, str) or self.aggregation not in P.AGGREGATIONS:
            raise ConfigError(f"job {self.job_id}: aggregation {self.aggregation!r} unknown "
                              f"(one of {sorted(P.AGGREGATIONS)})")
        if self.aggregation == "vote" and (self.table != VOTE_TABLE or self.granularity != 1):
            raise ConfigError(f"job {self.job_id}: a vote job counts sign bits: table "
                              f"{list(VOTE_TABLE)} and granularity 1 (Job.vote)")
        if not _is_int(self.pool_size) or not _is_int(self.pool_base) or self.pool_size < 1 \
                or self.pool_base < 0 or self.pool_size & (self.pool_size - 1) \
                or self.pool_base + self.pool_size > P.SLOT_MOD:
            # A power of two divides 2^32, so slot versions stay apart where seq wraps.
            raise ConfigError(f"job {self.job_id}: the pool needs a power-of-two pool_size and "
                              f"pool_base >= 0 with pool_base + pool_size <= {P.SLOT_MOD} (the "
                              f"slot field's range), got pool_size {self.pool_size!r}, "
                              f"pool_base {self.pool_base!r}")
        try:
            P.check_lanes(self.lanes, sum_bits=self.sum_bits, aggregation=self.aggregation)
        except ValueError as e:
            raise ConfigError(f"job {self.job_id}: {e}") from None
        if len(self.shards) > P.MAX_SHARDS:
            raise ConfigError(f"job {self.job_id}: {len(self.shards)} shards; at most "
                              f"{P.MAX_SHARDS} (a wrong_shard refusal names the count in 16 bits)")
        shard_addrs = [(s.ip, s.port) for s in self.shards]
        if len(set(shard_addrs)) != len(shard_addrs):
            raise ConfigError(f"job {self.job_id}: two shards share an address in the shard "
                              f"map {shard_addrs}")
        if set(shard_addrs) & set(addrs):
            raise ConfigError(f"job {self.job_id}: a shard has a worker's address "
                              f"{sorted(set(shard_addrs) & set(addrs))}; give shards their own "
                              f"port")
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d["workers"] = [{k: v for k, v in asdict(w).items()
                         if not (k == "switch_port" and v is None)} for w in self.workers]
        d["table"] = list(self.table)
        if self.shards:
            d["shards"] = [asdict(s) for s in self.shards]
        else:
            del d["shards"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Job":
        """A job from its JSON object: values as given (Job.validate refuses what is not an
        integer where one is needed; nothing is rounded or parsed)."""
        if not isinstance(d, dict):
            raise ConfigError(f"a job must be a JSON object, got {d!r:.80}")
        d = dict(d)
        where = f"job {d.get('job_id', '(no job_id)')!r}"
        try:
            workers = tuple(Worker(**w) for w in _objects(where, "workers", d.pop("workers")))
            d["shards"] = tuple(Shard(**s) for s in _objects(where, "shards",
                                                             d.pop("shards", [])))
            if d.get("aggregation") == "vote":
                d.setdefault("table", VOTE_TABLE)
                d.setdefault("granularity", 1)
            _check_granularity(d.get("job_id"), len(workers), d["granularity"])
            if "table" not in d:
                d["table"] = _table(where, d["granularity"], d.pop("p", 1 / 32))
            else:
                d.pop("p", None)
            if not isinstance(d["table"], (list, tuple)):
                raise ConfigError(f"{where}: table {d['table']!r} is not a list of "
                                  f"{1 << P.INDEX_BITS} integers")
            d["table"] = tuple(d["table"])
            return cls(workers=workers, **d).validate()
        except KeyError as e:
            raise ConfigError(f"{where}: {e} is missing") from None
        except TypeError as e:
            raise ConfigError(f"{where}: bad job description: {e}") from None


def _table(where: str, granularity: int, p) -> tuple[int, ...]:
    """The optimal table of a job that gives none (its granularity already checked)."""
    if not isinstance(p, numbers.Real) or isinstance(p, bool):
        raise ConfigError(f"{where}: p {p!r} is not a number")
    try:
        table = THCParams(bits=P.INDEX_BITS, granularity=granularity, p=float(p)).table
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    return tuple(int(t) for t in table)


@dataclass(frozen=True)
class Cluster:
    """All jobs of one aggregator (switch or software) plus the aggregator's own address."""

    jobs: tuple[Job, ...]
    agg_ip: str = "127.0.0.1"
    agg_port: int = P.UDP_PORT
    agg_mac: str = SWITCH_AGG_MAC

    def job(self, job_id: int) -> Job:
        for j in self.jobs:
            if j.job_id == job_id:
                return j
        raise KeyError(job_id)

    def validate(self, total_slots: int | None = None) -> "Cluster":
        check_address("the aggregator", self.agg_ip, self.agg_port)
        check_mac("the aggregator", self.agg_mac)
        ids = [j.job_id for j in self.jobs]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"duplicate job ids in {ids}")
        if len(self.jobs) > P.MAX_JOBS:
            raise ConfigError(f"{len(self.jobs)} jobs; at most {P.MAX_JOBS}")
        if total_slots is not None:
            ranges = sorted((j.pool_base, j.pool_base + j.pool_size, j.job_id) for j in self.jobs)
            for (_, end, a), (start, _, b) in zip(ranges, ranges[1:]):
                if start < end:
                    raise ConfigError(f"slot pools of jobs {a} and {b} overlap")
            if ranges and ranges[-1][1] > total_slots:
                raise ConfigError(f"job {ranges[-1][2]}'s pool ends at slot {ranges[-1][1]}, "
                                  f"the switch has {total_slots}")
        return self

    def to_dict(self) -> dict:
        return {"agg_ip": self.agg_ip, "agg_port": self.agg_port, "agg_mac": self.agg_mac,
                "jobs": [j.to_dict() for j in self.jobs]}

    @classmethod
    def from_dict(cls, d: dict) -> "Cluster":
        """A cluster from its JSON object; an unknown key is refused, as in a job, so that a
        typo (``agg_mcac``) does not leave its field at the default unnoticed."""
        if not isinstance(d, dict):
            raise ConfigError(f"a cluster must be a JSON object with a \"jobs\" list, got "
                              f"{d!r:.80}")
        d = dict(d)
        jobs = _objects("the cluster", "jobs", d.pop("jobs", []))
        unknown = sorted(set(d) - {"agg_ip", "agg_port", "agg_mac"})
        if unknown:
            raise ConfigError(f"the cluster: unknown keys {unknown} (known: jobs, agg_ip, "
                              f"agg_port, agg_mac)")
        if len(jobs) > P.MAX_JOBS:   # before each job's table is made (seconds each)
            raise ConfigError(f"{len(jobs)} jobs; at most {P.MAX_JOBS}")
        return cls(jobs=tuple(Job.from_dict(j) for j in jobs), **d).validate()

    @classmethod
    def load(cls, path: str | Path) -> "Cluster":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply for a cluster file") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
