"""One import namespace: the folders host/, controller/ and mininet/thcnet/ are the packages
thc, thc.controller and thc.emu, every package folder is in the distribution, the folder
names themselves do not import (a module under two names would hold two copies of its
state), and ``import thc`` stays light while its public names resolve."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import thc
import thc.controller

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_in_the_distribution():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool["package-dir"]
    listed = set(tool["packages"])
    found = set()
    for pkg, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join((pkg, *rel.parts)))
    assert listed == found
    assert tool["package-data"] == {"thc.wire": ["protocol.json"]}
    assert (ROOT / dirs["thc"] / "wire" / "protocol.json").exists()


@pytest.mark.parametrize("old, new", [("host", "thc"), ("controller", "thc.controller"),
                                      ("thcnet", "thc.emu")])
def test_a_folder_name_does_not_import(old, new):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'mininet'}"}
    r = subprocess.run([sys.executable, "-c", f"import {old}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f"import {new}, not {old}" in r.stderr, r.stderr[-2000:]


def test_import_thc_is_light_and_every_public_name_resolves():
    code = ("import sys, thc, thc.controller, thc.emu\n"
            "heavy = sorted(m for m in ('torch', 'p4runtime_sh', 'mininet') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    for package in (thc, thc.controller):
        for name in package.__all__:
            value = getattr(package, name)
            assert value.__module__ == package._API[name], name
    assert set(thc.__all__) <= set(dir(thc))
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        thc.nonesuch
