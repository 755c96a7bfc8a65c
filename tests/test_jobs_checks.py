"""Switch-only checks of ``thc controller install`` (a push waits for them; MACs and the
aggregator's address a switch answers with; one MAC one host within a job), and what an
install or remove cut short leaves, on the in-memory switch."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from thc.controller import forwarding, installed, job_entries, jobs, program, targets
from thc.controller.testing.memswitch import MemoryDevice, MemorySwitch
from thc.wire.jobs import SWITCH_AGG_IP, SWITCH_AGG_MAC, ConfigError, Job, Worker
from tests.test_jobs_install import thc_controller
from tests.test_jobs_safety import IDLE, cluster, make_job


@pytest.fixture
def sw():
    s = MemorySwitch().connect()
    yield s
    s.close()


def _save(tmp_path, c, **top) -> str:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({**c.to_dict(), **top}))
    return str(path)


def test_install_push_checks_the_cluster_before_pushing(sw, monkeypatch, capsys, tmp_path):
    """The push (which wipes every job) ran first, then the cluster was refused: nothing
    was left installed."""
    jobs.install_job(sw, make_job(1))
    bad = replace(make_job(2, pool_base=8), mcast_grp=40000)
    mark = len(sw.device.log)
    assert thc_controller(sw.device, monkeypatch, "install", "--push",
                          "--config", _save(tmp_path, cluster(bad))) == 1
    assert "multicast group 40000 outside" in capsys.readouterr().err
    assert sw.device.log[mark:] == [] and 1 in installed.installed_jobs(sw)


@pytest.mark.parametrize("mac", ["00:00:00:00:00:00", "FF:FF:FF:FF:FF:FF"])
def test_a_worker_without_a_mac_is_refused_on_a_switch(sw, mac):
    """Results went to 00:00:00:00:00:00 and every worker waited forever."""
    job = make_job(1)
    job = replace(job, workers=(job.workers[0], replace(job.workers[1], mac=mac)))
    job.validate()                          # a software aggregator takes it
    with pytest.raises(ConfigError, match=f"job 1 worker 1: mac {mac}.*give the worker its "
                                          f"`mac`"):
        jobs.install_cluster(sw, cluster(job))
    assert sw.device.log == []


def test_a_worker_with_a_group_mac_or_no_switch_port_is_refused_on_a_switch(sw):
    """A worker's multicast MAC was installed (a NIC that has not joined the group drops the
    results), and a worker without a switch_port was put on port 0 (the results of every
    worker but port 0's went out there, each chunk then waiting for its resend)."""
    job = make_job(1)
    group = replace(job, workers=(job.workers[0], replace(job.workers[1],
                                                          mac="01:00:5e:00:00:01")))
    with pytest.raises(ConfigError, match="job 1 worker 1: mac 01:00:5e:00:00:01 is a "
                                          "multicast"):
        jobs.install_cluster(sw, cluster(group))
    d = job.to_dict()
    del d["workers"][1]["switch_port"]
    portless = Job.from_dict(d)
    assert portless.workers[1].switch_port is None and "switch_port" not in \
        portless.to_dict()["workers"][1]   # a software aggregator takes it as it is
    with pytest.raises(ConfigError, match=r"job 1: worker\(s\) \[1\] give no switch_port"):
        jobs.install_cluster(sw, cluster(portless))
    assert sw.device.log == []


def test_an_installed_job_given_again_without_a_switch_port_is_refused_on_a_tofino():
    """`thc controller install` first asks whether the switch holds the job as it is; on a
    Tofino that read the worker's pipe from its port (TypeError for None)."""
    from thc.controller.switch import BUILD_DIR
    tna = MemorySwitch(device=MemoryDevice(program="thc_tna", build_dir=BUILD_DIR / "tofino"))
    sw = tna.connect(program=None)
    job = make_job(1)
    job = replace(job, workers=tuple(replace(w, switch_port=256 + w.id) for w in job.workers))
    jobs.install_job(sw, job, live_window=IDLE)
    d = job.to_dict()
    del d["workers"][1]["switch_port"]
    portless = Job.from_dict(d)
    assert not installed.unchanged(sw, portless, jobs.AggAddress.of(cluster(portless)))
    with pytest.raises(ConfigError, match="give no switch_port"):
        jobs.install_cluster(sw, cluster(portless), live_window=IDLE)


@pytest.mark.parametrize("top,why", [
    ({"agg_ip": "127.0.0.1"}, "agg_ip 127.0.0.1"),
    ({"agg_ip": "0.0.0.0"}, "ip 0.0.0.0 is not one host's address"),
    ({"agg_mac": "ff:ff:ff:ff:ff:ff"}, "agg_mac ff"),
    ({"agg_mac": "01:80:c2:00:00:0e"}, "agg_mac 01:80:c2:00:00:0e cannot be a switch's"),
    ({"agg_port": 9999}, "agg_port 9999 is not the switch's")])
def test_an_aggregator_address_no_worker_accepts_is_refused(sw, monkeypatch, capsys, tmp_path,
                                                           top, why):
    config = _save(tmp_path, cluster(make_job(1)), **top)
    assert thc_controller(sw.device, monkeypatch, "install", "--config", config) == 1
    assert why in capsys.readouterr().err
    assert sw.device.log == []


def test_one_mac_names_one_host_within_a_job_too(sw):
    """Two workers of one job under one MAC on two switch ports: l2_forward kept one port."""
    job = make_job(1)
    w0, w1 = job.workers
    two_ports = replace(job, workers=(w0, replace(w1, mac=w0.mac)))
    with pytest.raises(ConfigError, match=f"job 1 worker 1: MAC {w0.mac} belongs to {w0.ip} "
                                          f"on switch port 0 \\(worker 0\\)"):
        jobs.install_job(sw, two_ports)
    one_host = replace(job, workers=(w0, Worker(1, w0.ip, w0.port + 1, w0.mac, 0)))
    jobs.install_job(sw, one_host)         # one host, two UDP ports: fine


@pytest.mark.parametrize("group", [None, 7])
def test_a_remove_cut_short_is_finished_by_the_next(sw, monkeypatch, capsys, group):
    """Its error was the bare write error, with no word of the job left half-removed. The job
    entry, which names the job's group, goes last: a job whose group is not its id is still
    listed, and the next remove deletes that group."""
    job = make_job(1) if group is None else make_job(1, mcast_grp=group)
    jobs.install_job(sw, job)
    groups = sw.device.groups.copy()
    real = sw.device.delete_group

    def lost(group):
        raise jobs.SwitchError("connection reset")
    monkeypatch.setattr(sw.device, "delete_group", lost)
    with pytest.raises(jobs.SwitchError, match=r"job 1: the removal stopped part-way "
                                               r"\(.*connection reset\)\. The job no longer "
                                               r"serves.*remove --job 1"):
        jobs.remove_job(sw, 1, live_window=IDLE)
    monkeypatch.setattr(sw.device, "delete_group", real)
    assert sw.device.groups == groups
    assert thc_controller(sw.device, monkeypatch, "jobs") == 0
    assert "job 1: " in capsys.readouterr().out
    assert thc_controller(sw.device, monkeypatch, "remove", "--job", "1") == 0
    assert installed.installed_jobs(sw) == {} and sw.device.groups == {}
    assert installed.entries_of(sw, program.ADDR_TABLE, 1) == [] and forwarding.routes(sw) == {}


def test_leftovers_without_a_job_entry_are_listed_and_removed(sw, monkeypatch, capsys):
    """An older controller's install cut short left address and lookup entries, a group and
    routes under a job id with no thc_job entry: `jobs` showed nothing, `remove` refused."""
    empty = sw.device.state()
    job = make_job(3)
    job_entries.upsert(sw, job_entries.addr_entries(sw, job, job_entries.AggAddress()))
    job_entries.upsert(sw, job_entries.lut_entries(sw, job, 0))
    job_entries.upsert(sw, [job_entries.install_entry(sw, 3, 7)])
    sw.set_multicast_group(3, [(0, 1)])
    forwarding.install(sw, {w.mac: w.switch_port for w in job.workers})
    assert installed.leftovers(sw) == {3: [program.INSTALL_TABLE, program.ADDR_TABLE,
                                           "lookup tables"]}
    assert thc_controller(sw.device, monkeypatch, "jobs") == 0
    assert "job 3: NOT installed, but entries of it remain in thc_install, thc_worker_addr, " \
           "lookup tables" in capsys.readouterr().out
    assert thc_controller(sw.device, monkeypatch, "remove", "--job", "3") == 0
    assert "removed the leftover entries of job 3" in capsys.readouterr().out
    assert sw.device.state() == empty
    assert thc_controller(sw.device, monkeypatch, "remove", "--job", "3") == 1


def test_jobs_names_entries_that_disagree(sw, monkeypatch, capsys):
    """An install or remove cut short can leave jobs whose entries disagree: a counting job
    without its install entry, pools that overlap, a shared multicast group. `jobs` listed
    them with their parameters and said nothing was wrong."""
    one, two = make_job(1, pool_base=0), make_job(2, pool_base=4)
    jobs.install_cluster(sw, cluster(one, two))
    assert installed.conflicts(sw) == {}
    job_entries.delete(sw, installed.entries_of(sw, program.INSTALL_TABLE, 1))
    cfg = installed.installed_jobs(sw)[2]
    moved = replace(two, pool_base=2, mcast_grp=one.mcast_grp).validate()
    job_entries.upsert(sw, [job_entries.job_entry(sw, moved, cfg["job_index"], cfg["epoch"])])
    wrong = installed.conflicts(sw)
    assert wrong[1][0].startswith("its packets count, but its thc_install entries name "
                                  "epochs [], not its job entry's"), wrong
    assert wrong[1][1:] == ["its slots 0..3 overlap job 2's 2..5",
                            f"it shares multicast group {one.mcast_grp} with job 2"], wrong
    assert wrong[2] == ["its slots 2..5 overlap job 1's 0..3",
                        f"it shares multicast group {one.mcast_grp} with job 1"], wrong
    assert thc_controller(sw.device, monkeypatch, "jobs") == 0
    out = capsys.readouterr().out
    assert "job 2: NOT consistent: its slots 2..5 overlap job 1's 0..3; install the cluster " \
           "again" in out, out
    jobs.install_cluster(sw, cluster(one, two), force=True, live_window=IDLE)
    assert installed.conflicts(sw) == {}


def test_jobs_read_while_another_controller_writes_reads_again(sw, monkeypatch, capsys):
    """`jobs` reads the job, worker and install tables one after another: read while another
    controller re-installed a job, they disagreed for a moment, and it advised installing the
    cluster again. A listing that flags anything is read twice; where the reads differ it
    says the switch is changing and shows the second."""
    jobs.install_cluster(sw, cluster(make_job(1, pool_base=0)))
    real, reads = installed.conflicts, []

    def mid_change(switch):
        reads.append(1)
        return {1: ["its packets count, but its thc_install entries name epochs [...]"]} \
            if len(reads) == 1 else real(switch)
    monkeypatch.setattr(installed, "conflicts", mid_change)
    assert thc_controller(sw.device, monkeypatch, "jobs") == 0
    out = capsys.readouterr().out
    assert len(reads) == 2 and "NOT consistent" not in out, out
    assert "the switch changed while it was read" in out, out


def test_prune_removes_leftovers_the_cluster_lacks(sw):
    job = make_job(3)
    job_entries.upsert(sw, job_entries.addr_entries(sw, job, job_entries.AggAddress()))
    jobs.install_cluster(sw, cluster(make_job(1)), prune=True)
    assert installed.leftovers(sw) == {} and sorted(installed.installed_jobs(sw)) == [1]


@pytest.mark.parametrize("mac", ["ff:ff:ff:ff:ff:ff", "00:00:00:00:00:00"])
def test_l2_add_of_broadcast_is_refused(sw, monkeypatch, capsys, mac):
    """It printed success and wrote nothing."""
    assert thc_controller(sw.device, monkeypatch, "l2", "add", mac, "3") == 2
    assert f"thc controller: l2 add: {mac} is the all-zero or broadcast MAC" \
        in capsys.readouterr().err
    assert sw.device.log == []


@pytest.mark.parametrize("mac", ["0", "0xffffffffffff", "281474976710655", "zz", "aa:bb:cc"])
def test_l2_takes_a_mac_in_one_spelling_only(sw, monkeypatch, capsys, mac):
    """The switch API also reads integers and bare hex, in which the broadcast and all-zero
    MACs went into l2_forward; a malformed MAC failed as "invalid literal for int()"."""
    for op in (("add", mac, "3"), ("del", mac)):
        assert thc_controller(sw.device, monkeypatch, "l2", *op) == 2
        assert f"thc controller: l2 {op[0]}: MAC '{mac}' is not six hex bytes" \
            in capsys.readouterr().err
    assert sw.device.log == []
    with pytest.raises(ValueError, match="not six hex bytes"):
        forwarding.install(sw, {mac: 3})


def test_l2_leaves_the_routes_of_installed_workers_alone(sw, monkeypatch, capsys):
    """l2 del of a worker's MAC took its route from under a job the switch still served;
    l2 add sent its frames out another port. The job's install owns that route."""
    job = make_job(4)
    jobs.install_cluster(sw, cluster(job))
    mac = job.workers[1].mac
    before = forwarding.routes(sw)
    for op in (("add", mac, "9"), ("del", mac)):
        assert thc_controller(sw.device, monkeypatch, "l2", *op) == 1
        assert "is a worker MAC of job(s) [4], whose install keeps its route" \
            in capsys.readouterr().err
    assert forwarding.routes(sw) == before and before[mac] == job.workers[1].switch_port
    assert thc_controller(sw.device, monkeypatch, "l2", "add", "02:aa:00:00:00:01", "9") == 0


@pytest.mark.parametrize("via", ["install_job", "install_cluster"])
def test_routes_that_do_not_fit_l2_forward_are_refused_before_any_write(sw, via):
    """Routes added by hand share l2_forward with the workers': a table one short of the
    workers' MACs stopped an install part-way, after its job, lookup entries and group."""
    size = sw.tables.get(program.L2_TABLE, "table").size
    job = make_job(1)
    forwarding.install(sw, {f"02:aa:00:00:{i >> 8:02x}:{i & 0xff:02x}": 1
                            for i in range(size - job.n_workers + 1)})
    mark = len(sw.device.log)
    with pytest.raises(ConfigError, match=rf"l2_forward holds {size} routes and has "
                                          rf"{size - job.n_workers + 1}: the workers' "
                                          rf"{job.n_workers} new MACs do not fit"):
        if via == "install_job":
            jobs.install_job(sw, job)
        else:
            jobs.install_cluster(sw, cluster(job))
    assert sw.device.log[mark:] == [] and installed.installed_jobs(sw) == {}
    forwarding.remove(sw, ["02:aa:00:00:00:00"])
    jobs.install_job(sw, job)
    assert len(forwarding.routes(sw)) == size


def test_routes_a_prune_frees_make_room_for_the_cluster(sw):
    """A cluster that replaces job 1 by job 2 (prune) on a full l2_forward fits: job 1's
    routes go before job 2's are added. Counted as staying, they refused it."""
    size = sw.tables.get(program.L2_TABLE, "table").size
    old = make_job(1)
    jobs.install_job(sw, old)
    forwarding.install(sw, {f"02:aa:00:00:{i >> 8:02x}:{i & 0xff:02x}": 1
                            for i in range(size - old.n_workers)})
    new = replace(make_job(2, pool_base=8), workers=tuple(
        replace(w, mac=f"02:bb:00:00:00:{w.id + 1:02x}", ip=f"10.9.0.{w.id + 1}")
        for w in make_job(2).workers))
    jobs.install_cluster(sw, cluster(new), prune=True, force=True)
    assert set(installed.installed_jobs(sw)) == {2} and len(forwarding.routes(sw)) == size


@pytest.mark.parametrize("kind", [list, np.array])
def test_a_table_given_as_a_list_or_an_array_installs(sw, kind):
    """The lookup entries' cache keys on the job: an unhashable table failed the install
    after its job and address entries (a TypeError, not the part-way message)."""
    job = make_job(3)
    given = Job(job_id=3, workers=list(job.workers), table=kind(job.table), granularity=30,
                pool_size=4, lanes=256).validate()
    assert given == job and json.loads(json.dumps(given.to_dict())) == job.to_dict()
    jobs.install_job(sw, given)
    assert installed.unchanged(sw, job, job_entries.AggAddress())


def test_leftover_lookup_entries_count_against_the_jobs_the_tables_hold(sw, monkeypatch):
    """A leftover's lookup entries fill the tables as a job's do: the install of one job
    too many failed part-way, and so did the retry its error advised."""
    monkeypatch.setattr(type(targets.get("bmv2")), "max_jobs", lambda self, p4info: 2)
    jobs.install_job(sw, make_job(1))
    left = make_job(3, pool_base=8)
    job_entries.upsert(sw, job_entries.lut_entries(sw, left, 0))
    before = sw.device.state()
    with pytest.raises(ConfigError, match=r"1 removed jobs' lookup entries stay \(\[3\]: "
                                          r"leftovers, `thc controller remove --job N`"):
        jobs.install_job(sw, make_job(5, pool_base=16))
    with pytest.raises(ConfigError, match="removed jobs' lookup entries stay"):
        jobs.install_cluster(sw, cluster(make_job(1), make_job(5, pool_base=16)))
    assert sw.device.state() == before
    jobs.install_cluster(sw, cluster(make_job(5, pool_base=16)), prune=True)
    assert sorted(installed.installed_jobs(sw)) == [5] and installed.leftovers(sw) == {}


@pytest.mark.parametrize("same", ["ip", "mac"])
def test_a_worker_at_the_switchs_own_address_is_refused(sw, same):
    """Its packets to the switch's IP would stay in its own host; frames to the switch's MAC
    would be routed to its port."""
    job = make_job(2)
    w = job.workers[0]
    w = replace(w, ip=SWITCH_AGG_IP) if same == "ip" else replace(w, mac=SWITCH_AGG_MAC)
    job = replace(job, workers=(w, *job.workers[1:])).validate()
    empty = sw.device.state()
    for install in (lambda: jobs.install_job(sw, job),
                    lambda: jobs.install_cluster(sw, cluster(job))):
        with pytest.raises(ConfigError, match="is the switch's own"):
            install()
    assert sw.device.state() == empty


@pytest.mark.parametrize("agg,why", [
    (job_entries.AggAddress(agg_mac="02:00:00:00:00"), "not six hex bytes"),
    (job_entries.AggAddress(agg_ip="255.255.255.255"), "not one host's address"),
    (job_entries.AggAddress(agg_ip="10.0.0"), "not an IPv4 address")])
def test_install_job_checks_the_switchs_address_as_a_cluster_does(sw, agg, why):
    """A malformed agg_mac failed after the job entry; a broadcast agg_ip was installed."""
    empty = sw.device.state()
    with pytest.raises(ConfigError, match=why):
        jobs.install_job(sw, make_job(1), agg)
    assert sw.device.state() == empty


def test_bmv2_refuses_a_job_whose_flush_would_grow_past_512_bytes():
    """A header-only FLUSH comes back as a whole RESULT: 264 lanes of 16-bit sums grow it by
    528 bytes, past what BMv2 allots a packet (a program generated for 264 lanes took such a
    job); 8-bit sums of 264 lanes and 16-bit of 256 fit."""
    from thc.controller.targets.bmv2 import Bmv2
    job = make_job(3)
    for lanes, bits in ((264, 8), (256, 16)):
        Bmv2().check_job(replace(job, lanes=lanes, sum_bits=bits))
    with pytest.raises(ConfigError, match="job 3: 264 lanes of 16-bit sums grow a FLUSH by 528"):
        Bmv2().check_job(replace(job, lanes=264, sum_bits=16))


def test_jobs_of_one_cluster_that_clash_are_refused_before_any_write(sw):
    """Each job of a cluster is checked against the others as against those on the switch:
    two on one multicast group would take each other's results; one MAC on two ports would
    route one host's frames to the other."""
    one = make_job(1, mcast_grp=1)
    for two, why in ((make_job(2, pool_base=8, mcast_grp=1), "multicast group 1"),
                     (make_job(2, pool_base=8, mac=one.workers[1].mac), "02:00:00:01")):
        before, mark = sw.device.state(), len(sw.device.log)
        with pytest.raises(ConfigError, match=why):
            jobs.install_cluster(sw, cluster(one, two))
        assert sw.device.log[mark:] == [] and sw.device.state() == before


def test_an_install_cut_short_before_its_workers_went_live_is_finished_by_the_next(
        sw, monkeypatch):
    """Its RESETs lost, a cluster install stops before the worker entries; the next one
    finds the job's other entries in place and must not leave it as it is, without
    workers (every round would wait to its deadline)."""
    import functools
    job = make_job(1)
    deliver = sw.device.packet_out
    monkeypatch.setattr(sw.device, "packet_out", lambda frame: None)
    monkeypatch.setattr(jobs, "reset_pool", functools.partial(jobs.reset_pool, timeout=0.05))
    with pytest.raises(jobs.SwitchError, match="slot resets"):
        jobs.install_cluster(sw, cluster(job))
    assert installed.entries_of(sw, program.WORKER_TABLE, 1) == []
    monkeypatch.setattr(sw.device, "packet_out", deliver)
    jobs.install_cluster(sw, cluster(job), live_window=IDLE)
    assert len(installed.entries_of(sw, program.WORKER_TABLE, 1)) == job.n_workers


@pytest.mark.parametrize("change", ["install", "remove"])
def test_a_controller_displaced_during_a_changes_last_write_says_so(sw, monkeypatch, change):
    """Another controller took the switch while the change's last batch was written (the
    worker entries of an install, the job entry of a remove): that batch may have landed on
    what the other one wrote, and the command must not end as if it were done."""
    from thc.controller.switch import Displaced
    job = make_job(1)
    if change == "remove":
        jobs.install_job(sw, job)
    last = ("INSERT", program.WORKER_TABLE) if change == "install" else \
        ("DELETE", program.JOB_TABLE)
    real = sw.device.write

    def write(op, entity):
        real(op, entity)
        event = sw.device.log[-1]
        if (event.op, str(event.target).rsplit(".", 1)[-1]) == last:
            sw._taken_by = (9, 0)
    monkeypatch.setattr(sw.device, "write", write)
    with pytest.raises(Displaced, match=r"another controller \(election id \(9, 0\)\)"):
        if change == "install":
            jobs.install_job(sw, job)
        else:
            jobs.remove_job(sw, 1, live_window=IDLE)
