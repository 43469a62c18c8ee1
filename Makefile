# The two commands a new user needs: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is pinned to the CPU build that lies on this machine's disk; the package itself asks
# only for a range, so GPU clusters keep their own build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/failbench run examples/quickstart.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy failbench_ray architectures mechanisms injector api bench

test: $(STAMP) lint
	$(BIN)/pytest -q --durations=20

bench: $(STAMP)
	$(BIN)/python -m bench.run --out bench/results.json

clean:
	rm -rf $(VENV) build *.egg-info failbench.db runs
