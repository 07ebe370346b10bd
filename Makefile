# Quick start: `make run` (the main job) and `make test` (the suite). Both create .venv first,
# installing the CPU build torch==2.13.0 when no torch is importable (never an unpinned torch).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
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
