"""Builds the compiled aggregator datapath; everything else is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and
``thc aggregator`` runs the Python datapath (it says which one it runs).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("host.net._fastagg", ["host/net/_fastagg.c"],
                             extra_compile_args=["-O2", "-std=gnu11"], optional=True)])
