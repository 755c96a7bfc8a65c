"""THC host library: codec, wire protocol, software aggregator, transport and training hooks."""
