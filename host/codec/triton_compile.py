"""The codec's Triton kernels compiled ahead of time for a GPU that is not here: the check
that what the interpreter runs (tests/test_codec_kernels.py) also builds for the device, whose
compiler is stricter (tile shapes of the matrix products, static branches, return types).

Triton documents no way to compile for a device that is absent: ``ASTSource``, ``GPUTarget``
and the compiled kernel's ``metadata`` are its internals, as of triton 3.9 (the version this
was written against); an upgrade that breaks this module fails the compile test, not the
codec."""
from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from thc.codec import triton_kernels as tk


def compile_for(padded: int, arch: int = 90, device_round: bool = False,
                form: str | None = None, tiles: int = 1) -> dict:
    """Compile the kernels (the decode's first pass twice: on sums and on one worker's
    indices; encode pass 2 twice: with the slices' own norms and, ``_checked``, without; the
    norms' finish after encode pass 1) for a slice of ``padded`` coordinates
    for CUDA compute capability ``arch`` (90: H100) at the module's settings
    (``device_round``: the variant that reads the round from device memory; ``form``: one of
    tk.FORMS, default tk.FORM; ``tiles``: row tiles a program). Returns kernel name
    (``_decode_rows_sums``: the pass on sums) -> shared memory bytes."""
    sh = tk.Shape(padded)
    rows = dict(C=sh.C, C1=sh.C1, BM=sh.BM, PREC=tk.PRECISION, FORM=form or tk.FORM,
                TILES=tiles)
    cols = dict(R=sh.R, C=sh.C, R1=sh.R1, BN=sh.BN, PREC=tk.PRECISION, FORM=form or tk.FORM,
                FIRST=tk.COLS_FIRST)
    jobs = [
        (tk._encode_rows, dict(X="*bf16", TMP="*fp32", PART="*fp64", STATUS="*i32", prefix="i64",
                               ROUND="*i64", first="i32", length="i32", d="i32"),
         dict(rows, DEV_ROUND=device_round)),
        (tk._finish_norms, dict(PART="*fp64", NORMS="*fp32", STATUS="*i32", first="i32",
                                parts="i32", limit="fp32", mark="fp32"),
         dict(P=triton.next_power_of_2(sh.R // sh.BM // tiles))),
        *((tk._encode_cols, dict(TMP="*fp32", OUT="*u8", MAXN="*fp32", OWN="*fp32",
                                 STATUS="*i32", uprefix="i64", ROUND="*i64", first="i32",
                                 count="i32", LOWER="*i32", BASE="*fp32", WIDTH="*fp32", d="i32",
                                 g="i32", scale="fp32", limit="fp32", floor="fp32",
                                 reach="fp32"),
           dict(cols, PACK=True, DEV_ROUND=device_round, HAS_OWN=own)) for own in (True, False)),
        (tk._decode_rows, dict(S="*u8", TMP="*fp32", TABLE="*u8", STATUS="*i32", centre="fp32",
                               d="i32", levels="i32", top="i32"), dict(rows, LOOKUP=True)),
        (tk._decode_rows, dict(S="*i16", TMP="*fp32", TABLE="*i16", STATUS="*i32",
                               centre="fp32", d="i32", levels="i32", top="i32"),
         dict(rows, LOOKUP=False)),
        (tk._decode_cols, dict(TMP="*fp32", OUT="*fp32", MAXN="*fp32", STATUS="*i32", prefix="i64",
                               ROUND="*i64", first="i32", count="i32", length="i32", d="i32",
                               scale="fp32", limit="fp32", floor="fp32"),
         dict(cols, DEV_ROUND=device_round)),
    ]
    out = {}
    for fn, sig, consts in jobs:
        sig = dict(sig, **{k: "constexpr" for k in consts})
        warps = tk.NUM_WARPS_COLS if fn in (tk._encode_cols, tk._decode_cols) else tk.NUM_WARPS
        k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": warps})
        out[fn.__name__ + ("" if consts.get("LOOKUP", True) else "_sums")
            + ("" if consts.get("HAS_OWN", True) else "_checked")] = k.metadata.shared
    return out
