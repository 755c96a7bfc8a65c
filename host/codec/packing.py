"""Bit packing of b-bit table indices, the one packer of the project.

The first index goes into the most significant bits of the first byte. For b = 4 this is the
DATA payload of the wire protocol (two indices a byte, the first in the high nibble), the
order in which the P4 parser reads them.
"""
from __future__ import annotations

import operator

import numpy as np

from thc.codec.hadamard import is_torch


def comparable(t):
    """A torch integer tensor whose min and max can be taken: unsigned 16- to 64-bit ones
    have none, so they are widened to int64 (2^63 and more then read as negative, which
    every range check refuses)."""
    import torch
    return t.to(torch.int64) if t.dtype in (torch.uint16, torch.uint32, torch.uint64) else t


def packed_size(count: int, bits: int) -> int:
    return (int(count) * int(bits) + 7) // 8


def _check_bits(bits: int) -> int:
    """An integer width: 4.5 or True would otherwise run as 4 or 1 bits."""
    try:
        b = None if isinstance(bits, bool) else operator.index(bits)
    except TypeError:
        b = None
    if b is None or not 1 <= b <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    return b


def pack_bits(idx, bits: int):
    """Pack b-bit indices into bytes, most significant bit first, the first index in the high
    bits (for b = 4: the wire's DATA payload, two indices a byte, the first in the high
    nibble). The last byte is zero-padded."""
    b = _check_bits(bits)
    torch_in = is_torch(idx)
    # the range on the values as given: a cast to bytes first would wrap 259 to 3
    if torch_in:
        import torch
        x = idx.reshape(-1)
        if x.is_floating_point() or x.is_complex():
            raise TypeError(f"table indices are integers, got {x.dtype}: a cast would read "
                            f"3.7 as 3")
        if x.numel() and x.dtype != torch.bool:
            # one wait on a GPU
            lo, hi = (int(v) for v in torch.stack(torch.aminmax(comparable(x))).tolist())
            if hi >> b or lo < 0:
                raise ValueError(f"indices {lo}..{hi} do not fit in {b} bits")
        x = x.to(torch.uint8)
    else:
        x = np.asarray(idx).reshape(-1)
        if x.dtype.kind not in "biu" and x.size:   # np.asarray([]) is float64
            raise TypeError(f"table indices are integers, got {x.dtype}: a cast would read "
                            f"3.7 as 3")
        # one pass for the common unsigned input; a second for the lower bound otherwise
        if x.size and (int(x.max()) >> b or (x.dtype.kind not in "ub" and int(x.min()) < 0)):
            raise ValueError(f"indices {int(x.min())}..{int(x.max())} do not fit in {b} bits")
        x = x.astype(np.uint8, copy=False)
    n = x.shape[0]
    if b == 8:
        return x.clone() if torch_in else x.copy()
    if 8 % b == 0:
        # b divides 8: OR the 8/b indices of each byte together, one strided column at a time
        per = 8 // b
        if n % per:
            x = torch.nn.functional.pad(x, (0, (-n) % per)) if torch_in else \
                np.concatenate((x, np.zeros((-n) % per, np.uint8)))
        x = x.reshape(-1, per)
        acc = x[:, 0] << (8 - b) if torch_in else x[:, 0] << np.uint8(8 - b)
        for i in range(1, per):
            shift = 8 - b * (i + 1)
            acc |= x[:, i] << (shift if torch_in else np.uint8(shift))
        return acc
    # other widths: through a bit matrix (b bits per index, MSB first), 8 bits per byte
    if not torch_in:
        return np.packbits(np.unpackbits(x[:, None], axis=1)[:, 8 - b:].reshape(-1))
    shifts = torch.arange(b - 1, -1, -1, dtype=torch.uint8, device=x.device)
    bitv = ((x.unsqueeze(1) >> shifts) & 1).reshape(-1)
    bitv = torch.nn.functional.pad(bitv, (0, (-bitv.numel()) % 8)).reshape(-1, 8)
    weights = torch.arange(7, -1, -1, dtype=torch.uint8, device=x.device)
    return (bitv << weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _as_bytes(p, not_integers: bool):
    """Packed bytes given in a wider integer type, checked: a cast would wrap 300 to 44."""
    if not_integers:
        raise TypeError(f"packed indices are bytes, got {p.dtype}")
    q = comparable(p) if is_torch(p) else p
    if p.shape[0] and (int(q.min()) < 0 or int(q.max()) > 255):
        raise ValueError(f"packed bytes {int(q.min())}..{int(q.max())} are not bytes")
    if is_torch(p):
        import torch
        return p.to(torch.uint8)
    return p.astype(np.uint8)


def unpack_bits(packed, bits: int, count: int):
    """Inverse of :func:`pack_bits`: ``count`` indices (uint8) from the packed bytes."""
    b = _check_bits(bits)
    try:
        n = operator.index(count)   # 7.9 indices were cut to 7
    except TypeError:
        n = -1
    if isinstance(count, bool) or n < 0:
        raise ValueError(f"count must be an integer >= 0, got {count!r}")
    count = n
    torch_in = is_torch(packed)
    if torch_in:
        import torch
        p = packed.reshape(-1)
        if p.dtype != torch.uint8:
            p = _as_bytes(p, p.is_floating_point() or p.is_complex() or p.dtype == torch.bool)
    else:
        p = np.asarray(packed).reshape(-1)
        if p.dtype != np.uint8:
            p = _as_bytes(p, p.dtype.kind not in "ui")
    if p.shape[0] != packed_size(count, b):
        raise ValueError(f"{count} indices of {b} bits need {packed_size(count, b)} bytes, "
                         f"got {p.shape[0]}")
    if b == 8:
        return p.clone() if torch_in else p.copy()
    if 8 % b == 0:
        per = 8 // b
        mask = (1 << b) - 1
        if torch_in:
            out = torch.empty((p.shape[0], per), dtype=torch.uint8, device=p.device)
            for i in range(per):
                torch.bitwise_and(p >> (8 - b * (i + 1)), mask, out=out[:, i])
        else:
            out = np.empty((p.shape[0], per), dtype=np.uint8)
            for i in range(per):
                np.bitwise_and(p >> np.uint8(8 - b * (i + 1)), np.uint8(mask), out=out[:, i])
        return out.reshape(-1)[:count]
    if not torch_in:
        bitv = np.unpackbits(p, count=count * b).reshape(count, b)
        full = np.zeros((count, 8), dtype=np.uint8)
        full[:, 8 - b:] = bitv
        return np.packbits(full, axis=1).reshape(-1)
    dev = p.device
    bitv = (p.unsqueeze(1) >> torch.arange(7, -1, -1, dtype=torch.uint8, device=dev)) & 1
    bitv = bitv.reshape(-1)[: count * b].reshape(count, b)
    weights = torch.arange(b - 1, -1, -1, dtype=torch.uint8, device=dev)
    return (bitv << weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)
