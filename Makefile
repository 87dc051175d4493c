# Two entry points (see README "Quick start"): `make run` and `make test`.
# Each creates .venv with the exact pins of requirements.lock on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/revnet.yaml
FLAX   := $(shell sed -n 's/^flax==//p' requirements.lock)

.PHONY: setup run demo test test-fast test-portability lint clean

$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	@# flax's own remat tests (tests/remat/test_flax_upstream.py) run against nn.remat and nnx.remat:
	@# take them from the pinned flax sdist on PyPI, at set-up time.
	mkdir -p $(VENV)/upstream
	$(PY) -m pip download --quiet --no-deps --no-binary :all: flax==$(FLAX) -d $(VENV)/upstream
	tar -xzf $(VENV)/upstream/flax-$(FLAX).tar.gz -C $(VENV)/upstream \
		flax-$(FLAX)/tests/linen/linen_transforms_test.py flax-$(FLAX)/tests/nnx/transforms_test.py
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) -m train --config $(CONFIG)

demo: $(STAMP)
	$(PY) -m remat_nn

# pyright type-checks remat_nn/ ([tool.pyright] in pyproject.toml). Its wrapper would otherwise
# ask PyPI on every run whether a newer pyright exists.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright

# The whole suite on two workers, the slowest 15 tests listed at the end. Tests are sent to the
# workers by module (loadscope), so a module's fixtures (compiled stacks, trainer caches) are
# built once, not once per worker; modules with slow tests first (conftest.py), so no long
# module is left to run alone at the end.
PYTEST := $(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder -q

test: $(STAMP) lint
	$(PYTEST) --durations=15

# The edit loop: everything but the tests marked slow (> 20 CPU-s each).
test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# The numerics-sensitive tests again under other vector code: XLA:CPU's code (and so the last
# bits of float results) differs by CPU model; the suite must pass whatever the machine runs.
# AVX is the oldest level that works: at SSE4_2, XLA:CPU (jaxlib 0.10) cannot link its float16
# conversions (`__truncsfhf2` missing), so every float16 program fails to compile there.
PORTABLE := tests/invertible tests/remat tests/memory tests/fused tests/models/test_bf16.py

test-portability: $(STAMP)
	XLA_FLAGS=--xla_cpu_max_isa=AVX $(PYTEST) $(PORTABLE)
	XLA_FLAGS=--xla_cpu_max_isa=AVX2 $(PYTEST) $(PORTABLE)

clean:
	rm -rf $(VENV) runs .pytest_cache
