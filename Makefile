# Set-up from nothing on a CPU machine: a virtualenv, the pinned CPU torch first (so nothing can pull a
# CUDA build), then the project. `make test` is the test command; `.ci/run` calls exactly it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: install run test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e ".[test]" "$(TORCH_PIN)"
	touch $@

install: $(VENV)/.installed

# The small GPT on the standard-library corpus, 3D layout (dp2 x tp2 x pp2) on 8 CPU processes.
run: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) recipes/pretrain.py parallel=3d model=small max_steps=200 trainer.val_check_interval=40

# The linter first (ruff, configured in pyproject.toml: line length 120), then the test suite.
test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_strategies.py
	$(PY) benchmarks/bench_pipeline.py
	$(PY) benchmarks/bench_memory.py
	$(PY) benchmarks/bench_activations.py
	$(PY) benchmarks/bench_planner.py
	$(PY) benchmarks/bench_user_checks.py
	$(PY) benchmarks/bench_data.py

clean:
	rm -rf $(VENV) .pytest_cache
