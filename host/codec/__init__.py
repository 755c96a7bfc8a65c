"""THC's codec: parameters, lookup table, rotation, quantization, packing, and baselines.

The bottom layer: it imports nothing else of the project.
"""
from host.codec.params import THCParams
from host.codec.thc import ErrorFeedback, THCCodec

__all__ = ["THCParams", "THCCodec", "ErrorFeedback"]
