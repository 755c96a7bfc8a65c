"""Mininet emulation of a THC cluster (named thcnet so it never shadows Mininet itself)."""
