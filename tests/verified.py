"""Checks that are pure functions of their input files, remembered once they pass.

p4c's Tofino back end takes minutes to compile the TNA program, and gives the same output for
the same program and compiler. A compile that matched the committed record is remembered under
a key hashing every input: the sources, the committed record, the compiler's binaries and its
shared files, and the test that ran the check. A later run with the same key passes on that
record, and says so at the end of the run (tests/conftest.py); any changed input makes a new
key and compiles again, and ``--recompile`` (a pytest option) compiles whatever the key. The
inputs include the C preprocessor p4c runs and the environment that points p4c at other
include files (:data:`COMPILE_ENV`).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "thc" / "verified"
COMPILE_ENV = ("P4C_16_INCLUDE_PATH", "P4C_14_INCLUDE_PATH")
"""Variables under which p4c reads other P4 include files than its installation's."""
PROPERTY = "verified-earlier"
"""The name under which a test's report carries the remembered check it passed on."""


def toolchain_files(*binaries: str) -> list[Path]:
    """The binaries on PATH (symlinks followed), with ``cpp``, which p4c runs on every program,
    and every file under the first binary's installation's ``share/p4c`` (the driver's
    configuration and the P4 include files)."""
    files = []
    for name in (*binaries, "cpp"):
        found = shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"{name} is not on PATH")
        files.append(Path(found).resolve())
    share = files[0].parent.parent / "share" / "p4c"
    if share.is_dir():
        files += sorted(p for p in share.rglob("*") if p.is_file())
    return files


def key(files: list[Path]) -> str:
    """One digest over the files' names (the repository's relative to its root, so that every
    clone of one commit has one key) and contents, and the :data:`COMPILE_ENV` variables."""
    h = hashlib.sha256()
    for name in COMPILE_ENV:
        h.update(f"{name}={os.environ.get(name, '')}".encode() + b"\0")
    for path in files:
        path = Path(path).resolve()
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        h.update(str(name).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def recall(name: str, digest: str) -> dict | None:
    """The record of check ``name`` passed with inputs ``digest``, or None."""
    path = CACHE / f"{name}-{digest}.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if rec.get("key") == digest and rec.get("name") == name else None


def passed_before(name: str, digest: str, request, record_property) -> bool:
    """Whether check ``name`` passed with inputs ``digest`` and the run does not insist
    (``--recompile``); if so the test's report names the earlier pass."""
    earlier = recall(name, digest)
    if earlier is None or request.config.getoption("--recompile"):
        return False
    record_property(PROPERTY, f"{request.node.nodeid}: the compile of {earlier['passed']} "
                              f"({earlier['seconds']:.0f} s, {earlier['compiler']}) with the "
                              f"same inputs, key {digest[:12]}")
    return True


def remember(name: str, digest: str, **facts) -> None:
    """Record that check ``name`` passed with inputs ``digest`` (written whole, then renamed,
    so a reader never sees half of it)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    rec = {"name": name, "key": digest,
           "passed": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           **facts}
    tmp = CACHE / f".{name}-{digest}.{os.getpid()}"
    tmp.write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
    tmp.replace(CACHE / f"{name}-{digest}.json")
