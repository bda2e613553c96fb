# `make install`, `make bench` and `make test` (re)create .venv when it is missing or stale.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python

.PHONY: install bench test typecheck gpu-test gpu-bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test,plot,serve,mooncake]'
	@touch $(STAMP)

# The installed bench (model, multi-turn), then the host-hit bench from benchmarks/ (not installed).
bench: $(STAMP)
	$(PY) -m jhicache.bench
	$(PY) -m benchmarks.host_hit

install: $(STAMP)

# One pytest worker per core (pytest-xdist): the suite is mostly XLA compiles, one core each.
# Each worker takes whole test modules (loadfile), those with slow tests first (tests/conftest.py;
# not reordered by their count of tests): a module's tests share its fixtures (engines, servers)
# and compiled programs; split over both workers, a module compiled its programs in both at
# once, and a tensor-parallel group could not read back the other's.
test: $(STAMP)
	$(PY) -m ruff check .
	$(MAKE) --no-print-directory typecheck
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -p no:cacheprovider -n auto --dist loadfile --no-loadscope-reorder tests

# mypy over the package as an install lays it out (models/ and pallas_kernels/ inside jhicache/,
# as pyproject's package-dir maps them): a tree of links under build/, so that the calls from
# jhicache into them are checked too (mypy does not follow jhicache's __path__ extension).
VIEW := build/mypy
typecheck: $(STAMP)
	@rm -rf $(VIEW) && mkdir -p $(VIEW)/jhicache && ln -s $(CURDIR)/jhicache/* $(VIEW)/jhicache/
	@ln -s $(CURDIR)/models $(VIEW)/jhicache/models
	@ln -s $(CURDIR)/pallas_kernels $(VIEW)/jhicache/pallas_kernels
	@ln -s $(CURDIR)/benchmarks $(VIEW)/benchmarks
	@ln -s $(CURDIR)/examples $(VIEW)/examples
	cd $(VIEW) && $(CURDIR)/$(PY) -m mypy --config-file $(CURDIR)/pyproject.toml jhicache \
		benchmarks examples --exclude '$(UNTYPED_PROBES)'

# Probes kept as they were run, reaching into the engine's parts: not type-checked.
UNTYPED_PROBES := benchmarks/(forward_floor|step_vs_forward|head_rows_probe|weight_layout_probe)\.py

# On the GPU machine (preinstalled packages, no venv): the gpu-marked tests, then the bench.
gpu-test:
	JHICACHE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider -m gpu tests

gpu-bench:
	PYTHONPATH=. python3 -m jhicache.bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
