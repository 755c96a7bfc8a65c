"""Cluster files as written by hand: every badly shaped or typed value is a ConfigError that
names the job, raised before any table is computed or anything installed."""
from __future__ import annotations

import re

import numpy as np
import pytest

from thc.wire import protocol as P
from thc.wire.jobs import Cluster, ConfigError, Job, check_loss_bound

WORKERS = [{"id": 0, "ip": "10.0.0.1", "port": 50000}, {"id": 1, "ip": "10.0.0.2", "port": 50001}]


def one_job(**kw) -> dict:
    return {"jobs": [{"job_id": 7, "granularity": 30, "workers": WORKERS, **kw}],
            "agg_ip": "10.0.0.100"}


@pytest.mark.parametrize("ip", [167772161, b"\n\x00\x00\x01", [10, 0, 0, 1]])
def test_a_worker_ip_is_a_dotted_quad_string(ip):
    """An integer passed (IPv4Address takes one); no packet's source ever read as it."""
    with pytest.raises(ConfigError, match=f"job 7: worker 0: ip {re.escape(repr(ip))} is "
                                          f"not an IPv4 address \\(a dotted-quad"):
        Cluster.from_dict(one_job(workers=[{**WORKERS[0], "ip": ip}, WORKERS[1]]))


@pytest.mark.parametrize("table,entry", [([i * 1.9 for i in range(16)], "0.0"),
                                         ([str(2 * i) for i in range(16)], "'0'"),
                                         ([True] * 16, "True")])
def test_table_values_are_taken_as_given(table, entry):
    """int() rounded floats down and parsed strings and bools into a table nobody wrote."""
    with pytest.raises(ConfigError, match=f"job 7: table entry 0 {entry} is not an integer"):
        Cluster.from_dict(one_job(table=table))


@pytest.mark.parametrize("g,why", [(10 ** 6, "overflows even 16-bit sums"),
                                   ("30", "granularity '30' is not an integer"),
                                   (30.0, "granularity 30.0 is not an integer")])
def test_granularity_is_checked_before_the_table_is_computed(g, why, monkeypatch):
    """g = 1e6 tried to allocate terabytes for the table search."""
    import thc.wire.jobs as jobs

    def no_table(*a, **k):
        raise AssertionError("a table was computed")
    monkeypatch.setattr(jobs, "THCParams", no_table)
    with pytest.raises(ConfigError, match=f"job 7: .*{why}"):
        Cluster.from_dict(one_job(granularity=g))


@pytest.mark.parametrize("d,why", [
    ({"jobs": 5}, "the cluster: jobs must be a list of JSON objects, got 5"),
    ({"jobs": ["x"]}, r"the cluster: jobs must be a list of JSON objects, got \['x'\]"),
    ([], "a cluster must be a JSON object"),
    ("x", "a cluster must be a JSON object"),
    (one_job(workers=None), "job 7: workers must be a list of JSON objects, got None"),
    (one_job(workers=[[0, "10.0.0.1", 5]]), "job 7: workers must be a list of JSON objects"),
    (one_job(shards="x"), "job 7: shards must be a list of JSON objects"),
    (one_job(table="0123"), "job 7: table '0123' is not a list of 16 integers"),
    (one_job(p="abc"), "job 7: p 'abc' is not a number"),
    *((one_job(workers=[WORKERS[0], {"id": 1, "ip": ip, "port": 50001}]),
       f"ip {ip} is not one host's address") for ip in ("255.255.255.255", "0.0.0.0",
                                                        "224.0.0.1")),
    (one_job(p=2), "job 7: p must lie between 0 and 1"),
    ({"jobs": [{"job_id": 7, "workers": WORKERS}]}, "job 7: 'granularity' is missing"),
    ({**one_job(), "agg_mcac": "02:00:00:00:00:01"}, r"unknown keys \['agg_mcac'\]"),
    (one_job(workers=[{**w, "id": w["id"] + 1} for w in WORKERS]),
     r"job 7: worker ids must be 0..1, got \[1, 2\]"),
    (one_job(workers=[WORKERS[0], {**WORKERS[0], "id": 1}]), "job 7: two workers share an "
                                                            "address"),
    *(({"jobs": [{**one_job()["jobs"][0], "job_id": i}], "agg_ip": "10.0.0.100"},
       f"job_id {i} outside 1..65535") for i in (0, 1 << 16)),
    ({"jobs": [one_job()["jobs"][0], {**one_job()["jobs"][0], "workers": [
        {**w, "ip": f"10.0.1.{w['id'] + 1}"} for w in WORKERS]}], "agg_ip": "10.0.0.100"},
     r"duplicate job ids in \[7, 7\]")])
def test_badly_shaped_clusters_say_what_is_wrong(d, why):
    """These gave tracebacks (TypeError, AttributeError) or, for a typo, nothing at all."""
    with pytest.raises(ConfigError, match=why):
        Cluster.from_dict(d)


def test_documented_keys_still_load():
    c = Cluster.from_dict({**one_job(), "agg_port": 48879, "agg_mac": "02:00:00:00:00:09"})
    assert (c.agg_port, c.agg_mac) == (48879, "02:00:00:00:00:09")
    assert Cluster.from_dict(c.to_dict()) == c
    assert Job.from_dict(c.jobs[0].to_dict()) == c.jobs[0]


@pytest.mark.parametrize("value", [np.float32(0.125), np.float64(0.1), np.int64(0)])
def test_a_loss_bound_may_be_a_numpy_number(value):
    assert check_loss_bound(value) == pytest.approx(float(value))
    with pytest.raises(ConfigError, match="loss_bound must be"):
        check_loss_bound(np.bool_(True) if value == 0 else value + 1)


def test_too_many_jobs_are_refused_before_any_table_is_made(monkeypatch):
    """The count was checked once every job was built: a file of many jobs at a large
    granularity made each one's optimal table first (seconds and hundreds of MB each)."""
    import thc.wire.jobs as jobs_module
    made = []
    real = jobs_module.Job.from_dict
    monkeypatch.setattr(jobs_module.Job, "from_dict",
                        classmethod(lambda cls, d: made.append(d) or real(d)))
    one = one_job()["jobs"][0]
    many = {"jobs": [{**one, "job_id": i} for i in range(P.MAX_JOBS + 1)]}
    with pytest.raises(ConfigError, match=f"{P.MAX_JOBS + 1} jobs; at most {P.MAX_JOBS}"):
        Cluster.from_dict(many)
    assert made == []


@pytest.mark.parametrize("aggregation", [["thc"], {"thc": 1}, 0])
def test_an_aggregation_that_is_no_name_is_named(aggregation):
    """A list or object was refused as "bad job description: unhashable type"."""
    with pytest.raises(ConfigError, match=f"job 7: aggregation {re.escape(repr(aggregation))} "
                                          f"unknown \\(one of"):
        Cluster.from_dict(one_job(aggregation=aggregation))
