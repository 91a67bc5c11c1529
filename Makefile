# Set-up from nothing on a CPU machine: a virtualenv, the pinned CPU torch first (so nothing can pull a
# CUDA build), then the project. `make test` is the test command; `.ci/run` calls exactly it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: install test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e ".[test]" "$(TORCH_PIN)"
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_strategies.py

clean:
	rm -rf $(VENV) .pytest_cache
