"""Mininet emulation of a THC cluster: testbeds, the main job, the fault matrix and the
benchmarks over emulated links (the folder is mininet/thcnet/, so that it never shadows
Mininet's own ``mininet`` package)."""
from thc.namespace import one_name

one_name(__name__, "thc.emu")
