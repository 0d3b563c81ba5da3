# `make demo` and `make test` bootstrap .venv on a fresh machine, then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint mutants bench venv clean

venv: $(STAMP)

# torch==2.13.0 is installed first and alone so pip takes the local CPU build, not a multi-GB CUDA one.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,hf,eval]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m fastweights demo --out runs/demo

# the linter first (seconds), then one worker per core (pytest-xdist): the tests run single-threaded, so two cores
# take about half the time; each file's tests stay in one worker, so a module's fixtures (a dry run, the documented
# harness commands) are built once, not once per worker
test: lint
	$(BIN)/python -m pytest -n auto --dist loadfile --timeout=600 --durations=10 tests

lint: $(STAMP)
	$(BIN)/ruff check src benchmarks tools tests

# mutation testing of the lines changed since BASE (default: the last tag, else origin/main's merge base)
mutants: $(STAMP)
	$(BIN)/python tools/mutants.py $(if $(BASE),--base $(BASE))

bench: $(STAMP)
	$(BIN)/python benchmarks/speed/train_throughput.py

clean:
	rm -rf $(VENV) runs
