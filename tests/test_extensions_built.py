"""Where a C compiler exists, both C extensions are built, each from the source beside it, and
the compiled client window matches the Python one's version. Their build is optional
(setup.py): without this check a compile error, or a window constant bumped on one side only,
would only skip the tests of the compiled paths."""
import shutil
import sysconfig

import pytest

from thc.codec import fastcodec
from thc.net import cext, fastclient


def test_the_c_extensions_are_built_where_a_compiler_exists():
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the compiled paths are optional")
    assert cext.UNAVAILABLE is None, cext.UNAVAILABLE
    assert fastcodec.UNAVAILABLE is None, fastcodec.UNAVAILABLE
    assert fastclient.CLIENT_UNAVAILABLE is None, fastclient.CLIENT_UNAVAILABLE
