"""Collectives built on the codec and the transport: THC all-reduce and DDP hooks, and what
a worker program does before its first round (worker)."""
