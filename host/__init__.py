"""THC host library, in layers (each imports only those below it):

  thc.codec       THC codec and baselines (bottom)
  thc.wire        protocol constants, header, scapy layers, job config
  thc.net         transport client, software aggregator, impairments
  thc.collective  THC all-reduce, DDP hooks
  thc.app, thc.bench, thc.testing   training worker, benchmarks, test helpers

controller/ and mininet/thcnet/ build on host, which never imports them; thc.cli (the
``thc`` command) sits on top of them all.
"""
