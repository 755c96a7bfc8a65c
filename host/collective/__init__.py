"""Collectives built on the codec and the transport: THC all-reduce and DDP hooks."""
