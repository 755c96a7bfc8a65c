"""Every figure the project draws carries the command, commit, machine and time its
numbers came from, as its report does."""
from __future__ import annotations

import json

from thc.bench import figure, footer, provenance, save_figure
from thc.emu import mainreport, sweepreport

RECORDED = {"utc": "2026-12-05T08:00:00+00:00", "command": "thc bench codec --sizes 20",
            "commit": "abc1234", "cpu": "AMD EPYC", "cores": 2}


def _signed(fig) -> str:
    return fig.texts[-1].get_text().replace("\n", " ")


def test_a_figure_is_signed_with_its_reports_provenance(tmp_path):
    fig, axes = figure()
    axes[0][0].plot([1, 2], [3, 4])
    save_figure(fig, tmp_path / "a" / "x.png", RECORDED)
    assert (tmp_path / "a" / "x.png").stat().st_size > 0
    said = _signed(fig)
    for value in ("thc bench codec --sizes 20", "commit abc1234", "AMD EPYC, 2 cores",
                  "2026-12-05T08:00:00+00:00"):
        assert value in said, said


def test_a_figure_drawn_without_a_report_is_signed_with_this_run():
    fig, _ = figure()
    save_figure(fig, "/dev/null")
    assert _signed(fig).startswith(footer(provenance())[:20])


def test_the_main_jobs_and_the_sweeps_figures_are_signed(tmp_path, monkeypatch):
    """Both drew with matplotlib directly, unsigned."""
    signed = []
    real = mainreport.save_figure

    def keep(fig, path, recorded=None):
        real(fig, path, recorded)
        signed.append(_signed(fig))
    monkeypatch.setattr(mainreport, "save_figure", keep)
    monkeypatch.setattr(sweepreport, "save_figure", keep)
    mainreport.plot([], tmp_path / "m.png", "digits", RECORDED)
    sweep = json.loads(open("docs/runs/sweep-bandwidth.json").read())
    sweepreport.plot(sweep, tmp_path / "s.png")
    assert "commit abc1234" in signed[0]
    assert sweep["command"] in signed[1] and sweep["date"] in signed[1]
