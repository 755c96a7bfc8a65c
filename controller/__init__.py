"""P4Runtime controller of the THC aggregation switch (one module per P4 control): the
public API.

  Switch, SwitchError                        a P4Runtime session to one switch (switch)
  install_cluster, install_job, remove_job,  safe install and removal of jobs (jobs)
  JobLive, JobNotInstalled
  installed_jobs                             what the switch holds (installed)
  AggAddress                                 where results come from (job_entries)

Each name loads its module on first use: p4runtime-shell is imported only where a switch is
programmed, not by the emulation or the in-memory switch that import this package's modules.
"""
from __future__ import annotations

from thc.namespace import exports, one_name

one_name(__name__, "thc.controller")

_API = {
    "Switch": "thc.controller.switch",
    "SwitchError": "thc.controller.switch",
    "AggAddress": "thc.controller.job_entries",
    "JobLive": "thc.controller.jobs",
    "JobNotInstalled": "thc.controller.jobs",
    "install_cluster": "thc.controller.jobs",
    "install_job": "thc.controller.jobs",
    "installed_jobs": "thc.controller.installed",
    "remove_job": "thc.controller.jobs",
}
"""Public name -> the module that defines it."""

__all__ = sorted(_API)
__getattr__, __dir__ = exports(__name__, _API)
