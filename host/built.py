"""Whether a compiled extension was built from the C sources beside it. setuptools leaves the
previous build in place when an optional extension fails to compile, so an edited source can
run as its older build, silently; each build carries its sources' names and SHA-256
(setup.py)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType


def stale(module: ModuleType, what: str) -> str | None:
    """Why ``module`` (a C extension) is not the build of the sources beside it, which it
    names in ``SOURCE_FILES``, or None. Without them (an installed wheel) there is nothing
    to compare."""
    folder = Path(module.__file__).parent
    names = (getattr(module, "SOURCE_FILES", "").split()
             or [module.__name__.rsplit(".", 1)[-1] + ".c"])  # a build that names none
    sources = [folder / n for n in names]
    if not all(s.is_file() for s in sources):
        return None
    built = getattr(module, "SOURCE_SHA256", "")
    if built == hashlib.sha256(b"".join(s.read_bytes() for s in sources)).hexdigest():
        return None
    return (f"the {what} was built from another version of {', '.join(names)} (its compile "
            f"may have failed, leaving the old build in place): rebuild it, `pip install -e "
            f".`, and read the compiler's errors")
