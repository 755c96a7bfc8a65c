"""Whether a compiled extension was built from the C sources beside it. setuptools leaves the
previous build in place when an optional extension fails to compile, so an edited source can
run as its older build, silently; each build carries its sources' names and SHA-256
(setup.py)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType


def source_hash(texts) -> str:
    """The SHA-256 a build carries: each source's contents after its length (setup.py)."""
    sha = hashlib.sha256()
    for text in texts:
        sha.update(len(text).to_bytes(8, "big") + text)
    return sha.hexdigest()


def stale(module: ModuleType, what: str) -> str | None:
    """Why ``module`` (a C extension) is not the build of the sources beside it, which it
    names in ``SOURCE_FILES``, or None. Without any of them (an installed wheel) there is
    nothing to compare; without some, the build is of files that are gone."""
    folder = Path(module.__file__).parent
    names = (getattr(module, "SOURCE_FILES", "").split()
             or [module.__name__.rsplit(".", 1)[-1] + ".c"])  # a build that names none
    sources = [folder / n for n in names]
    present = [s.is_file() for s in sources]
    if not any(present):
        return None
    built = getattr(module, "SOURCE_SHA256", "")
    if all(present) and built == source_hash(s.read_bytes() for s in sources):
        return None
    gone = [n for n, p in zip(names, present) if not p]
    return (f"the {what} was built from another version of {', '.join(names)}"
            + (f" ({', '.join(gone)} no longer there)" if gone else "")
            + " (its compile may have failed, leaving the old build in place): rebuild it, "
              "`pip install -e .`, and read the compiler's errors")
