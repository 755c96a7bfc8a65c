"""Is the switch toolchain here? The one probe used by the code, the tests and the main job.

The toolchain (p4c, BMv2's simple_switch_grpc) is not part of the project: users install it
from p4lang's packages or images. Each function returns None when the piece can be used, or
one sentence saying what is missing and how to get it.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = ROOT / "p4src" / "build"


def _driver_missing() -> str | None:
    if shutil.which("p4c") is None:
        return "p4c is not on PATH (install it from p4lang's packages or docker image)"
    return None


def p4c_missing() -> str | None:
    """Why ``make p4`` cannot compile here (the BMv2 program), or None."""
    why = _driver_missing()
    if why is None and shutil.which("p4c-bm2-ss") is None:
        why = ("p4c's BMv2 back end (p4c-bm2-ss) is not installed: install a p4c package or "
               "image from p4lang that includes it (its ENABLE_BMV2 option)")
    return why


def tofino_missing() -> str | None:
    """Why ``make p4-tofino`` cannot compile the TNA program here, or None."""
    why = _driver_missing()
    if why:
        return why
    for binary in ("p4c-barefoot", "bfas"):
        if shutil.which(binary) is None:
            return (f"p4c's Tofino back end ({binary}) is not installed: install a p4c "
                    "package or image from p4lang that includes it (its ENABLE_TOFINO option)")
    return None


def program_missing(program: str = "thc", build_dir: Path | str = BUILD_DIR) -> str | None:
    """Why the compiled ``program`` cannot be loaded, or None."""
    for name in (f"{program}.json", f"{program}.p4info.txt"):
        if not (Path(build_dir) / name).exists():
            return f"{Path(build_dir) / name} is missing (compile the program: make p4)"
    return None


def bmv2_missing(program: str = "thc", build_dir: Path | str = BUILD_DIR) -> str | None:
    """Why a local BMv2 switch running ``program`` cannot be started and programmed, or None.

    Needs simple_switch_grpc on PATH, root (veth pairs, raw sockets), iproute2, the compiled
    program, and p4runtime-shell for the controller.
    """
    if shutil.which("simple_switch_grpc") is None:
        return ("simple_switch_grpc is not on PATH (install BMv2 with its P4Runtime server: "
                "p4lang's packages or docker image)")
    if os.geteuid() != 0:
        return "not root (veth pairs and raw sockets need CAP_NET_ADMIN/CAP_NET_RAW)"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not on PATH"
    why = program_missing(program, build_dir)
    if why:
        return why
    try:
        if importlib.util.find_spec("p4runtime_sh") is None:
            return "p4runtime-shell is not installed (pip install p4runtime-shell)"
    except ImportError as e:
        return f"p4runtime-shell cannot be imported: {e}"
    return None


LOGGING_MACRO_MARK = b"Table '{}': hit with handle"
"""A format string of BMv2's per-packet debug log (match_tables.cpp); a build configured
with --disable-logging-macros compiles every such message out."""


def bmv2_logging_macros() -> str | None:
    """Where the running BMv2's libraries still carry the per-packet log messages (a build
    without --disable-logging-macros, which formats them for every table it applies: about
    3x slower on the per-lane program, docs/switch.md), or None when none of them does (or
    BMv2 is absent)."""
    import subprocess
    binary = shutil.which("simple_switch_grpc")
    if binary is None:
        return None
    try:
        out = subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    files = [binary] + [part.split()[2] for part in out.splitlines()
                        if "=>" in part and len(part.split()) > 2 and "/" in part.split()[2]
                        and ("bm" in Path(part.split()[2]).name
                             or "simpleswitch" in Path(part.split()[2]).name)]
    for path in files:
        try:
            if LOGGING_MACRO_MARK in Path(path).read_bytes():
                return path
        except OSError:
            continue
    return None
