"""The codec's one counter-based generator: rotation signs and reproducible rounding draws.

Why counter-based: every worker of a job must apply the same random diagonal without talking,
whether it encodes with numpy, torch on the CPU, torch on CUDA or a Triton kernel. A value
that is a pure function of (seed, round, slice, index), computed in 32-bit unsigned integer
arithmetic (wrapping multiply, xor, logical shift), is the same on all of them and needs no
state to be carried to a device.

Definition (all arithmetic mod 2^32):

- ``mix32(x)``: x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
  (a bijection with good avalanche).
- ``absorb((h, g), w)``, a step on a 64-bit state of two words:
  h = mix32((h ^ w) + GOLDEN); g = mix32(g ^ h); h = mix32((h ^ g) + KEY2).
  For a given state it is one-to-one in w, and for a given w one-to-one in the state.
- ``slice_key(seed, round, slice, stream)`` = (k0, k1): the state (0, 0) after absorbing
  stream, seed low, seed high, round low, round high and slice, in that order. Two
  (round, slice) pairs of one job share a key only where their states before the slice
  word agree in g and differ in h by the slices' xor: for S slices a round, about S / 2^64
  a pair of rounds.
- ``block(j)`` = mix32(mix32(j ^ k0) ^ k1).
- Rotation sign of coordinate i of a slice (stream 0): bit (i mod 32) of block(i div 32),
  least significant bit first; bit 1 means -1, bit 0 means +1.
- Rounding uniform of coordinate i (stream 1, keyed by the caller's seed, not the job's):
  (block(i) >> 8) * 2^-24, a float32 in [0, 1) that every backend represents exactly.
"""
from __future__ import annotations

import sys

import numpy as np

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
MUL1, MUL2 = 0x7FEB352D, 0x846CA68B
KEY2 = 0x85EBCA6B
SIGN_STREAM = 0
UNIFORM_STREAM = 1
UNIFORM_SCALE = 2.0 ** -24
SCHEDULE = 2
"""The key schedule's version (2: the 64-bit state), in every round's fingerprint: workers
drawing by unlike schedules (one of them running an older release) would sum indices of
unlike rotations, and refuse their rounds instead."""


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def mix32_int(x: int) -> int:
    """mix32 of one Python int (the key schedule runs on the host, in exact integers)."""
    x &= M32
    x ^= x >> 16
    x = (x * MUL1) & M32
    x ^= x >> 15
    x = (x * MUL2) & M32
    x ^= x >> 16
    return x


def absorb(state: int, word: int) -> int:
    """One step of the key schedule on a state held as one int, g << 32 | h."""
    h, g = (state & M32) ^ (int(word) & M32), state >> 32
    h = mix32_int((h + GOLDEN) & M32)
    g = mix32_int(g ^ h)
    h = mix32_int(((h ^ g) + KEY2) & M32)
    return g << 32 | h


def seed_state(seed: int, stream: int) -> int:
    """The key schedule up to the round words: fixed for a job (and stream), so a kernel that
    reads the round from device memory finishes the prefix itself (:func:`finish_prefix`)."""
    seed = int(seed)
    if not 0 <= seed < (1 << 64):
        raise ValueError(f"seed must be an integer in [0, 2^64), got {seed}")
    state = absorb(0, int(stream))
    for w in (seed & M32, seed >> 32):
        state = absorb(state, w)
    return state


def finish_prefix(state: int, round_: int) -> int:
    """:func:`key_prefix` from :func:`seed_state`: the round's two words."""
    if isinstance(round_, bool) or not isinstance(round_, (int, np.integer)) \
            or not 0 <= round_ < (1 << 64):
        raise ValueError(f"round must be an integer in [0, 2^64), got {round_!r}")
    round_ = int(round_)
    for w in (round_ & M32, round_ >> 32):
        state = absorb(state, w)
    return state


def key_prefix(seed: int, round_: int, stream: int) -> int:
    """The key schedule up to the slice word (a 64-bit state): shared by every slice of one
    (seed, round, stream), so a kernel finishes each slice's key itself from this one value."""
    return finish_prefix(seed_state(seed, stream), round_)


def key_from_prefix(prefix: int, slice_index: int) -> tuple[int, int]:
    """(k0, k1) of one slice from :func:`key_prefix`."""
    slice_index = int(slice_index)
    if not 0 <= slice_index < (1 << 32):
        raise ValueError(f"slice must be an integer in [0, 2^32), got {slice_index}")
    state = absorb(prefix, slice_index)
    return state & M32, state >> 32


def slice_key(seed: int, round_: int, slice_index: int, stream: int) -> tuple[int, int]:
    """(k0, k1) of one slice: the only per-slice state a backend needs."""
    return key_from_prefix(key_prefix(seed, round_, stream), slice_index)


def slice_keys(seed: int, round_: int, slices, stream: int) -> np.ndarray:
    """Keys of several slices as a (count, 2) uint32 array."""
    prefix = key_prefix(seed, round_, stream)
    idx = np.asarray(list(slices), dtype=np.int64).reshape(-1)
    if idx.size and not (0 <= idx.min() and idx.max() < (1 << 32)):
        raise ValueError(f"slices must be integers in [0, 2^32), got {idx.min()}..{idx.max()}")
    h, g = absorb_np(np.uint32(prefix & M32) ^ idx.astype(np.uint32),
                     np.full(idx.shape, prefix >> 32, np.uint32))
    return np.stack([h, g], axis=1)


def absorb_np(h: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`absorb` on uint32 arrays whose word is already xored into ``h``."""
    h = _mix32_np(h + np.uint32(GOLDEN))
    g = _mix32_np(g ^ h)
    return _mix32_np((h ^ g) + np.uint32(KEY2)), g


def _mix32_np(x: np.ndarray) -> np.ndarray:
    x ^= x >> np.uint32(16)
    x *= np.uint32(MUL1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(MUL2)
    x ^= x >> np.uint32(16)
    return x


def blocks_np(counters: np.ndarray, k0: int, k1: int) -> np.ndarray:
    """block(j) for uint32 counters j (numpy)."""
    x = counters.astype(np.uint32) ^ np.uint32(k0)
    x = _mix32_np(x)
    x ^= np.uint32(k1)
    return _mix32_np(x)


def _mix32_torch(x):
    """mix32 on int64 tensors holding uint32 values: the low 32 bits of an int64 product are
    those of the uint32 product, and masking keeps the shifts logical."""
    x = x ^ (x >> 16)
    x = (x * MUL1) & M32
    x = x ^ (x >> 15)
    x = (x * MUL2) & M32
    return x ^ (x >> 16)


def blocks_torch(counters, k0: int, k1: int):
    """block(j) for counters j (an int64 tensor on any device); int64 holding uint32."""
    x = _mix32_torch((counters & M32) ^ k0)
    return _mix32_torch(x ^ k1)


_LSB_SIGNS = (1 - 2 * np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1,
                                    bitorder="little").astype(np.int32)).astype(np.float32)
"""Row b: the eight ±1 signs of byte b, least significant bit first."""


def _as_list(slice_index):
    many = not isinstance(slice_index, (int, np.integer))
    return (list(slice_index) if many else [int(slice_index)]), many


def signs(n: int, seed: int, round_: int = 0, slice_index=0, like=None, impl: str = "auto"):
    """The rotation diagonal: ±1 float32 of length n, or (len(slice_index), n) for a list.

    numpy for numpy ``like``; a tensor on ``like``'s device for torch. ``impl``: ``numpy`` or
    ``torch`` forces where the integers are computed (both give the same bits; the default
    computes in numpy for numpy and CPU tensors, in torch on other devices).
    """
    indices, many = _as_list(slice_index)
    n = int(n)
    words = (n + 31) // 32
    keys = slice_keys(seed, round_, indices, SIGN_STREAM)
    use_torch = impl == "torch" or (impl == "auto" and _is_torch(like)
                                    and like.device.type != "cpu")
    if use_torch:
        import torch
        dev = like.device if _is_torch(like) else torch.device("cpu")
        j = torch.arange(words, dtype=torch.int64, device=dev)
        rows = [blocks_torch(j, int(k0), int(k1)) for k0, k1 in keys]
        w = torch.stack(rows) if rows else torch.zeros((0, words), dtype=torch.int64, device=dev)
        bits = (w[:, :, None] >> torch.arange(32, device=dev)) & 1
        out = (1 - 2 * bits.reshape(len(indices), -1)[:, :n]).to(torch.float32)
    else:
        j = np.arange(words, dtype=np.uint32)
        w = np.stack([blocks_np(j, int(k0), int(k1)) for k0, k1 in keys]) if len(keys) \
            else np.zeros((0, words), np.uint32)
        b = w.astype("<u4").view(np.uint8).reshape(len(indices), -1)
        out = np.take(_LSB_SIGNS, b, axis=0).reshape(len(indices), -1)
        if out.shape[1] != n:
            out = np.ascontiguousarray(out[:, :n])
        if _is_torch(like):
            import torch
            out = torch.from_numpy(out).to(like.device)
    return out if many else out[0]


def uniforms(n: int, seed: int, round_: int = 0, slice_index=0, like=None, impl: str = "auto"):
    """Reproducible rounding draws: float32 in [0, 1), (len(slice_index), n) for a list."""
    indices, many = _as_list(slice_index)
    n = int(n)
    keys = slice_keys(seed, round_, indices, UNIFORM_STREAM)
    use_torch = impl == "torch" or (impl == "auto" and _is_torch(like)
                                    and like.device.type != "cpu")
    if use_torch:
        import torch
        dev = like.device if _is_torch(like) else torch.device("cpu")
        i = torch.arange(n, dtype=torch.int64, device=dev)
        rows = [(blocks_torch(i, int(k0), int(k1)) >> 8).to(torch.float32) * UNIFORM_SCALE
                for k0, k1 in keys]
        out = torch.stack(rows) if rows else torch.zeros((0, n), device=dev)
    else:
        i = np.arange(n, dtype=np.uint32)
        out = np.empty((len(keys), n), np.float32)
        for r, (k0, k1) in enumerate(keys):
            np.multiply((blocks_np(i, int(k0), int(k1)) >> np.uint32(8)).astype(np.float32),
                        np.float32(UNIFORM_SCALE), out=out[r])
        if _is_torch(like):
            import torch
            out = torch.from_numpy(out).to(like.device)
    return out if many else out[0]
