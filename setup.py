"""Builds the compiled aggregator datapath and the compiled CPU codec; everything else is in
pyproject.toml.

Both extensions are optional: without a C compiler the install still succeeds,
``thc aggregator`` runs the Python datapath and the codec its numpy/torch reference path (each
says which one it runs). An extension whose compile fails leaves an older build in place, so
each carries the SHA-256 of its source, which thc.built checks at import. The codec is built
without -march=native, so the build runs on any x86-64; on x86-64 Linux with GCC it carries
an AVX2 clone of its loops, picked at load time. -ffp-contract=off keeps every product and sum
rounded as the reference rounds it.
"""
import hashlib
from pathlib import Path

from setuptools import Extension, setup


def extension(name: str, source: str, *flags: str) -> Extension:
    sha = hashlib.sha256((Path(__file__).parent / source).read_bytes()).hexdigest()
    return Extension(name, [source], define_macros=[("SOURCE_SHA256", f'"{sha}"')],
                     extra_compile_args=["-std=gnu11", *flags], optional=True)


setup(ext_modules=[
    extension("thc.net._fastagg", "host/net/_fastagg.c", "-O2"),
    extension("thc.codec._fastcodec", "host/codec/_fastcodec.c", "-O3", "-ffp-contract=off",
              "-Wno-psabi"),
])
