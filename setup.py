"""Builds the compiled aggregator datapath and the compiled CPU codec; everything else is in
pyproject.toml.

Both extensions are optional: without a C compiler the install still succeeds,
``thc aggregator`` runs the Python datapath and the codec its numpy/torch reference path (each
says which one it runs). The codec is built without -march=native, so the build runs on any
x86-64; on x86-64 Linux with GCC it carries an AVX2 clone of its loops, picked at load time.
-ffp-contract=off keeps every product and sum rounded as the reference rounds it.
"""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("thc.net._fastagg", ["host/net/_fastagg.c"],
              extra_compile_args=["-O2", "-std=gnu11"], optional=True),
    Extension("thc.codec._fastcodec", ["host/codec/_fastcodec.c"],
              extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-Wno-psabi"],
              optional=True),
])
