"""``python -m thc.emu.run``'s flags are refused before a testbed comes up."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_retransmission_timeout_that_is_no_time_is_a_usage_error(value, capsys):
    """--rto 0 reached every worker, each of which failed with its own traceback."""
    from thc.emu import run
    with pytest.raises(SystemExit) as e:
        run.main(["--rto", value])
    assert e.value.code == 2
    assert "argument --rto: " in capsys.readouterr().err
