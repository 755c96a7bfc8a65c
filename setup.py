"""Builds the compiled aggregator datapath and the compiled CPU codec; everything else is in
pyproject.toml.

Both extensions are optional: without a C compiler the install still succeeds,
``thc aggregator`` runs the Python datapath and the codec its numpy/torch reference path (each
says which one it runs). An extension whose compile fails leaves an older build in place, so
each carries the SHA-256 of its sources, which thc.built checks at import. The codec is built
without -march=native, so the build runs on any x86-64; on x86-64 Linux with GCC it carries
an AVX2 clone of its loops, picked at load time. -ffp-contract=off keeps every product and sum
rounded as the reference rounds it.
"""
import hashlib
from pathlib import Path

from setuptools import Extension, setup


def extension(name: str, sources: list[str], *flags: str) -> Extension:
    """sources: the C files, then the headers they include; the build carries their names and
    the SHA-256 of their contents, each after its length, in that order (thc.built)."""
    here = Path(__file__).parent
    sha = hashlib.sha256()
    for text in ((here / s).read_bytes() for s in sources):   # as thc.built reads them
        sha.update(len(text).to_bytes(8, "big") + text)
    names = " ".join(Path(s).name for s in sources)
    return Extension(name, [s for s in sources if s.endswith(".c")],
                     depends=[s for s in sources if not s.endswith(".c")],
                     define_macros=[("SOURCE_SHA256", f'"{sha.hexdigest()}"'),
                                    ("SOURCE_FILES", f'"{names}"')],
                     extra_compile_args=["-std=gnu11", "-fvisibility=hidden", *flags],
                     optional=True)


DATAPATH = [f"host/net/{f}" for f in (
    "_fastagg.c", "_fastagg_rules.c", "_fastagg_serve.c", "_fastagg_stream.c",
    "_fastagg_load.c", "_fastagg_udp.c", "_fastagg.h", "_fastagg_rules.h")]

setup(ext_modules=[
    extension("thc.net._fastagg", DATAPATH, "-O2"),
    extension("thc.codec._fastcodec", ["host/codec/_fastcodec.c"], "-O3", "-ffp-contract=off",
              "-Wno-psabi"),
])
