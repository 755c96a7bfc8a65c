"""argparse types shared by the training worker's and the main job's command lines."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A count that must be at least 1: zero epochs, steps, workers or images would start a
    job that trains nothing (``--max-steps 0`` used to walk every epoch idle)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value
