"""Training learns through every gradient exchange the main job runs without a switch.

Each mode of ``thc run`` (:data:`thcnet.mainjob.MODES`, all but the BMv2 ones) trains the
main job's digits model for a few dozen steps on a fixed seed, through the main job's own
per-mode runner (:func:`thcnet.mainjob._run_mode`, as ``thc run --loopback``): its loopback
testbed, its software aggregators (sharded, central, vote job), its argv for
``python -m host.app.train``. One thing differs: each worker is forked from a server that
imported torch once, rather than exec'd, which saves the interpreter start-up of every rank
of every mode (seconds each on 2 cores); the worker still runs ``host.app.train``'s ``main``
with the argv the main job built, in a process of its own.

A mode passes when its loss falls and its final test accuracy lies within
:data:`TOLERANCE` of FP32's, trained the same way in the same session, and far above chance.
The check is shown able to fail: a THC run whose decoded gradient has its sign flipped (or
whose sums are zeroed), patched into the worker processes only, must fail it.
"""
from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.forkserver
import os
import statistics
import subprocess
import sys
import types

import pytest

from thcnet import mainjob
from thcnet.base import REPO_ROOT
from thcnet.testbed import LoopbackTestbed

pytestmark = pytest.mark.slow

WORKERS = 2
MAIN_JOB_ARGS = ["--loopback", "--workers", str(WORKERS), "--data", "digits", "--batch", "32",
                 "--epochs", "2", "--evals", "1", "--timeout", "300"]
MAIN_JOB_ARGS = os.environ.get("XARGS", " ".join(MAIN_JOB_ARGS)).split()  # EXPERIMENT
"""2 workers x 32 images: 22 steps an epoch of digits' 1,437 training images, 44 in all."""
MODES = [m for m, spec in mainjob.MODES.items() if spec.aggregator != "bmv2"]
COMPRESSED = [m for m in MODES if m != "fp32"]
WINDOW = 5
"""Steps averaged at each end of the run when comparing losses."""
LOSS_DROP = 0.5
"""The last WINDOW steps' mean loss must be below this fraction of the first WINDOW's."""
TOLERANCE = 0.05
"""A mode's final accuracy may lie at most this far below FP32's."""
FLOOR = 0.5
"""Every final accuracy, FP32's included, must reach this (chance: 0.1 for 10 classes)."""


# -- the broken gradient paths (applied in the worker processes only) -------------------------

def _flip_sign() -> None:
    from host.collective.allreduce import THCAllReduce
    real = THCAllReduce.__call__
    THCAllReduce.__call__ = lambda self, tensor, position=None: -real(self, tensor, position)


def _zero_sums() -> None:
    import torch

    from host.collective.allreduce import AggregatorTransport
    real = AggregatorTransport.sum

    def zeroed(self, indices, params, classes=None):
        sums, short = real(self, indices, params, classes)
        return torch.zeros_like(sums), short
    AggregatorTransport.sum = zeroed


BREAKS = {"sign-flipped": _flip_sign, "sums-zeroed": _zero_sums}


# -- workers forked from a preloaded server ----------------------------------------------------

def _rank_main(argv: list[str], env: dict, out: str, err: str, brk: str | None) -> None:
    """One worker: what ``python -m host.app.train *argv`` would do, in a forked process."""
    os.setsid()  # like start_new_session=True: the testbed kills the worker's group
    os.chdir(REPO_ROOT)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    if brk is not None:
        BREAKS[brk]()
    from host.app import train
    try:
        rc = train.main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if rc:
        raise SystemExit(rc)


class _Forked:
    """The part of :class:`subprocess.Popen` that :class:`thcnet.procs.Proc` uses."""

    def __init__(self, process):
        self.process = process
        self.pid = process.pid
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.process.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self.process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode


@pytest.fixture(scope="module")
def train_mode():
    """``train_mode(name, brk=None)``: the main job's run of mode ``name`` (cached)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["host.app.train", "sklearn.datasets", "torch.nn.parallel",
                                __name__])
    real_launch = LoopbackTestbed._launch
    state = {"brk": None}

    def launch(self, node, argv, env, stdout, stderr):
        if argv[1:3] != ["-m", "host.app.train"]:  # aggregators: exec'd as usual
            return real_launch(self, node, argv, env, stdout, stderr)
        p = ctx.Process(target=_rank_main, name=f"{node}-train",
                        args=(argv[3:], env, stdout.name, stderr.name, state["brk"]))
        p.start()
        return _Forked(p)

    parser = argparse.ArgumentParser()
    mainjob.add_arguments(parser)
    args = parser.parse_args(MAIN_JOB_ARGS)
    progress = types.SimpleNamespace(total=0, n=0, refresh=lambda: None,
                                     set_postfix=lambda **k: None)
    cache = {}

    def run(name: str, brk: str | None = None) -> dict:
        if (name, brk) not in cache:
            state["brk"] = brk
            cache[name, brk] = mainjob._run_mode(name, args, progress)
        return cache[name, brk]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LoopbackTestbed, "_launch", launch)
        yield run
    stop = getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_stop", None)
    if stop is not None:
        stop()


# -- the check -----------------------------------------------------------------------------------

def learning_failures(run: dict, fp32: dict) -> list[str]:
    """Why ``run`` did not learn as FP32 did (empty: it did)."""
    losses = mainjob.step_losses(run)
    name = run["mode"]
    if len(losses) < 4 * WINDOW:
        return [f"{name}: only {len(losses)} training steps"]
    first, last = statistics.mean(losses[:WINDOW]), statistics.mean(losses[-WINDOW:])
    out = []
    if not last < LOSS_DROP * first:
        out.append(f"{name}: the loss did not fall below {LOSS_DROP:g}x its start: mean of "
                   f"the first {WINDOW} steps {first:.3f}, of the last {WINDOW} {last:.3f}")
    want = max(fp32["final_accuracy"] - TOLERANCE, FLOOR)
    if not run["final_accuracy"] >= want:
        out.append(f"{name}: final accuracy {run['final_accuracy']:.4f} < {want:.4f} (FP32 "
                   f"{fp32['final_accuracy']:.4f} - {TOLERANCE:g}, at least {FLOOR:g})")
    return out


def _summary(run: dict) -> str:
    losses = mainjob.step_losses(run)
    return (f"{run['mode']}: accuracy {run['final_accuracy']:.4f}, loss "
            f"{statistics.mean(losses[:WINDOW]):.3f} -> {statistics.mean(losses[-WINDOW:]):.3f} "
            f"over {len(losses)} steps, {run['wall_seconds']:.1f} s ({run['train_seconds']:.1f} s training)")


@pytest.fixture(scope="module")
def fp32(train_mode):
    run = train_mode("fp32")
    print(_summary(run))
    assert learning_failures(run, run) == [], "FP32 itself must learn"
    return run


@pytest.mark.parametrize("mode", COMPRESSED)
def test_training_learns_through_the_mode(mode, train_mode, fp32):
    run = train_mode(mode)
    print(_summary(run))
    assert run["stopped"] is None and run["testbed"] == "loopback"
    assert learning_failures(run, fp32) == []


@pytest.mark.parametrize("brk", BREAKS)
def test_a_broken_thc_gradient_fails_the_check(brk, train_mode, fp32):
    run = train_mode("thc", brk)
    print(_summary(run))
    assert run["stopped"] is None
    assert learning_failures(run, fp32), f"THC with its gradient {brk} passed the check"
