"""THC host library, in layers (each imports only those below it):

  host.codec       THC codec and baselines (bottom)
  host.wire        protocol constants, header, scapy layers, job config
  host.net         transport client, software aggregator, impairments
  host.collective  THC all-reduce, DDP hooks
  host.app, host.bench, host.testing   training worker, benchmarks, test helpers

controller/ and mininet/thcnet/ build on host, which never imports them; host.cli (the
``thc`` command) sits on top of them all.
"""
