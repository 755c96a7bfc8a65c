"""The committed P4 build (p4src/build) is current and follows host/wire/protocol.json. No p4c needed."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controller import toolchain
from host.wire import protocol as P

ROOT = Path(__file__).resolve().parent.parent
P4SRC = ROOT / "p4src"
BUILD = P4SRC / "build"


def _load_gen():
    spec = importlib.util.spec_from_file_location("gen_p4", P4SRC / "gen_p4.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_gen()


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
    consts = {"THC_INDEX_BITS": P.INDEX_BITS, "THC_SUM_BITS": P.SUM_BITS}
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
    assert _header_fields(text, "thc_data_h") == [(f"idx_{i}", P.INDEX_BITS)
                                                  for i in range(P.LANES)]
    assert _header_fields(text, "thc_result_h") == [(f"sum_{i}", P.SUM_BITS)
                                                    for i in range(P.LANES)]
    assert _header_fields(text, "thc_max_h") == [(f"max_{i}", 32) for i in range(P.MAX_LANES)]


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
    assert int(consts["THC_UDP_LEN_RESULT"]) == 8 + P.HEADER_BYTES + P.payload_bytes(P.PktType.RESULT)
    assert int(consts["THC_UDP_LEN_MAX"]) == 8 + P.HEADER_BYTES + P.payload_bytes(P.PktType.MAX)


def test_generator_instantiates_one_template_per_lane():
    files = gen.generate(gen.load_spec(), lanes=6)
    lanes = files["thc_lanes.p4"]
    assert len(re.findall(r"^table thc_lut_\d+ ", lanes, re.M)) == 6
    assert len(re.findall(r"^register<bit<THC_SUM_BITS>>\(THC_REG_SIZE\) thc_sum_\d+;", lanes, re.M)) == 6
    assert len(re.findall(r"^register<bit<32>>\(THC_REG_SIZE\) thc_max_\d+;", lanes, re.M)) == P.MAX_LANES
    assert files["thc_lanes_apply.p4"].count(".apply();") == 6
    # every lane's code is the template with its number: strip the numbers and all agree
    blocks = re.findall(r"(action thc_lut_set_\d+.*?\n\}\ntable thc_lut_\d+ \{.*?\n\}\n)", lanes, re.S)
    assert len({re.sub(r"_\d+\b", "_N", b) for b in blocks}) == 1


def test_p4info_has_the_shared_names():
    info = _p4info("thc")
    tables = _by_short_name(info.tables)
    for name in ("thc_job", "thc_worker", "thc_worker_addr", "l2_forward"):
        assert name in tables, name
    assert [f.name for f in tables["thc_job"].match_fields] == ["job_id"]
    assert [f.name for f in tables["thc_worker"].match_fields] == ["job_id", "worker_id",
                                                                    "src_ip", "src_port"]
    assert [f.name for f in tables["thc_worker_addr"].match_fields] == ["job_id", "worker_id"]
    luts = sorted(int(n.split("_")[-1]) for n in tables if n.startswith("thc_lut_"))
    assert luts == list(range(P.LANES))
    lut = tables["thc_lut_0"]
    assert [(f.name, f.bitwidth) for f in lut.match_fields] == [("job_id", 16),
                                                                ("idx", P.INDEX_BITS)]
    actions = _by_short_name(info.actions)
    assert [p.name for p in actions["set_job"].params] == [
        "job_index", "n_workers", "pool_base", "pool_size", "full_bitmap", "mcast_grp"]
    assert [p.name for p in actions["thc_lut_set_0"].params] == ["value"]
    assert actions["thc_lut_set_0"].params[0].bitwidth == P.SUM_BITS
    counters = _by_short_name(info.counters)
    assert counters["thc_drops"].size == max(r.value for r in P.DropReason) + 1
    assert counters["thc_job_counters"].size == P.MAX_JOBS * len(P.JOB_COUNTERS)
    assert counters["thc_resets"].size == P.MAX_JOBS
    registers = _by_short_name(info.registers)
    for name in ("thc_seq", "thc_bitmap", "thc_count"):
        assert registers[name].size == 2 * P.SWITCH_SLOTS
    sums = [n for n in registers if n.startswith("thc_sum_")]
    maxes = [n for n in registers if n.startswith("thc_max_")]
    assert len(sums) == P.LANES and len(maxes) == P.MAX_LANES
    assert registers["thc_sum_0"].type_spec.bitstring.bit.bitwidth == P.SUM_BITS
    # no controller packet header: RESET packet-outs are raw frames
    assert not info.controller_packet_metadata


def test_bmv2_json_header_matches_protocol():
    j = json.loads((BUILD / "thc.json").read_text())
    types = {h["name"]: h for h in j["header_types"]}
    assert [(f[0], f[1]) for f in types["thc_h"]["fields"]] == P.HEADER_FIELDS


def test_l2_program_shares_the_forwarding_table():
    thc = _by_short_name(_p4info("thc").tables)["l2_forward"]
    l2 = _by_short_name(_p4info("l2").tables)["l2_forward"]
    assert [(f.name, f.bitwidth) for f in thc.match_fields] == [(f.name, f.bitwidth)
                                                                for f in l2.match_fields]
    thc_actions = _by_short_name(_p4info("thc").actions)
    l2_actions = _by_short_name(_p4info("l2").actions)
    for a in ("l2_set_port", "l2_miss"):
        assert [p.name for p in thc_actions[a].params] == [p.name for p in l2_actions[a].params]


@pytest.mark.skipif(toolchain.p4c_missing() is not None, reason=f"{toolchain.p4c_missing()}")
def test_small_variant_compiles(tmp_path):
    """The generator's output compiles for another lane count (p4c only)."""
    main = gen.write_variant(tmp_path / "v", lanes=4, slots=16)
    r = subprocess.run(["p4c", "--target", "bmv2", "--arch", "v1model", "-o", str(tmp_path),
                        "--p4runtime-files", str(tmp_path / "v.p4info.txt"), str(main)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
