"""The Triton kernels' module settings (host/codec/triton_kernels.py) a benchmark runs under:
``thc bench kernels --configs`` times each pass under them, ``thc bench codec --configs`` a
whole encode and decode from a CUDA graph. The syntax and the putting back, in one place."""
from __future__ import annotations

import contextlib

TUNABLE = ("PRECISION", "TILE", "TILE_COLS", "NUM_WARPS", "NUM_WARPS_COLS", "COLS_FIRST",
           "COLS_LOG", "FORM", "ROW_TILES", "MIN_PROGRAMS")
"""triton_kernels' module settings a run may change (and puts back): PRECISION by
``--precisions``, the others by ``--configs`` (FORM by name, one of ``FORMS``)."""


RANGES = {"TILE": (16, 1 << 16), "TILE_COLS": (16, 1 << 16), "NUM_WARPS": (1, 32),
          "NUM_WARPS_COLS": (1, 32), "ROW_TILES": (1, 64), "COLS_FIRST": (0, 1),
          "COLS_LOG": (0, 24), "MIN_PROGRAMS": (0, 1 << 20)}
"""Each integer setting's least and greatest value; the first four are powers of two
(Triton's block shapes and warp counts), so that a bad value is refused here rather than met
as a compile error, and so is ROW_TILES (the kernels would round it down)."""
POWERS = ("TILE", "TILE_COLS", "NUM_WARPS", "NUM_WARPS_COLS", "ROW_TILES")


def _value(name: str, text: str) -> int:
    low, high = RANGES[name]
    value = int(text)
    power = name in POWERS
    if not low <= value <= high or (power and value & (value - 1)):
        raise ValueError(f"config item {name}={text}: {name} is "
                         f"{'a power of two' if power else 'an integer'} in {low}..{high}")
    return value


def parse_configs(text: str, tk) -> list[dict]:
    """``A=1,B=2;A=3`` -> [{A: 1, B: 2}, {A: 3}] (one empty config for ''); each value within
    :data:`RANGES`."""
    out = []
    for part in text.split(";"):
        config = {}
        for item in filter(None, (p.strip() for p in part.split(","))):
            name, _, value = item.partition("=")
            if name == "FORM" and value in tk.FORMS:
                config[name] = value
                continue
            if name not in TUNABLE[1:] or name == "FORM" or not value.isdigit():
                names = ', '.join(n for n in TUNABLE[1:] if n != 'FORM')
                raise ValueError(f"config item {item!r}: use NAME=INTEGER with NAME one of "
                                 f"{names}, or FORM= one of "
                                 f"{', '.join(tk.FORMS)}")
            config[name] = type(getattr(tk, name))(_value(name, value))
        out.append(config)
    return out or [{}]


@contextlib.contextmanager
def applied(tk, config: dict):
    """``tk``'s module settings changed to ``config`` for the block, then put back."""
    saved = {k: getattr(tk, k) for k in config}
    try:
        for k, v in config.items():
            setattr(tk, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(tk, k, v)
