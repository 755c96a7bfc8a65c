"""Job configuration: the sum width follows workers x granularity; lanes fit one MTU at it."""
from __future__ import annotations

import pytest

from thc.wire import protocol as P
from thc.wire.jobs import VOTE_TABLE, ConfigError, Job, Worker

TABLE = tuple(range(0, 31, 2))


def job(n_workers: int, granularity: int = 30, **kw) -> Job:
    workers = tuple(Worker(i, "127.0.0.1", 9000 + i) for i in range(n_workers))
    table = tuple(min(t, granularity) for t in TABLE)
    return Job(job_id=1, workers=workers, table=table, granularity=granularity, **kw)


@pytest.mark.parametrize("n,g,bits", [(8, 30, 8), (1, 255, 8), (17, 15, 8), (9, 30, 16),
                                      (8, 32, 16), (1, 256, 16), (16, 16, 16), (32, 30, 16),
                                      (32, 2047, 16)])
def test_sum_width_is_the_narrowest_that_holds_n_times_g(n, g, bits):
    j = job(n, g).validate()
    assert j.sum_bits == bits == P.sum_bits_for(n, g)
    assert Job.from_dict(j.to_dict()).sum_bits == bits


def test_sums_that_overflow_16_bits_are_refused():
    with pytest.raises(ConfigError, match="overflows even 16-bit sums"):
        job(32, 2048).validate()
    with pytest.raises(ValueError, match="65535"):
        P.sum_bits_for(32, 2048)


def test_an_explicit_width_is_checked():
    assert job(4, sum_bits=16).validate().sum_bits == 16
    with pytest.raises(ConfigError, match="requested 8-bit sums.*choose 16"):
        job(32, sum_bits=8).validate()
    with pytest.raises(ConfigError, match="= 256 overflows the requested 8-bit sums"):
        job(8, 32, sum_bits=8).validate()     # 8 top values sum to 256: 0 in 8 bits
    with pytest.raises(ConfigError, match="sum_bits 12"):
        job(4, sum_bits=12).validate()


def test_result_payload_and_mtu_lanes_follow_the_width():
    assert P.payload_bytes(P.PktType.RESULT, 256, 8) == 256
    assert P.payload_bytes(P.PktType.RESULT, 256, 16) == 512
    assert P.sum_dtype(16).str == ">u2"
    for bits in P.SUM_WIDTHS:
        most = P.max_software_lanes(bits)
        overhead = P.ETH_IP_UDP_BYTES + P.HEADER_BYTES
        assert overhead + P.payload_bytes(P.PktType.RESULT, most, bits) <= 1514
        assert overhead + P.payload_bytes(P.PktType.RESULT, most + 2, bits) > 1514
    assert job(32, lanes=P.max_software_lanes(16)).validate()
    with pytest.raises(ConfigError, match="1500-byte MTU"):
        job(32, lanes=P.max_software_lanes(8)).validate()


def test_switch_lanes_come_in_groups_of_eight_and_grow_at_most_512_bytes():
    assert P.check_lanes(256, switch=True, sum_bits=16) == 256
    with pytest.raises(ValueError, match="groups of 8"):
        P.check_lanes(260, switch=True)
    for lanes in (0, -2, 3):   # no lanes divided the round into chunks of none
        with pytest.raises(ValueError, match="positive even number"):
            P.check_lanes(lanes)
    with pytest.raises(ValueError, match="512"):
        P.check_lanes(456, switch=True, sum_bits=16)
    # a FLUSH (no payload) grows into a whole RESULT: 264 lanes passed a DATA-based bound
    with pytest.raises(ValueError, match="grow a FLUSH by 528 bytes"):
        P.check_lanes(264, switch=True, sum_bits=16)
    assert P.check_lanes(512, switch=True, sum_bits=8) == 512


def test_a_vote_job_counts_one_bit_lanes_in_8_bit_sums():
    workers = tuple(Worker(i, "127.0.0.1", 9000 + i) for i in range(32))
    vote = Job.vote(1, workers).validate()
    assert vote.sum_bits == 8 and vote.granularity == 1
    assert P.payload_bytes(P.PktType.DATA, vote.lanes, aggregation="vote") == vote.lanes // 8
    assert Job.from_dict(vote.to_dict()) == vote
    for table, g in ((TABLE, 30), (VOTE_TABLE, 30)):
        with pytest.raises(ConfigError, match="vote job counts sign bits"):
            Job(job_id=1, workers=workers, table=table, granularity=g,
                aggregation="vote").validate()
    with pytest.raises(ConfigError, match="whole bytes"):
        Job.vote(1, workers, lanes=20).validate()
    with pytest.raises(ConfigError, match="aggregation 'sum' unknown"):
        job(4, aggregation="sum").validate()


@pytest.mark.parametrize("ip,port,why", [
    ("10.0.0.300", 9000, "not an IPv4 address"), ("host-a", 9000, "not an IPv4 address"),
    (None, 9000, "not an IPv4 address"), ("10.0.0.1", "9000", "not an integer"),
    ("10.0.0.1", 70000, "not an integer in 1..65535"), ("10.0.0.1", 0, "1..65535"),
    ("10.0.0.1", True, "not an integer")])
def test_worker_and_shard_addresses_are_checked(ip, port, why):
    """A bad address passed on would kill the aggregator with a traceback (a string port) or
    have it drop that node's packets as unknown forever (an impossible IP)."""
    from dataclasses import replace

    from thc.wire.jobs import Shard
    bad = job(2)
    bad = replace(bad, workers=(bad.workers[0], Worker(1, ip, port)))
    with pytest.raises(ConfigError, match=f"worker 1: .*{why}"):
        bad.validate()
    with pytest.raises(ConfigError, match=f"shard 1: .*{why}"):
        job(2, shards=(Shard("10.0.1.1", 7000), Shard(ip, port))).validate()
    with pytest.raises(ConfigError, match=why):
        Job.from_dict({**job(2).to_dict(), "workers": [
            {"id": 0, "ip": "10.0.0.1", "port": 9000}, {"id": 1, "ip": ip, "port": port}]
        }).validate()


@pytest.mark.parametrize("size,base", [(0, 0), (3, 0), (48, 0), (1 << 17, 0), (64, 65500),
                                       (64, -1)])
def test_the_pool_is_a_power_of_two_within_the_slot_field(size, base):
    """The slot field is 16 bits; a pool that does not divide 2^32 brings two versions of one
    slot within a window of each other where seq wraps."""
    with pytest.raises(ConfigError, match="power-of-two pool_size"):
        job(2, pool_size=size, pool_base=base).validate()
    assert job(2, pool_size=1 << 15, pool_base=1 << 15).validate().pool_size == 1 << 15


@pytest.mark.parametrize("field,value", [("job_id", 3.0), ("job_id", True), ("lanes", 16.0),
                                         ("granularity", 30.0), ("sum_bits", 8.0)])
def test_numbers_the_header_and_the_datapaths_pack_are_integers(field, value):
    """A float such as 3.0 passed the range checks, then failed where a header was packed:
    the Python aggregator's serving thread died on its first reply."""
    from dataclasses import replace
    with pytest.raises(ConfigError, match=f"{field} {value!r} is not an integer"):
        replace(job(2), **{field: value}).validate()
    with pytest.raises(ConfigError, match="table entry 1 2.0 is not an integer"):
        Job(job_id=1, workers=job(2).workers, table=(0, 2.0) + TABLE[2:],
            granularity=30).validate()
    with pytest.raises(ConfigError, match="worker 1's id 1.0 is not an integer"):
        Job(job_id=1, workers=(Worker(0, "127.0.0.1", 9000), Worker(1.0, "127.0.0.1", 9001)),
            table=TABLE, granularity=30).validate()


def test_the_aggregator_address_is_an_ipv4_literal():
    """Replies are matched against it as their source reads: a name would match none."""
    from thc.wire.jobs import Cluster
    with pytest.raises(ConfigError, match="the aggregator: ip 'localhost'"):
        Cluster.from_dict({"agg_ip": "localhost", "jobs": [job(2).to_dict()]})
    assert Cluster.from_dict({"agg_ip": "10.0.0.9", "jobs": [job(2).to_dict()]}).agg_ip \
        == "10.0.0.9"


def test_sums_that_just_fit_16_bits_are_taken():
    """n x granularity = 65535 is the largest sum 16 bits hold: such a job is valid, and
    only one a unit above it overflows (the bound is inclusive, as the width's choice)."""
    for n, g in [(1, 65535), (3, 21845), (5, 13107)]:
        assert job(n, g).validate().sum_bits == 16 == P.sum_bits_for(n, g)
        assert Job.from_dict(job(n, g).to_dict()).sum_bits == 16
    with pytest.raises(ConfigError, match="overflows even 16-bit sums"):
        job(1, 65536).validate()


def test_a_negative_table_value_is_refused():
    """Sums are unsigned: a table value below 0 has no place in them (the switch would add
    its two's complement), so it is refused with the job's name, as one above the
    granularity is."""
    for bad in (-1, 31):
        with pytest.raises(ConfigError, match=r"table values must lie in 0\.\.30"):
            Job(job_id=1, workers=job(2).workers, table=(bad,) + TABLE[1:],
                granularity=30).validate()


def test_the_configuration_tag_covers_everything_the_sums_depend_on():
    """A client refuses the replies of an aggregator whose install's tag is not its own: a
    job that differs in any one thing its sums depend on (its lanes, pool, workers, table,
    granularity, width or aggregation) must get another tag, or an aggregator installed
    with it would answer with sums that look possible and are wrong."""
    from dataclasses import replace
    base = job(2).validate()
    others = [replace(base, lanes=2 * base.lanes), replace(base, pool_size=2 * base.pool_size),
              job(3), replace(base, table=(1,) + TABLE[1:]), job(2, granularity=31),
              replace(base, sum_bits=16), Job.vote(1, base.workers)]
    tags = {o.validate().config_tag for o in others}
    assert base.config_tag not in tags and len(tags) == len(others)
    assert replace(base, mcast_grp=7, loss_bound=0.5).config_tag == base.config_tag


def test_slot_pools_on_a_switch_may_touch_but_not_share_a_slot():
    """The controller installs a cluster only where no two jobs' pools share a slot (each
    slot holds one job's partial sums) and every pool fits the switch's slots."""
    from dataclasses import replace

    from thc.wire.jobs import Cluster
    first = replace(job(2), pool_base=0, pool_size=4)

    def cluster(base, size=4, slots=16):
        second = replace(job(2), job_id=2, pool_base=base, pool_size=size)
        return Cluster(agg_ip="10.0.0.9", jobs=(first, second)).validate(total_slots=slots)
    assert cluster(4).jobs[1].pool_base == 4
    with pytest.raises(ConfigError, match="slot pools of jobs 1 and 2 overlap"):
        cluster(3, size=1)
    with pytest.raises(ConfigError, match="job 2's pool ends at slot 20, the switch has 16"):
        cluster(16)
    assert cluster(12).jobs[1].pool_base == 12


@pytest.mark.parametrize("table, n", [(TABLE, 3), (VOTE_TABLE, 4),
                                      ((0, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 30),
                                       3),
                                      ((1, 4, 4, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 30), 2)])
def test_reachable_sums_are_the_sums_of_k_table_values(table, n):
    """Each row k holds exactly the sums of k of the table's values, repeats allowed,
    counted here by brute force."""
    from itertools import combinations_with_replacement
    g = max(table)
    j = Job(job_id=1, workers=tuple(Worker(i, "127.0.0.1", 9000 + i) for i in range(n)),
            table=table, granularity=g)
    reach = j.reachable_sums
    assert reach.shape == (n + 1, n * g + 1) and not reach.flags.writeable
    for k in range(n + 1):
        sums = {sum(c) for c in combinations_with_replacement(set(table), k)}
        assert set(map(int, reach[k].nonzero()[0])) == sums, k
