"""Which codec backend runs an input: the reference code, the compiled CPU codec or the
Triton kernels. ``auto`` runs numpy arrays and CPU tensors on the compiled codec (unless the
CPU choice says ``reference``), CUDA tensors on the kernels; a backend that is not there
falls back to the reference code with one warning, an explicit one is an error that says
why. :class:`Choice` makes the choice once per kind of input for a codec."""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Callable

from thc.codec import compiled, fastcodec, kernels, reference
from thc.codec.common import torch_table
from thc.codec.hadamard import is_torch
from thc.codec.settings import CODEC_CPU as CPU_CHOICES

BACKENDS = ("auto", "reference", "compiled", "triton")
_KERNELS_MISSING: list = []
_COMPILED_MISSING: list = []


@dataclass(frozen=True)
class Backend:
    """One backend's operations on flat float32 input (see host/codec/reference.py for the
    signatures); ``own_table(params, device)``: the table decode_indices maps indices through
    inside the backend, None where the indices go through table_values first. ``norms``: the
    slice norms of the preliminary MAX round (the kernels' are torch's, the reference's)."""

    name: str
    prepare: Callable
    encode: Callable
    decode: Callable
    own_table: Callable | None
    norms: Callable = reference.norms


REFERENCE = Backend("reference", reference.prepare, reference.encode, reference.decode, None)
COMPILED = Backend("compiled", compiled.prepare, compiled.encode, compiled.decode,
                   lambda params, device: params.table, compiled.norms)
_TRITON: dict = {}


def _triton(kern) -> Backend:
    b = _TRITON.get(id(kern))
    if b is None:
        b = _TRITON[id(kern)] = Backend(
            "triton", partial(kernels.prepare, kern), partial(kernels.encode, kern),
            partial(kernels.decode, kern), torch_table)
    return b


def check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def compiled_for(x, backend: str = "auto", cpu: str = "compiled") -> bool:
    """Whether ``x`` (a flat array or tensor) takes the compiled CPU codec. ``auto``: numpy
    arrays and CPU tensors, unless ``cpu`` is ``reference``, when the extension is built (else
    the reference path, with one warning saying why); ``compiled``: always, or a clear error
    saying why not."""
    check(backend)
    if backend == "compiled":
        if not fastcodec.on_cpu(x):
            raise ValueError(f"the compiled backend runs on the CPU, the input is on {x.device}")
        if not fastcodec.available():
            raise RuntimeError(fastcodec.UNAVAILABLE)
        return True
    if backend != "auto" or not fastcodec.on_cpu(x):
        return False
    if cpu not in CPU_CHOICES:
        raise ValueError(f"the codec's CPU backend must be 'compiled' or 'reference' "
                         f"(THC_CODEC_CPU), got {cpu!r}")
    if cpu == "reference":
        return False
    if not fastcodec.available():
        if not _COMPILED_MISSING:
            _COMPILED_MISSING.append(fastcodec.UNAVAILABLE)
            warnings.warn(f"THC on the CPU: {fastcodec.UNAVAILABLE}; reference path, slower",
                          RuntimeWarning, stacklevel=3)
        return False
    return True


def kernels_for(x, backend: str = "auto"):
    """The Triton kernel module when ``x`` (a flat float32 or integer tensor) should use it,
    else None. ``auto``: CUDA tensors, when triton imports (else the reference path, with one
    warning); ``triton``: always, or a clear error saying why not."""
    check(backend)
    if backend in ("reference", "compiled") or not is_torch(x):
        if backend == "triton":
            raise TypeError("the triton backend takes torch tensors, not numpy arrays")
        return None
    if backend == "auto" and x.device.type != "cuda":
        return None
    try:
        from thc.codec import triton_kernels
    except ImportError as e:
        if backend == "triton":
            raise RuntimeError(f"the triton backend needs the triton package: {e}") from None
        if not _KERNELS_MISSING:
            _KERNELS_MISSING.append(e)
            warnings.warn(f"THC on {x.device} without triton ({e}): reference path, slower",
                          RuntimeWarning, stacklevel=3)
        return None
    if x.device.type == "cpu" and not triton_interpreted():
        raise RuntimeError("the triton backend runs CPU tensors only under Triton's "
                           "interpreter: set TRITON_INTERPRET=1 before importing it")
    return triton_kernels


def triton_interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter, on CPU tensors: its own variable,
    TRITON_INTERPRET=1, which it reads when a kernel runs and when imported, making its own
    jit functions then. Once it is imported one of those says how (no public API does): the
    variable set after the import ran the kernels into a traceback from inside Triton."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    standard = sys.modules.get("triton.language.standard")
    return standard is None or type(standard.cdiv).__name__ == "InterpretedFunction"


def pick(x, backend: str = "auto", cpu: str = "compiled") -> Backend:
    """The backend that runs ``x``."""
    if compiled_for(x, backend, cpu):
        return COMPILED
    kern = kernels_for(x, backend)
    return REFERENCE if kern is None else _triton(kern)


class Choice:
    """A codec's backend policy, fixed at construction: the backend asked for and what
    ``auto`` runs on the CPU; each kind of input (numpy, a torch device type) is resolved on
    its first use and kept."""

    def __init__(self, backend: str = "auto", cpu: str = "compiled"):
        check(backend)
        if cpu not in CPU_CHOICES:
            raise ValueError(f"the codec's CPU backend must be 'compiled' or 'reference' "
                             f"(THC_CODEC_CPU), got {cpu!r}")
        self.backend = backend
        self.cpu = cpu
        self._chosen: dict[str, Backend] = {}

    def __call__(self, x) -> Backend:
        kind = x.device.type if is_torch(x) else "numpy"
        b = self._chosen.get(kind)
        if b is None:
            b = pick(x, self.backend, self.cpu)
            if kind != "cpu" or b.name != "triton":
                self._chosen[kind] = b   # the interpreter's switch is checked every time
        return b
