# Quick start: `make run` (the main job) and `make test` (the suite). Both create .venv first,
# installing torch==2.13.0 when no torch is importable: pinned to a version with a CPU wheel,
# because an unpinned torch would pull GBs of CUDA packages onto a machine without a GPU. The venv sees no
# system site-packages: what the project needs is in pyproject.toml, and other packages' pytest
# plugins (and their warnings) stay out of the test run. pip keeps no cache (--no-cache-dir): on a
# small disk the cached copies of the wheels would take as much room again as the venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-cache-dir torch==2.13.0
	$(PY) -m pip install -q --no-cache-dir -e ".[dev]"
	touch $@

install: $(STAMP)

run: install
	$(PY) experiments/train.py

demo: install
	$(PY) -m sparseflash.demo

test: install
	$(PY) -m pytest -n 2 -q

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
