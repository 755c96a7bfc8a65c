"""The committed P4 build (p4src/build) is current and follows host/wire/protocol.json. No p4c
needed."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from thc.controller import toolchain
from thc.controller.testing.variant import build_variant, generator
from thc.wire import protocol as P

from tests import verified

ROOT = Path(__file__).resolve().parent.parent
P4SRC = ROOT / "p4src"
BUILD = P4SRC / "build"


gen = generator()


def _p4info(name: str):
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2
    info = p4info_pb2.P4Info()
    text_format.Merge((BUILD / f"{name}.p4info.txt").read_text(), info)
    return info


def _by_short_name(objs):
    return {o.preamble.name.rsplit(".", 1)[-1]: o for o in objs}


def _header_fields(text: str, header: str) -> list[tuple[str, int]]:
    body = re.search(r"header\s+" + header + r"\s*\{(.*?)\}", text, re.S)
    assert body, f"header {header} not found"
    consts = {"THC_INDEX_BITS": P.INDEX_BITS}
    out = []
    for width, name in re.findall(r"bit<(\w+)>\s+(\w+);", body.group(1)):
        out.append((name, int(consts.get(width, width))))
    return out


def test_committed_build_is_not_stale():
    problems = gen.check()
    assert not problems, "p4src/build is stale:\n" + "\n".join(problems)


def test_check_names_the_stale_file(tmp_path):
    """gen_p4.py --check exits non-zero and names protocol.json when it changed."""
    shutil.copytree(P4SRC, tmp_path / "p4src", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "host" / "wire").mkdir(parents=True)
    spec = json.loads((ROOT / "host" / "wire" / "protocol.json").read_text())
    spec["udp_port"] += 1
    (tmp_path / "host" / "wire" / "protocol.json").write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, str(tmp_path / "p4src" / "gen_p4.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "host/wire/protocol.json" in r.stderr
    assert "thc_constants.p4" in r.stderr


def test_generated_headers_follow_protocol_json():
    text = (P4SRC / "generated" / "thc_headers.p4").read_text()
    assert _header_fields(text, "thc_h") == P.HEADER_FIELDS


def test_lane_group_headers_hold_the_wire_payloads():
    """A lane group's DATA bytes and RESULT words, times THC_GROUPS, are the payloads."""
    text = (P4SRC / "thc_common.p4").read_text()
    group = 8
    data = _header_fields(text, "thc_idx_h")
    assert sum(w for _, w in data) == group * P.INDEX_BITS
    for width, header in ((8, "thc_sum8_h"), (16, "thc_sum16_h")):
        words = _header_fields(text, header)
        assert {w for _, w in words} == {32}
        assert sum(w for _, w in words) == group * width
    assert _header_fields(text, "thc_max_h") == [("v", 32)]


def test_generated_constants_follow_protocol_json():
    text = (P4SRC / "generated" / "thc_constants.p4").read_text()
    consts = dict(re.findall(r"const bit<\d+> (\w+) = (\w+);", text))
    defines = dict(re.findall(r"#define (\w+) (\d+)\n", text))
    assert int(consts["THC_UDP_PORT"]) == P.UDP_PORT
    assert int(consts["THC_CPU_PORT"]) == P.CPU_PORT
    assert int(consts["THC_HDR_BYTES"]) == P.HEADER_BYTES
    for t in P.PktType:
        assert int(consts[f"THC_{t.name}"]) == t.value
    for r in P.DropReason:
        assert int(consts[f"THC_DROP_{r.name.upper()}"]) == r.value
    for name, idx in P.JOB_COUNTERS.items():
        assert int(consts[f"THC_JC_{name.upper()}"]) == idx
    assert int(defines["THC_LANES"]) == P.LANES
    assert int(defines["THC_MAX_LANES"]) == P.MAX_LANES
    assert int(defines["THC_SWITCH_SLOTS"]) == P.SWITCH_SLOTS
    assert int(defines["THC_MAX_JOBS"]) == P.MAX_JOBS
    assert int(consts["THC_UDP_LEN_DATA"]) == 8 + P.HEADER_BYTES + P.payload_bytes(P.PktType.DATA)
    for bits in P.SUM_WIDTHS:
        assert int(consts[f"THC_UDP_LEN_RESULT{bits}"]) == (
            8 + P.HEADER_BYTES + P.payload_bytes(P.PktType.RESULT, P.LANES, bits))
    assert int(defines["THC_GROUPS"]) * 8 == P.LANES
    assert int(consts["THC_UDP_LEN_MAX"]) == 8 + P.HEADER_BYTES + P.payload_bytes(P.PktType.MAX)
    assert int(consts["THC_UDP_LEN_VOTE"]) == 8 + P.HEADER_BYTES + P.payload_bytes(
        P.PktType.DATA, aggregation="vote")
    for name, code in P.AGGREGATIONS.items():
        assert int(consts[f"THC_AGG_{name.upper()}"]) == code


@pytest.mark.parametrize("program", ["thc.p4", "thc_tna.p4"])
def test_programs_take_the_configuration_tag_from_the_epochs_high_bits(program):
    """The upstream tag (the bitmap's low bits) is compared with the install's epoch above
    protocol.py's EPOCH_TAG_SHIFT, written as slices in each program (no generated constant)."""
    s = P.EPOCH_TAG_SHIFT
    text = (P4SRC / program).read_text()
    assert re.search(rf"hdr\.thc\.bitmap\[{s - 1}:0\] *(!=|\^) *(meta\.)?epoch\[31:{s}\]",
                     text), f"{program} compares no bitmap[{s - 1}:0] with epoch[31:{s}]"


def test_generator_only_instantiates_the_lane_group():
    files = gen.generate(gen.load_spec(), lanes=16)
    assert files["thc_groups.p4"].count("ThcLaneGroup() thc_g") == 2
    assert files["thc_groups.p4"].count("ThcMaxLane() thc_m") == P.MAX_LANES
    assert files["thc_groups_apply.p4"].count(".apply(hdr.thc_data[") == 2
    assert files["thc_max_apply.p4"].count(".apply(hdr.thc_max[") == P.MAX_LANES
    # the payload is extracted element by element (BMv2 runs a .next loop state by state)
    assert files["thc_parse_data.p4"].count("packet.extract(hdr.thc_data[") == 2
    assert files["thc_parse_max.p4"].count("packet.extract(hdr.thc_max[") == P.MAX_LANES
    for name, text in files.items():
        assert "register" not in text and "table " not in text, name
    # the lane group and the Tofino word are written once, by hand
    text = (P4SRC / "thc.p4").read_text()
    assert len(re.findall(r"^control ThcLaneGroup\(", text, re.M)) == 1
    text = (P4SRC / "thc_tna.p4").read_text()
    assert len(re.findall(r"^#define THC_WORD\(", text, re.M)) == 1
    with pytest.raises(SystemExit, match="groups"):
        gen.generate(gen.load_spec(), lanes=12)


def test_tofino_words_read_their_own_bytes():
    """Each Tofino word's two lookups read its own index bytes of a pass and fill its own
    halves of its own result word (where every lane of a packet goes, pass by pass, is
    tests/test_tna_lanes.py's)."""
    files = gen.generate(gen.load_spec())
    tna = gen.gen_tna
    luts = re.findall(r"action thc_w(\d+)_lut_set_(\d)\(bit<16> value\) \{ (\S+) = value; \}"
                      r".*?hdr\.cur\[(\d+)\]\.idx\[(\d+):(\d+)\]", files["thc_tna_luts.p4"],
                      re.S)
    assert len(luts) == 2 * tna.WORDS
    for w, h, dst, oct_, hi, lo in luts:
        w, h = int(w), int(h)
        assert int(hi) - int(lo) == 7
        assert int(oct_) * 32 + 31 - int(hi) == 16 * w + 8 * h     # the word's own byte
        assert dst == f"hdr.res[{w}].w[{31 - 16 * h}:{16 - 16 * h}]"
    applied = re.findall(r"thc_w(\d+)\.apply\(hdr\.res\[(\d+)\]", files["thc_tna_words_apply.p4"])
    assert [(int(w), int(r)) for w, r in applied] == [(w, w) for w in range(tna.WORDS)]
    parse = files["thc_tna_parse.p4"]
    max_state = parse.split("state parse_max")[1].split("state")[0]
    assert max_state.count("pkt.extract(hdr.res[") == P.MAX_LANES
    with pytest.raises(SystemExit, match="words"):
        tna.check({**gen.load_spec(), "lanes": 512})


def test_p4info_has_the_shared_names():
    info = _p4info("thc")
    tables = _by_short_name(info.tables)
    for name in ("thc_job", "thc_worker", "thc_worker_addr", "l2_forward"):
        assert name in tables, name
    assert [f.name for f in tables["thc_job"].match_fields] == ["job_id"]
    assert [f.name for f in tables["thc_worker"].match_fields] == [
        "job_id", "worker_id", "src_ip", "src_port", "ingress_port"]
    assert [f.name for f in tables["thc_worker_addr"].match_fields] == ["job_id", "worker_id"]
    luts = sorted(t.preamble.name for t in info.tables if ".thc_lut_" in t.preamble.name)
    assert luts == sorted(f"ThcIngress.thc_g{g}.thc_lut_{b}"
                          for g in range(P.LANES // 8) for b in range(4))
    lut = next(t for t in info.tables if t.preamble.name == "ThcIngress.thc_g0.thc_lut_0")
    assert [(f.name, f.bitwidth) for f in lut.match_fields] == [("job_id", 16), ("idx", 8)]
    actions = {a.preamble.name: a for a in info.actions}
    assert [p.name for p in _by_short_name(info.actions)["set_job"].params] == [
        "job_index", "n_workers", "pool_base", "pool_size", "full_bitmap", "mcast_grp",
        "sum_bits", "epoch", "aggregation"]
    for name in ("thc_lut_set_0", "thc_lut_sum8", "thc_lut_sum16"):
        lut_set = actions[f"ThcIngress.thc_g0.{name}"]
        assert [(p.name, p.bitwidth) for p in lut_set.params] == [("value", 32)]
    counters = _by_short_name(info.counters)
    assert counters["thc_drops"].size == max(r.value for r in P.DropReason) + 1
    assert counters["thc_job_counters"].size == P.MAX_JOBS * len(P.JOB_COUNTERS)
    assert counters["thc_resets"].size == P.MAX_JOBS
    registers = {r.preamble.name: r for r in info.registers}
    short = _by_short_name(info.registers)
    for name in ("thc_run", "thc_seq", "thc_bitmap", "thc_count"):
        assert short[name].size == 2 * P.SWITCH_SLOTS
    assert short["thc_job_run"].size == P.MAX_JOBS
    sums = [n for n in registers if ".thc_sum_" in n]
    maxes = [n for n in registers if n.endswith(".thc_max")]
    assert len(sums) == P.LANES // 8 * 4 and len(maxes) == P.MAX_LANES
    assert {registers[n].type_spec.bitstring.bit.bitwidth for n in sums} == {32}
    # no controller packet header: RESET packet-outs are raw frames
    assert not info.controller_packet_metadata


def test_bmv2_json_header_matches_protocol():
    j = json.loads((BUILD / "thc.json").read_text())
    types = {h["name"]: h for h in j["header_types"]}
    assert [(f[0], f[1]) for f in types["thc_h"]["fields"]] == P.HEADER_FIELDS


def test_bmv2_json_gives_each_dscp_its_class_priority():
    """DLCP on the switch, read from the compiled program: DSCP 0 and every DSCP the protocol
    does not name set priority 0 (best effort; a miss is counted), class i's DSCP priority
    i + 1 (tests/bmv2/test_switch_dscp.py sends each through BMv2)."""
    j = json.loads((BUILD / "thc.json").read_text())
    table = next(t for pl in j["pipelines"] for t in pl["tables"]
                 if t["name"].endswith(".thc_dscp"))
    actions = {a["id"]: a for a in j["actions"]}

    def sets_priority(action) -> list:
        return [p["parameters"][1] for p in action["primitives"] if p["op"] == "assign"
                and p["parameters"][0]["value"] == ["standard_metadata", "priority"]]
    got = {}
    for entry in table["entries"]:
        action = actions[entry["action_entry"]["action_id"]]
        assert sets_priority(action) == [{"type": "runtime_data", "value": 0}], action
        got[int(entry["match_key"][0]["key"], 16)] = int(entry["action_entry"]["action_data"][0],
                                                         16)
    assert got == {0: 0, **{d: i + 1 for i, d in enumerate(P.PRIORITY_DSCP)}}
    miss = actions[table["default_entry"]["action_id"]]
    assert sets_priority(miss) == [{"type": "hexstr", "value": "0x00"}], miss
    assert len(P.PRIORITY_DSCP) + 1 == P.PRIORITY_QUEUES


def test_l2_program_shares_the_forwarding_table():
    thc = _by_short_name(_p4info("thc").tables)["l2_forward"]
    l2 = _by_short_name(_p4info("l2").tables)["l2_forward"]
    assert [(f.name, f.bitwidth) for f in thc.match_fields] == [(f.name, f.bitwidth)
                                                                for f in l2.match_fields]
    thc_actions = _by_short_name(_p4info("thc").actions)
    l2_actions = _by_short_name(_p4info("l2").actions)
    for a in ("l2_set_port", "l2_miss"):
        assert [p.name for p in thc_actions[a].params] == [p.name for p in l2_actions[a].params]


def test_a_p4c_with_one_back_end_compiles_only_for_it(monkeypatch):
    """A p4c package built with the Tofino back end alone ran the BMv2 tests, which failed
    on p4c's usage message instead of skipping."""
    have = {"p4c", "p4c-barefoot", "bfas"}
    monkeypatch.setattr(toolchain.shutil, "which", lambda b: f"/bin/{b}" if b in have else None)
    assert "p4c-bm2-ss" in toolchain.p4c_missing() and toolchain.tofino_missing() is None
    have = {"p4c", "p4c-bm2-ss"}
    assert toolchain.p4c_missing() is None and "p4c-barefoot" in toolchain.tofino_missing()
    have = set()
    assert toolchain.p4c_missing() == toolchain.tofino_missing()
    assert "p4c is not on PATH" in toolchain.tofino_missing()


@pytest.mark.skipif(toolchain.p4c_missing() is not None, reason=f"{toolchain.p4c_missing()}")
def test_small_variant_compiles(tmp_path):
    """The generator's output compiles for another lane count (p4c only)."""
    build_variant(tmp_path, lanes=16, slots=16)
    assert (tmp_path / "thc.json").stat().st_size and (tmp_path / "thc.p4info.txt").exists()


@pytest.mark.skipif(toolchain.p4c_missing() is not None, reason=f"{toolchain.p4c_missing()}")
def test_bmv2_program_compiles_as_committed(tmp_path, request, record_property):
    """p4c compiles today's thc.p4 into the committed JSON and P4Info, byte for byte but the
    JSON's own output path: the committed build is what its sources give (p4c only; another
    p4c version than the recorded one may write them otherwise). Passed once, it is
    remembered for the same inputs (tests/verified.py)."""
    recorded = json.loads((BUILD / "SOURCES.json").read_text())["p4c"]
    if gen.p4c_version() != recorded:
        pytest.skip(f"p4c is {gen.p4c_version()!r}, the build was recorded with {recorded!r}")
    digest = verified.key([*gen.source_files(), BUILD / "thc.json", BUILD / "thc.p4info.txt",
                           Path(__file__).resolve(), Path(verified.__file__).resolve(),
                           *verified.toolchain_files(gen.p4c_binary(), "p4c-bm2-ss")])
    if verified.passed_before("bmv2-compile", digest, request, record_property):
        return
    start = time.monotonic()
    out = tmp_path / "build"
    r = subprocess.run([gen.p4c_binary(), "--target", "bmv2", "--arch", "v1model", "-o",
                        str(out), "--p4runtime-files", str(out / "thc.p4info.txt"),
                        "p4src/thc.p4"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "thc.p4info.txt").read_text() == (BUILD / "thc.p4info.txt").read_text()
    built, committed = (json.loads(p.read_text()) for p in (out / "thc.json",
                                                             BUILD / "thc.json"))
    assert built.pop("program") == str(out / "thc.p4i")
    assert committed.pop("program") == "p4src/build/thc.p4i"
    assert built == committed, "p4src/build/thc.json is not what p4c makes of thc.p4"
    verified.remember("bmv2-compile", digest, compiler=recorded,
                      seconds=time.monotonic() - start)


def test_committed_tofino_report_is_not_stale():
    """The committed Tofino resource summary and P4Info were made from today's TNA program
    (source hashes against the record: no compiler needed)."""
    problems = gen.check_tofino()
    assert not problems, "p4src/build/tofino is stale:\n" + "\n".join(problems)


def _tofino_inputs() -> list[Path]:
    """Everything a Tofino compile's verdict here depends on (tests/verified.py)."""
    rec = json.loads(gen.TOFINO_REPORT.read_text())
    return (gen.tofino_sources() + sorted((P4SRC / "generated").glob("*.p4"))
            + [gen.TOFINO_REPORT]
            + [ROOT / name for name in sorted(rec.get("outputs", {}))]
            + [Path(__file__).resolve(), Path(verified.__file__).resolve()]
            + verified.toolchain_files(gen.p4c_binary(), "p4c-barefoot", "bfas"))


@pytest.mark.slow
@pytest.mark.timeout(1200)   # 89 s alone on a 2-core VM (docs/switch.md), more in the suite
@pytest.mark.skipif(toolchain.tofino_missing() is not None,
                    reason=f"{toolchain.tofino_missing()}")
def test_tofino_program_compiles_as_recorded(tmp_path, request, record_property):
    """p4c's Tofino back end compiles and assembles today's TNA program (``tofino.bin``) into
    the stages, tables, memories and PHV the committed report records, with its P4Info.
    Passed once, it is remembered for the same inputs (tests/verified.py)."""
    digest = verified.key(_tofino_inputs())
    if verified.passed_before("tofino-compile", digest, request, record_property):
        return
    start = time.monotonic()
    out = tmp_path / "out"
    rc = gen.tofino_report.compile_tofino(out)
    assert rc == 0, (tmp_path / "compile.log").read_text()[-4000:]
    assert (out / "pipe" / "tofino.bin").stat().st_size > 0
    rec = json.loads(gen.TOFINO_REPORT.read_text())
    assert rec["compiled"] is True and rec["lanes"] == P.LANES
    assert gen.tofino_report.tofino_summary(out) == rec["summary"]
    committed = (BUILD / "tofino" / "thc_tna.p4info.txt").read_text()
    assert (out / "thc_tna.p4info.txt").read_text() == committed
    verified.remember("tofino-compile", digest, compiler=rec["compiler"],
                      seconds=time.monotonic() - start)


def test_recording_an_unchanged_compile_changes_no_file(tmp_path, monkeypatch):
    """`make p4-tofino` rewrote the committed resources.json at every compile: its build date
    and run id differ each time. A log that differs only there is kept as committed; one
    that differs anywhere else is replaced."""
    report = gen.tofino_report
    monkeypatch.setattr(report, "TOFINO_DIR", tmp_path / "tofino")
    monkeypatch.setattr(report, "TOFINO_REPORT", tmp_path / "tofino" / "REPORT.json")
    monkeypatch.setattr(report, "p4c_version", lambda: "p4c test")
    out = tmp_path / "out"
    out.mkdir()
    (out / "rc").write_text("0\n")

    def compile_once(date: str, stages: list) -> bytes:
        doc = {"build_date": date, "run_id": date[::-1], "program_name": "thc_tna.p4",
               "resources": {"mau": {"mau_stages": stages}}}
        (out / "resources.json").write_text(json.dumps(doc))
        report.record_tofino(out)
        return (tmp_path / "tofino" / "resources.json").read_bytes()

    first = compile_once("Mon Dec  1", [])
    assert compile_once("Tue Dec  2", []) == first
    stage = {"stage_number": 0, "logical_tables": {"ids": [1]}, "meter_alus": {"meters": []},
             "rams": {"srams": []}, "tcams": {"tcams": []}}
    changed = compile_once("Wed Dec  3", [stage])
    assert b"Wed Dec  3" in changed and b"stage_number" in changed
    assert json.loads((tmp_path / "tofino" / "REPORT.json").read_text())["compiled"] is True


def test_tofino_check_names_the_changed_source(tmp_path, monkeypatch):
    """check_tofino reports a missing report, and a source changed after the record."""
    monkeypatch.setattr(gen.tofino_report, "TOFINO_REPORT", tmp_path / "REPORT.json")
    assert "make p4-tofino" in gen.check_tofino()[0]
    (tmp_path / "REPORT.json").write_text(json.dumps({
        "sources": {gen.rel(p): gen.sha256(p) for p in gen.tofino_sources()}, "outputs": {}}))
    assert gen.check_tofino() == []
    rec = json.loads((tmp_path / "REPORT.json").read_text())
    rec["sources"]["p4src/thc_tna.p4"] = "0" * 64
    (tmp_path / "REPORT.json").write_text(json.dumps(rec))
    assert any("p4src/thc_tna.p4" in p for p in gen.check_tofino())


def test_logging_macro_build_is_recognised_by_its_log_messages(tmp_path, monkeypatch):
    """A simple_switch_grpc whose code carries BMv2's per-packet log format strings was
    configured without --disable-logging-macros (a stand-in binary: a real slow build is
    not installed here)."""
    from thc.controller import toolchain
    fake = tmp_path / "simple_switch_grpc"
    fake.write_bytes(b"\x7fELF..." + toolchain.LOGGING_MACRO_MARK + b" {}\x00")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert toolchain.bmv2_logging_macros() == str(fake)
    fake.write_bytes(b"\x7fELF... no log messages\x00")
    assert toolchain.bmv2_logging_macros() is None
