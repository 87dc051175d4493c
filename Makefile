# Two entry points (see README "Quick start"): `make run` and `make test`.
# Each creates .venv with the exact pins of requirements.lock on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/revnet.yaml
FLAX   := $(shell sed -n 's/^flax==//p' requirements.lock)

.PHONY: setup run demo test lint clean

$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	@# flax's own remat tests (tests/test_flax_upstream.py) run against nn.remat and nnx.remat:
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

test: $(STAMP) lint
	$(PY) -m pytest -n 2 -q

clean:
	rm -rf $(VENV) runs .pytest_cache
