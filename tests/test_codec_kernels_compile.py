"""The codec's Triton kernels, and a graphed round's own (thc.collective.round_kernels),
compile for an H100 (sm_90) ahead of time, without a GPU (the codec's: the variant that reads
the round from device memory at 2^8, the other at 2^20, in both forms of the products and
with several row tiles a program).

The interpreter tests (test_codec_kernels.py) check what the kernels compute; this checks that
the same source also builds for the device, where the compiler is stricter (tile shapes of the
matrix products, static branches). It runs in a subprocess because the interpreter, once
asked for in this process, replaces the kernels by interpreted ones.
"""
import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys
from thc.codec import triton_compile, triton_kernels as tk
for log, device_round, form, tiles in ((8, True, None, 1), (20, False, None, tk.ROW_TILES),
                                       (20, False, "transpose", 1)):
    print(log, form, tiles, triton_compile.compile_for(1 << log, 90, device_round, form, tiles),
          flush=True)
for name, arg in tk.KEYED.items():
    param = next(p for p in getattr(tk, name).params if p.name == arg)
    print("keyed", name, arg, param.do_not_specialize, flush=True)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from thc.collective import round_kernels as rk
for fn, sig in ((rk._tagged, dict(NORMS="*fp32", ROUND="*i64", OUT="*fp32", n="i32",
                                  key_lo="i32", key_hi="i32", BLOCK="constexpr")),
                (rk._settle, dict(WORD="*i32", MAXIMA="*fp32", n="i32", CLEAN="*u8",
                                  OVERFLOW="*u8", REPORT="*fp64", ROUND="*i64", limit="fp32",
                                  BLOCK="constexpr")),
                (rk._keep, dict(Y="*fp32", OWN="*fp32", CLEAN="*u8", RES="*fp32", n="i32",
                                BLOCK="constexpr"))):
    triton.compile(ASTSource(fn, sig, dict(BLOCK=rk.BLOCK)), target=GPUTarget("cuda", 90, 32))
    print("round", fn.__name__, flush=True)
"""


def test_kernels_compile_for_sm90():
    try:
        import triton  # noqa: F401
        from triton.backends.nvidia import compiler
    except ImportError as e:
        pytest.skip(f"triton with its CUDA backend is not installed ({e})")
    try:   # the one reason to skip: any compile failure after this fails the test
        compiler.get_ptxas(90).path
    except RuntimeError as e:
        pytest.skip(f"no ptxas to compile for sm_90 with: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), env.get("PYTHONPATH")] if p)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(li.startswith("20 ") for li in lines) == 2
    for log in ("8", "20"):
        line = next(li for li in lines if li.startswith(log + " "))
        assert all(k in line for k in ("_encode_rows", "_finish_norms", "_encode_cols'",
                                       "_encode_cols_checked", "_decode_rows'",
                                       "_decode_rows_sums", "_decode_cols"))
    assert all(f"round {k}" in lines for k in ("_tagged", "_settle", "_keep"))
    # a key prefix of 1 made a constant by the launcher did not compile (once in 2^64 keys)
    keyed = [li for li in lines if li.startswith("keyed ")]
    assert len(keyed) == 3 and all(li.endswith(" True") for li in keyed), keyed
