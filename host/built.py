"""Whether a compiled extension was built from the C source beside it. setuptools leaves the
previous build in place when an optional extension fails to compile, so an edited source can
run as its older build, silently; each build carries its source's SHA-256 (setup.py)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType


def stale(module: ModuleType, what: str) -> str | None:
    """Why ``module`` (a C extension ``_name``) is not the build of the ``_name.c`` beside
    it, or None. Without that source (an installed wheel) there is nothing to compare."""
    source = Path(module.__file__).parent / (module.__name__.rsplit(".", 1)[-1] + ".c")
    if not source.is_file():
        return None
    built = getattr(module, "SOURCE_SHA256", "")
    if built == hashlib.sha256(source.read_bytes()).hexdigest():
        return None
    return (f"the {what} was built from another version of {source.name} (its compile may "
            f"have failed, leaving the old build in place): rebuild it, `pip install -e .`, "
            f"and read the compiler's errors")
