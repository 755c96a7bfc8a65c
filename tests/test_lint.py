"""The code passes the linter checks that catch real mistakes (pyproject.toml's
``[tool.ruff.lint]``: syntax errors, undefined names, unused imports and variables)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    try:
        import ruff  # noqa: F401
    except ImportError as e:
        pytest.skip(f"ruff is not installed ({e}); pip install the test extra")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
