"""tests/verified.py: a remembered check is found only under the inputs it passed with."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests import verified


def test_a_changed_input_makes_another_key(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"program")
    b.write_bytes(b"compiler")
    before = verified.key([a, b])
    assert verified.key([a, b]) == before
    b.write_bytes(b"compiler, rebuilt")
    assert verified.key([a, b]) != before
    assert verified.key([b, a]) != verified.key([a, b])


def test_a_repository_file_is_keyed_by_its_name_in_the_repository(tmp_path, monkeypatch):
    """Two clones of one commit share a key; a file outside the clone counts by its path."""
    keys = []
    for clone in ("one", "two"):
        (tmp_path / clone / "p4src").mkdir(parents=True)
        (tmp_path / clone / "p4src" / "x.p4").write_text("control c() {}")
        monkeypatch.setattr(verified, "ROOT", tmp_path / clone)
        keys.append(verified.key([tmp_path / clone / "p4src" / "x.p4"]))
    assert keys[0] == keys[1]
    assert verified.key([tmp_path / "one" / "p4src" / "x.p4"]) != keys[0]


def test_recall_finds_only_what_was_remembered(tmp_path, monkeypatch):
    monkeypatch.setattr(verified, "CACHE", tmp_path / "cache")
    assert verified.recall("compile", "k1") is None
    verified.remember("compile", "k1", seconds=3.0)
    rec = verified.recall("compile", "k1")
    assert rec["seconds"] == 3.0 and rec["key"] == "k1" and rec["passed"]
    assert verified.recall("compile", "k2") is None
    assert verified.recall("other", "k1") is None
    (tmp_path / "cache" / "compile-k3.json").write_text('{"name": "compile", "key": "k1"}')
    assert verified.recall("compile", "k3") is None   # a record filed under another key
    (tmp_path / "cache" / "compile-k4.json").write_text("{half")
    assert verified.recall("compile", "k4") is None
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []


def test_the_include_path_p4c_is_pointed_at_makes_another_key(tmp_path, monkeypatch):
    """p4c reads the include files P4C_16_INCLUDE_PATH names instead of its installation's:
    a compile remembered under one path said nothing of a program built with another."""
    a = tmp_path / "a"
    a.write_bytes(b"program")
    monkeypatch.delenv("P4C_16_INCLUDE_PATH", raising=False)
    before = verified.key([a])
    monkeypatch.setenv("P4C_16_INCLUDE_PATH", str(tmp_path / "other-includes"))
    assert verified.key([a]) != before


def test_the_preprocessor_p4c_runs_is_an_input(tmp_path, monkeypatch):
    """p4c runs cpp over every program (its #includes and macros): another cpp, another
    key."""
    if shutil.which("cpp") is None:
        pytest.skip("cpp (the C preprocessor) is not installed")
    tool = tmp_path / "bin" / "p4c"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    files = verified.toolchain_files("p4c")
    assert Path(shutil.which("cpp")).resolve() in files
