"""The fault matrix script: a row runs end to end, and a wrong sum fails the matrix."""
from __future__ import annotations

import argparse

from thcnet import faults


def test_a_wrong_sum_is_reported_and_fails_the_matrix():
    rows = [faults.Row("ok", "loopback", "exact (4/4 workers)", 8, 0, 1.0, {}, "", True),
            faults.Row("bad", "loopback", "WRONG: 3 sums differ", 8, 0, 1.0,
                       {"stale": 2}, "", False)]
    text = faults.render(rows, quick=True, elapsed=2.0)
    assert "| bad | loopback | WRONG: 3 sums differ | 8 | 0 | 1.0 | stale 2 |" in text
    assert "Wrong sums: bad." in text


def test_duplication_row_on_loopback(tmp_path, capsys):
    args = argparse.Namespace(quick=True, out=str(tmp_path / "f.md"), json=None, loopback=True,
                              only="dup,jitter")
    assert faults.run(args) == 0
    out = capsys.readouterr().out
    assert "duplication: exact (4/4 workers); rounds 512" in out
    assert "jitter:" in out
