"""The two rules of the ``thc`` namespace, for the packages' ``__init__`` modules: a folder
loads under its one package name only (host/ as ``thc``, controller/ as ``thc.controller``,
mininet/thcnet/ as ``thc.emu``: under a second name every module would exist twice, with two
copies of its state), and a package's public names load on first use (PEP 562), so that
``import thc`` stays free of torch and ``import thc.controller`` of p4runtime-shell."""
from __future__ import annotations

import importlib
import sys


def one_name(name: str, package: str) -> None:
    """Refuse to load ``package``'s folder as ``name``."""
    if name != package:
        raise ImportError(f"this folder is the package {package!r}: import {package}, not "
                          f"{name} (pip install -e . maps the folders to their names)")


def exports(package: str, table: dict[str, str]):
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose public names ``table`` maps
    to the modules that define them."""
    def __getattr__(name: str):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
