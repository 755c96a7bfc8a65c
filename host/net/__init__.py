"""The network layer: the host transport (client), the software aggregator, impairments."""
