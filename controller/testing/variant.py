"""A BMv2 build of thc.p4 with other compile-time parameters (fewer lanes for the lane sweep
of ``thc bench switch``, a short run idle time for the tests of the idle rule), written and
compiled outside the committed build (needs p4c). The generator is p4src/gen_p4.py, a script
beside the programs rather than a module of this package: ``generator`` loads it from its
path, for the tests of the committed builds too."""
from __future__ import annotations

import importlib.util
import subprocess
import time
from pathlib import Path

GEN_P4 = Path(__file__).resolve().parents[2] / "p4src" / "gen_p4.py"


def generator():
    """p4src/gen_p4.py as a module."""
    spec = importlib.util.spec_from_file_location("gen_p4", GEN_P4)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def build_variant(out: Path | str, lanes: int | None = None, slots: int | None = None,
                  run_idle_s: float | None = None) -> float:
    """Write the variant's sources under ``out``/src and compile them into ``out``
    (thc.json, thc.p4info.txt: a build directory for LocalBMv2); the compile's seconds."""
    out = Path(out)
    main = generator().write_variant(out / "src", lanes=lanes, slots=slots,
                                      run_idle_s=run_idle_s)
    t0 = time.perf_counter()
    r = subprocess.run(["p4c", "--target", "bmv2", "--arch", "v1model", "-o", str(out),
                        "--p4runtime-files", str(out / "thc.p4info.txt"), str(main)],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"p4c failed on the variant in {out}: {r.stderr[-2000:]}")
    return time.perf_counter() - t0
