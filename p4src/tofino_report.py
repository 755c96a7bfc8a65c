"""The committed record of a Tofino compile (p4src/build/tofino/): the compiler's verdict,
resource summary and P4Info with the hashes of what it compiled, written by `make p4-tofino`
(gen_p4.py --compile-tofino) and checked without a compiler (gen_p4.py --check-tofino), and
compiled again by the tests where the Tofino back end is installed."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import gen_tna
from p4files import (BUILD_DIR, COMMON_P4, P4SRC, PROTOCOL_JSON, ROOT, TNA_P4, load_spec,
                     p4c_binary, p4c_version, rel, sha256)

TOFINO_DIR = BUILD_DIR / "tofino"
TOFINO_REPORT = TOFINO_DIR / "REPORT.json"
TOFINO_LOGS = ("mau.resources.log", "resources.json", "metrics.json", "thc_tna.p4info.txt")


def tofino_sources() -> list[Path]:
    """What the Tofino compile depends on: the generated files are a function of these."""
    return [TNA_P4, COMMON_P4, P4SRC / "gen_p4.py", P4SRC / "gen_tna.py", P4SRC / "p4files.py",
            Path(__file__).resolve(), PROTOCOL_JSON]


def compile_tofino(out: Path) -> int:
    """Compile the TNA program into ``out`` (P4Info, resource logs, ``pipe/tofino.bin``);
    write the exit status to ``out``/rc and the log beside ``out`` (compile.log).

    Two steps: ``p4c -S`` (the back end) then the assembler, ``bfas``, as p4c's driver runs
    it. The driver of p4c 1.2.5.16 (34b86e9) stops with a Python error (a Path where it
    wants a str) before it assembles, so the project calls the assembler itself."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / "compile.log"
    steps = [
        [p4c_binary(), "-S", "--target", "tofino", "--arch", "tna", "--verbose", "1", "-o",
         str(out), "--p4runtime-files", str(out / "thc_tna.p4info.txt"),
         "--p4runtime-force-std-externs", str(TNA_P4)],
        [shutil.which("bfas") or "bfas", "--no-warn", "--target", "tofino",
         "--table-handle-offset0", "-o", str(out / "pipe"), str(out / "pipe" / "thc_tna.bfa")],
    ]
    rc = 0
    with open(log, "w") as f:
        for cmd in steps:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
            except OSError as e:
                f.write(f"{e}\n")
                rc = 127
            if rc:
                break
    (out / "rc").write_text(f"{rc}\n")
    return rc


def tofino_summary(out: Path) -> dict:
    """Per MAU stage of a successful compile: logical tables, stateful ALUs, SRAM and TCAM
    blocks (from the compiler's resources.json), and the PHV the allocation used (from its
    last phv_allocation_summary log); empty where the compile stopped before."""
    res = next(iter(sorted(out.rglob("resources.json"))), None)
    stages = []
    if res is not None:
        mau = json.loads(res.read_text())["resources"]["mau"]
        for st in sorted(mau.get("mau_stages", []), key=lambda s: s["stage_number"]):
            stages.append({
                "stage": st["stage_number"],
                "logical_tables": len(st["logical_tables"]["ids"]),
                "stateful_alus": len(st["meter_alus"]["meters"]),
                "srams": len(st["rams"]["srams"]),
                "tcams": len(st["tcams"]["tcams"]),
            })
    phv = {}
    logs = sorted(out.rglob("phv_allocation_summary_*.log"), key=lambda p: p.stat().st_mtime)
    if logs:
        for line in logs[-1].read_text(errors="replace").splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells and cells[0] in ("Usage for 8b", "Usage for 16b", "Usage for 32b",
                                      "Overall PHV Usage"):
                phv[cells[0]] = {"containers_used": cells[1], "bits_used": cells[2],
                                 "bits_used_ingress": cells[3],
                                 "bits_used_egress": cells[4], "bits_available": cells[-1]}
    totals = {k: sum(s[k] for s in stages)
              for k in ("logical_tables", "stateful_alus", "srams", "tcams")}
    return {"stages_used": len([s for s in stages if s["logical_tables"]]),
            "totals": totals, "stages": stages, "phv": phv}


COMPILE_STAMPS = ("build_date", "run_id")
"""Fields of the compiler's JSON logs that differ at every compile of the same program."""


def _unstamped(data: bytes):
    """A log's content without its compile stamps: a log that differs from the committed one
    only in them is kept as committed, so recompiling an unchanged program changes no file."""
    try:
        doc = json.loads(data)
    except ValueError:
        return data
    return {k: v for k, v in doc.items() if k not in COMPILE_STAMPS} \
        if isinstance(doc, dict) else doc


def record_tofino(out: Path) -> None:
    """Commit-ready resource summary and P4Info of the Tofino compile whose output is in
    ``out``."""
    found = {}
    for path in sorted(Path(out).rglob("*")):
        if path.name in TOFINO_LOGS and path.is_file() and path.name not in found:
            found[path.name] = path
    if not found:
        raise SystemExit(f"gen_p4 --record-tofino: none of {list(TOFINO_LOGS)} under {out}; "
                         f"did `p4c --target tofino --arch tna -o {out}` succeed?")
    TOFINO_DIR.mkdir(parents=True, exist_ok=True)
    before = {p.name: p.read_bytes() for p in TOFINO_DIR.iterdir()}
    for stale in TOFINO_DIR.iterdir():
        stale.unlink()
    for name, path in found.items():
        new = path.read_bytes()
        keep = name in before and _unstamped(before[name]) == _unstamped(new)
        (TOFINO_DIR / name).write_bytes(before[name] if keep else new)
    # the compiler's verdict (make p4-tofino writes its exit status and log beside <out>)
    rc_file, log_file = Path(out) / "rc", Path(out).parent / "compile.log"
    rc = int(rc_file.read_text()) if rc_file.exists() else None
    errors = []
    if log_file.exists():
        for line in log_file.read_text(errors="replace").splitlines():
            line = line.replace(str(Path(out).parent), "<out>")
            if "error" in line and not line.startswith("0 errors") and line not in errors:
                errors.append(line)
    if errors:
        (TOFINO_DIR / "errors.txt").write_text("\n".join(errors) + "\n")
        found["errors.txt"] = TOFINO_DIR / "errors.txt"
    rec = {
        "comment": "Written by `make p4-tofino` (gen_p4.py --compile-tofino); checked by "
                   "tests/test_p4_build.py, which compiles again where the back end is "
                   "installed.",
        "compiler": p4c_version(),
        "command": (f"p4c -S --target tofino --arch tna --verbose 1 -o <out> --p4runtime-files "
                    f"<out>/thc_tna.p4info.txt --p4runtime-force-std-externs {rel(TNA_P4)}; "
                    f"bfas --no-warn --target tofino --table-handle-offset0 -o <out>/pipe "
                    f"<out>/pipe/thc_tna.bfa"),
        "lanes": load_spec()["lanes"],
        "passes": {"8-bit sums": 3, "16-bit sums": 1 + gen_tna.BLOCKS},
        "words_a_pass": gen_tna.WORDS,
        "max_lanes": load_spec()["max_lanes"],
        "compiled": rc == 0 if rc is not None else None,
        "exit_status": rc,
        "sources": {rel(p): sha256(p) for p in tofino_sources()},
        "outputs": {rel(TOFINO_DIR / n): sha256(TOFINO_DIR / n) for n in sorted(found)},
        "summary": tofino_summary(Path(out)),
    }
    TOFINO_REPORT.write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
    verdict = {True: "compiled", False: f"FAILED (exit {rc}; errors.txt)", None: "?"}[
        rec["compiled"]]
    passes = " or ".join(f"{n} ({w})" for w, n in rec["passes"].items())
    print(f"gen_p4: {rec['lanes']} lanes in {passes} passes {verdict}; recorded {', '.join(sorted(found))} "
          f"({rec['compiler']}) in {rel(TOFINO_DIR)}")


def check_tofino() -> list[str]:
    """Problems that make the committed Tofino report stale; empty when it is current."""
    if not TOFINO_REPORT.exists():
        return [f"{rel(TOFINO_REPORT)} is missing: run `make p4-tofino`"]
    rec = json.loads(TOFINO_REPORT.read_text())
    problems = []
    recorded = rec.get("sources", {})
    current = {rel(p): p for p in tofino_sources()}
    for name, path in current.items():
        if recorded.get(name) != sha256(path):
            problems.append(f"{name} changed since the Tofino report was made: run "
                            f"`make p4-tofino`")
    problems += [f"{name} is in the Tofino report but no longer exists: run `make p4-tofino`"
                 for name in recorded if name not in current]
    for name, digest in rec.get("outputs", {}).items():
        path = ROOT / name
        if not path.exists() or sha256(path) != digest:
            problems.append(f"{name} differs from the recorded Tofino report: run "
                            f"`make p4-tofino`")
    return problems
