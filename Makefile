# THC in-network aggregation. `make run` (main job) and `make test` set themselves up.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Evaluated by the shell when a recipe line runs (make expands a whole recipe up front).
SITE    = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DEBIAN_MININET := /usr/lib/python3/dist-packages/mininet
P4C    ?= p4c
P4SRC  := p4src
P4OUT  := $(P4SRC)/build
WORKERS ?= 4

.PHONY: setup system-deps test fuzz run run-bmv2 sweep p4 p4-check p4-tofino bench bench-gpu mininet faults clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt setup.py $(wildcard host/net/_fastagg*.[ch]) host/codec/_fastcodec.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' -c constraints.txt
	@if [ -d $(DEBIAN_MININET) ]; then ln -sfn $(DEBIAN_MININET) "$(SITE)/mininet"; fi
	touch $@

# Debian's Mininet and Fashion-MNIST, and what the venv and the C extensions need (root only;
# elsewhere: loopback testbed, digits data).
system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; \
	  for p in mininet bridge-utils iputils-ping iproute2 ethtool iptables nftables dataset-fashion-mnist python3-venv python3-dev gcc; do \
	    dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; \
	  done; \
	  if [ -n "$$missing" ]; then \
	    echo "installing from Debian:$$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || echo "warning: could not install$$missing; emulation falls back to loopback"; \
	  fi; \
	fi
	@if [ -d $(DEBIAN_MININET) ] && [ -x $(PY) ]; then ln -sfn $(DEBIAN_MININET) "$(SITE)/mininet"; fi

# Six pytest processes (on two cores: many tests wait on sockets, timers, switches and child
# processes); the tests that start Mininet testbeds or namespaces run one after another in
# one of them, those that start BMv2 switches in three groups of their own (tests/conftest.py).
TEST_PROCESSES ?= 6
test: system-deps setup
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadgroup

# The model-based fuzz at length: every engine against host/wire/model.py (tests/model_fuzz.py),
# then the Tofino program read from its text, slot state and sums (tests/tna/interleave.py: 300
# packets a case), and its sums with the passes after pass 0 three packets late
FUZZ_STEPS ?= 1000000
TNA_FUZZ_CASES ?= 2000
fuzz: setup
	$(PY) -m tests.model_fuzz --steps $(FUZZ_STEPS)
	$(PY) -m tests.tna.interleave --cases $(TNA_FUZZ_CASES)
	$(PY) -m tests.tna.interleave --cases $$(( $(TNA_FUZZ_CASES) / 4 )) --delay 3
	$(PY) -m tests.tna.interleave --cases $$(( $(TNA_FUZZ_CASES) / 4 )) --delay 4 --lose 0.2

# The main job; a mode through BMv2 trains a bounded number of steps (--bmv2-steps).
run: system-deps setup
	$(PY) -m thc.cli run --workers $(WORKERS)

# FP32, THC through the software shards and THC through BMv2, every mode for every epoch.
run-bmv2: system-deps setup
	$(PY) -m thc.cli run --workers $(WORKERS) --modes fp32,thc,thc-bmv2 --bmv2-steps all

# The main job at 50-1000 Mbit/s with FP32, FP16 and THC (Mininet, root): where THC stops
# paying, measured and modelled (docs/results.md).
sweep: system-deps setup
	$(PY) -m thc.cli sweep --workers $(WORKERS) --out out/sweep $(SWEEP_ARGS)

# On a machine with an NVIDIA GPU: the GPU tests, then the codec, its kernels one by one and
# the DDP hook on ResNet-50 timed (`make bench-gpu PY=python3` where torch with CUDA is the
# system's, with this checkout importable as thc).
GPU_OUT ?= out/gpu
bench-gpu:
	$(PY) -m pytest -q tests/test_codec_gpu.py tests/test_graphed_gpu.py tests/test_graphed_deferred.py tests/test_round_kernels.py \
		tests/test_codec_kernels.py tests/test_codec_checks.py tests/test_graphed.py tests/test_bench_codec.py
	$(PY) -m thc.cli bench kernels --precisions tf32x2,ieee,tf32x3 --json $(GPU_OUT)/kernels.json
	$(PY) -m thc.cli bench codec --device cuda --json $(GPU_OUT)/codec.json --plot $(GPU_OUT)/codec.png
	$(PY) -m thc.cli bench hook --json $(GPU_OUT)/hook.json --plot $(GPU_OUT)/hook.png
	$(PY) -m thc.cli model --gpu-codec $(GPU_OUT)/hook.json

bench: setup
	$(PY) -m thc.cli bench codec --json out/bench_codec.json
	$(PY) -m thc.cli nmse --json out/nmse.json --plot out/nmse.png
	$(PY) -m thc.cli bench aggregator --json out/bench_aggregator.json

# Compile the P4 program (BMv2 JSON + P4Info) from the protocol constants.
p4: setup
	@command -v $(P4C) >/dev/null || { echo "make p4: '$(P4C)' not found on PATH. Install p4c (p4lang's packages or docker image) to rebuild; the committed build in $(P4OUT)/ still works."; exit 2; }
	@command -v p4c-bm2-ss >/dev/null || { echo "make p4: p4c's BMv2 back end (p4c-bm2-ss) is not installed: install a p4c package or image from p4lang that includes it; the committed build in $(P4OUT)/ still works."; exit 2; }
	$(PY) $(P4SRC)/gen_p4.py
	mkdir -p $(P4OUT)
	$(P4C) --target bmv2 --arch v1model -o $(P4OUT) --p4runtime-files $(P4OUT)/thc.p4info.txt $(P4SRC)/thc.p4
	$(PY) $(P4SRC)/gen_p4.py --record

# Compile the Tofino (TNA) program with p4c's Tofino back end and commit its resource summary
# and P4Info (p4src/build/tofino/). The back end is not part of p4c's default build.
P4TOFINO_OUT ?= out/p4-tofino
p4-tofino: setup
	@command -v $(P4C) >/dev/null || { echo "make p4-tofino: '$(P4C)' not found on PATH."; exit 2; }
	@command -v p4c-barefoot >/dev/null || { echo "make p4-tofino: the Tofino back end (p4c-barefoot) is not installed: install a p4c package or image from p4lang that includes it."; exit 2; }
	@command -v bfas >/dev/null || { echo "make p4-tofino: the Tofino assembler (bfas) is not installed: install a p4c package or image from p4lang that includes the Tofino back end."; exit 2; }
	$(PY) $(P4SRC)/gen_p4.py
	rm -rf $(P4TOFINO_OUT)
	P4C=$(P4C) $(PY) $(P4SRC)/gen_p4.py --compile-tofino $(P4TOFINO_OUT)/out

p4-check: setup
	$(PY) $(P4SRC)/gen_p4.py --check

mininet: system-deps setup
	$(PY) -m thc.emu.run --workers $(WORKERS)

# The fault matrix (Mininet when root, else loopback) into docs/faults.md.
faults: system-deps setup
	$(PY) -m thc.cli faults --out docs/faults.md $(FAULTS_ARGS)

clean:
	rm -rf out .pytest_cache
