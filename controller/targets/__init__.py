"""The switch targets the controller programs through one ``Job`` API (controller/jobs.py):
``bmv2`` (p4src/thc.p4) and ``tofino`` (p4src/thc_tna.p4). controller/targets/base.py says
what a target holds."""
from __future__ import annotations

from thc.controller.targets import bmv2, tofino
from thc.controller.targets.base import Target

TARGETS: dict[str, Target] = {t.name: t for t in (bmv2.TARGET, tofino.TARGET)}
DEFAULT = bmv2.TARGET.name

__all__ = ["TARGETS", "DEFAULT", "Target", "get", "of_p4info"]


def get(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r} (known: {', '.join(TARGETS)})") from None


def of_p4info(p4info) -> Target | None:
    """The target whose program ``p4info`` describes; None for another program (l2.p4)."""
    return next((t for t in TARGETS.values() if t.runs(p4info)), None)
