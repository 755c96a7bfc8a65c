"""THC (Tensor Homomorphic Compression) with in-network aggregation: the public API.

What the README teaches, importable from here (``from thc import THCCodec``):

  codec        THCParams, THCCodec, ErrorFeedback
  cluster      Cluster, Job (the config the controller and the aggregator share)
  client       AggregationClient, AggregationResult, AggregationTimeout, AggregationRefused,
               AggregatorRestarted, worker_client (the client of a rank from a cluster file)
  all-reduce   THCAllReduce, GraphedAllReduce (its rounds replayed from a CUDA graph)
  DDP hooks    THCHook, TopKHook, MarsitHook, MarsitVoteHook, HookOptions
  aggregator   Aggregator (Python), FastAggregator (compiled)
  settings     Settings

Each name loads its module on first use, so ``import thc`` stays light (no torch) and the
``thc`` command loads only what a subcommand runs. The subpackages, bottom first, each
importing only those below it: thc.codec, thc.wire, thc.net, thc.collective; thc.app,
thc.bench, thc.testing; thc.controller (the switch's P4Runtime controller); thc.emu (the
Mininet emulation, the main job); thc.cli (the ``thc`` command) on top.

The folders keep their names (host/, controller/, mininet/thcnet/); ``thc`` is the only name
they import under, so no module exists twice with two copies of its state.
"""
from __future__ import annotations

from thc.namespace import exports, one_name

one_name(__name__, "thc")

_API = {
    "THCParams": "thc.codec.params",
    "THCCodec": "thc.codec.thc",
    "ErrorFeedback": "thc.codec.thc",
    "Settings": "thc.codec.settings",
    "Cluster": "thc.wire.jobs",
    "Job": "thc.wire.jobs",
    "AggregationClient": "thc.net.client",
    "AggregationResult": "thc.net.outcomes",
    "AggregationTimeout": "thc.net.outcomes",
    "AggregationRefused": "thc.net.outcomes",
    "AggregatorRestarted": "thc.net.outcomes",
    "Aggregator": "thc.net.aggregator",
    "FastAggregator": "thc.net.fastagg",
    "worker_client": "thc.collective.worker",
    "THCAllReduce": "thc.collective.allreduce",
    "GraphedAllReduce": "thc.collective.graphed",
    "THCHook": "thc.collective.ddp",
    "TopKHook": "thc.collective.ddp",
    "MarsitHook": "thc.collective.ddp",
    "MarsitVoteHook": "thc.collective.ddp",
    "HookOptions": "thc.collective.ddp_base",
}
"""Public name -> the module that defines it."""

__all__ = sorted(_API)
__getattr__, __dir__ = exports(__name__, _API)
