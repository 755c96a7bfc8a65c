"""Mininet emulation of a THC cluster: testbeds, the main job, the fault matrix and the
benchmarks over emulated links (the folder is mininet/thcnet/, so that it never shadows
Mininet's own ``mininet`` package)."""

if __name__ != "thc.emu":
    raise ImportError(f"the mininet/thcnet/ folder is the package 'thc.emu': import thc.emu, "
                      f"not {__name__}")
