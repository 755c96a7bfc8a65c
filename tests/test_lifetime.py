"""thc.lifetime: the signals that end a command, unwound as Ctrl-C is, and left alone where
the command was started to ignore them (``nohup``)."""
from __future__ import annotations

import os
import signal

import pytest

from thc.lifetime import Terminated, signals_deferred, signals_raise, stopped_by


@pytest.fixture
def hangup_ignored():
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGHUP, old)


def test_sigterm_unwinds_with_its_status_and_words():
    with pytest.raises(Terminated) as e, signals_raise():
        os.kill(os.getpid(), signal.SIGTERM)
    assert stopped_by(e.value) == ("terminated (SIGTERM)", 143)
    assert stopped_by(KeyboardInterrupt()) == ("interrupted", 130)


def test_sigterm_in_teardown_is_raised_after_it():
    done = []
    with pytest.raises(Terminated), signals_deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        done.append(True)
    assert done == [True]


@pytest.mark.usefixtures("hangup_ignored")
def test_an_ignored_hangup_stays_ignored():
    """Under ``nohup`` a terminal's hangup ended `thc run` (status 129): its handler took
    SIGHUP over from the ignored disposition, as every command's would now."""
    for block in (signals_raise, signals_deferred):
        with block():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
