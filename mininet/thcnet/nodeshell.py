"""Shell lines run in a Mininet node's namespaces with a deadline.

Not through ``node.cmd``: it writes to the node's shell and waits on it for good, so a shell
that died (killed, or `mn -c` run elsewhere on the machine) would hold the run forever."""
from __future__ import annotations

import os
import signal
import subprocess

from thc.emu.errors import TestbedError

NODE_CMD_S = 30.0
"""Seconds a command in a node may take (tc, iptables and nft answer in milliseconds)."""


def node_run(node, line: str, timeout: float = NODE_CMD_S) -> str:
    """What ``line`` (a shell line) printed, stdout and stderr, run in ``node``'s namespaces
    (mnexec, attached through the node's shell process)."""
    shell = getattr(node, "shell", None)
    if shell is None or shell.poll() is not None:
        code = None if shell is None else shell.returncode
        raise TestbedError(f"the shell of Mininet node {node.name} has exited (code {code}: "
                           f"killed, or `mn -c` run on this machine), so its namespace and "
                           f"links can no longer be read: `{line}`")
    proc = node.popen(["sh", "-c", line], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True)
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # mnexec -d: the line's session, forks and all
        proc.communicate()
        raise TestbedError(f"`{line}` in Mininet node {node.name} did not end within "
                           f"{timeout:g} s") from None
