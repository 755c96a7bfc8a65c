"""What a testbed leaves behind, recorded so that a crashed run is cleaned up by the next one.

Every Mininet testbed owns a *tag* (a small integer) and names everything it creates in the
root network namespace after it: the switch ``thc<tag>s`` and its ports ``thc<tag>s-eth<N>``.
Host-side interfaces live inside the hosts' private namespaces, which vanish with the hosts'
shell processes. A state file per tag (``/run/thcnet/<tag>.json``) records the owner process
and every process the testbed started, each with its kernel start time so that a recycled
pid is never killed by mistake.

``reap_stale()`` runs before every start: for each state file whose owner is gone it kills
the recorded processes (by pid, start time checked), deletes the recorded interfaces and any
other ``thc<tag>s*`` interface whose tag no live testbed holds, and removes the file.
Nothing else on the machine is touched: no ``mn -c`` (which kills every Mininet on the host
and empties /tmp of logs), no ``pkill`` by name.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from thc.emu.errors import TestbedError

PREFIX = "thc"
MAX_TAGS = 1000
INTF_RE = re.compile(rf"^{PREFIX}(\d+)s(?:-eth\d+)?$")


def state_dir() -> Path:
    """The folder of the testbeds' records (``THCNET_STATE_DIR``, else /run/thcnet, else the
    temporary folder's), made where it is missing."""
    env = os.environ.get("THCNET_STATE_DIR")
    if env:
        d = Path(env)
    elif os.access("/run", os.W_OK):
        d = Path("/run/thcnet")
    else:
        d = Path(tempfile.gettempdir()) / "thcnet"
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TestbedError(f"the testbeds' state folder {d} "
                           f"({'THCNET_STATE_DIR' if env else 'THCNET_STATE_DIR unset'}) "
                           f"cannot be made: {e.strerror or e}") from None
    return d


def switch_name(tag: int) -> str:
    return f"{PREFIX}{tag}s"


def start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot), None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def same_process(pid: int, started: int | None) -> bool:
    st = start_time(pid)
    return st is not None and (started is None or st == started)


def kill_process(pid: int, started: int | None, group: bool = False, grace: float = 1.0) -> bool:
    """SIGTERM, then SIGKILL after ``grace`` seconds, the process ``pid`` (its group if asked).

    Only if it still is the process that was recorded (same start time). Returns True if it
    was alive.
    """
    if not same_process(pid, started):
        return False
    send = (lambda s: os.killpg(pid, s)) if group else (lambda s: os.kill(pid, s))
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        try:
            send(sig)
        except ProcessLookupError:
            return True
        except PermissionError:
            return True
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if not same_process(pid, started) or _is_zombie(pid):
                return True
            time.sleep(0.02)
    return True


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2:].startswith("Z")


def root_interfaces() -> list[str]:
    try:
        out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def delete_interface(name: str) -> None:
    subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=10)


class Registry:
    """The state file of one live testbed: its tag, owner and everything it started."""

    def __init__(self, tag: int, path: Path):
        self.tag = tag
        self.path = path
        self.pids: list[tuple[int, int | None, bool]] = []
        self.intfs: list[str] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()

    @classmethod
    def allocate(cls) -> "Registry":
        """Reap stale testbeds, then claim the lowest free tag (under a file lock)."""
        d = state_dir()
        with _locked(d):
            _reap_locked(d)
            held = {int(p.stem) for p in d.glob("*.json") if p.stem.isdigit()}
            for tag in range(MAX_TAGS):
                if tag not in held:
                    break
            else:
                raise RuntimeError(f"{MAX_TAGS} testbeds are alive (state in {d})")
            reg = cls(tag, d / f"{tag}.json")
            reg.save()
            return reg

    def to_dict(self) -> dict:
        me = os.getpid()
        return {"owner": me, "owner_start": start_time(me), "tag": self.tag,
                "pids": self.pids, "intfs": self.intfs, "paths": self.paths}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict()))
        tmp.replace(self.path)

    def add_pid(self, pid: int, group: bool = False) -> None:
        with self.lock:
            self.pids.append((pid, start_time(pid), group))
            self.save()

    def add_intfs(self, names) -> None:
        with self.lock:
            self.intfs.extend(n for n in names if n not in self.intfs)
            self.save()

    def add_path(self, path) -> None:
        with self.lock:
            self.paths.append(str(path))
            self.save()

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


@contextlib.contextmanager
def _locked(d: Path):
    with open(d / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _owner_alive(state: dict) -> bool:
    return same_process(int(state.get("owner", 0) or 0), state.get("owner_start")) \
        and int(state.get("owner", 0) or 0) > 0


def undo(state: dict) -> None:
    """Kill the recorded processes, delete the recorded interfaces and files."""
    for pid, started, group in reversed(state.get("pids", [])):
        kill_process(int(pid), started, group=bool(group), grace=0.5)
    present = set(root_interfaces())
    for name in state.get("intfs", []):
        if name in present:
            delete_interface(name)
    for p in state.get("paths", []):
        with contextlib.suppress(OSError):
            path = Path(p)
            if path.is_dir():
                import shutil
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink()


def _reap_locked(d: Path) -> list[int]:
    reaped = []
    live_tags = set()
    for f in sorted(d.glob("*.json")):
        try:
            state = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            state = {}
        if state and _owner_alive(state):
            live_tags.add(int(state.get("tag", -1)))
            continue
        undo(state)
        with contextlib.suppress(OSError):
            f.unlink()
        if f.stem.isdigit():
            reaped.append(int(f.stem))
    # Interfaces named by this project whose testbed is gone (e.g. its state file was lost).
    for name in root_interfaces():
        m = INTF_RE.match(name)
        if m and int(m.group(1)) not in live_tags:
            delete_interface(name)
    return reaped


def reap_stale() -> list[int]:
    """Clean up after testbeds whose owner died; returns their tags."""
    d = state_dir()
    with _locked(d):
        return _reap_locked(d)


def leftovers() -> list[str]:
    """Root-namespace interfaces named by this project (tests: nothing after a testbed closes)."""
    return [n for n in root_interfaces() if INTF_RE.match(n)]
