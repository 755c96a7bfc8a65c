"""The training worker's modes (``thc.app.train --mode``), named in one place for the worker
and the main job that launches it, which imports this without torch."""

MODES = ("fp32", "fp16", "thc", "thc-dist", "topk", "marsit", "marsit-vote")
AGGREGATED = ("thc", "marsit-vote")
"""The modes whose rounds go through an aggregator: the only ones that read its client's
flags (``--config``, ``--agg``, ...); the others refuse them."""
