"""THC's codec: parameters, lookup table, rotation, quantization, packing, and baselines.

The bottom layer: it imports nothing else of the project.
"""
from thc.codec.params import THCParams
from thc.codec.thc import ErrorFeedback, THCCodec

__all__ = ["THCParams", "THCCodec", "ErrorFeedback"]
