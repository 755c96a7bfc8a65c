"""Where the P4 sources, generated files and builds live, and the small helpers that record
them: shared by gen_p4.py (the BMv2 build) and tofino_report.py (the Tofino report)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

P4SRC = Path(__file__).resolve().parent
ROOT = P4SRC.parent
PROTOCOL_JSON = ROOT / "host" / "wire" / "protocol.json"
GEN_DIR = P4SRC / "generated"
BUILD_DIR = P4SRC / "build"
COMMON_P4 = P4SRC / "thc_common.p4"
TNA_P4 = P4SRC / "thc_tna.p4"


def load_spec(path: Path = PROTOCOL_JSON) -> dict:
    return json.loads(path.read_text())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rel(path: Path) -> str:
    """Repository-relative path (absolute for a path outside the repository)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def p4c_binary() -> str:
    return os.environ.get("P4C", "p4c")


def p4c_version() -> str:
    try:
        out = subprocess.run([p4c_binary(), "--version"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"gen_p4 --record: cannot run {p4c_binary()!r}: {e}")
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[-1].strip() if text else "unknown"
