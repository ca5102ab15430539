# Two entry points on a fresh Debian machine: `make demo` and `make test`.
# Both create .venv, install torch==2.13.0 (the version fedge is tested with; never let
# pip pick torch unpinned) and fedge with all extras. Where the package index serves a
# CUDA build for that version, install its CPU wheel into .venv first: pip keeps it.
# `make test` also installs Mosquitto and the Fashion-MNIST files with apt when they are
# missing and we are root; `python3-venv` likewise when venv is unavailable.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Test processes (pytest-xdist). Two fit a two-core machine: the suite's time goes to waiting on
# brokers and client processes as much as to computing. TEST_WORKERS=0 runs every test in one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS)

.PHONY: demo test test-fast tutorials install system-deps bench clean check-wheels docs

$(BIN)/.fedge-installed: pyproject.toml
	@$(PYTHON) -c "import ensurepip, venv" 2>/dev/null || { [ "$$(id -u)" = 0 ] && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q torch==$(TORCH_VERSION)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[all]'
	touch $@

install: $(BIN)/.fedge-installed

demo: install
	$(BIN)/fedge-coordinator demo

system-deps:
	@missing=""; \
	command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || missing="$$missing mosquitto mosquitto-clients"; \
	[ -d /usr/share/datasets/fashion-mnist ] || missing="$$missing dataset-fashion-mnist"; \
	command -v tc >/dev/null 2>&1 || [ -x /usr/sbin/tc ] || missing="$$missing iproute2"; \
	command -v shellcheck >/dev/null 2>&1 || missing="$$missing shellcheck"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else \
	    echo "missing:$$missing (run as root or: sudo apt-get install$$missing)"; \
	  fi; \
	fi

# `test` builds the docs first: the site is part of what CI checks (a broken link or anchor, a page
# left out of the nav, an API page mkdocstrings cannot render all fail the build), and at a few seconds
# it fails before the suite's minutes rather than after. It is a make prerequisite rather than a test
# because it is a build of an artifact, like install, not a behaviour of fedge; docs/cli.md being
# current is a test (tests/test_cli_reference.py), as docs/settings.md's is.
test: install system-deps docs
	$(PYTEST)

# Everything but the integration tier (tests that start a broker, a process or a federated run;
# tests/conftest.py marks them): about a minute on two cores. Needs neither Mosquitto nor the
# Fashion-MNIST files.
test-fast: install
	$(PYTEST) -m "not integration"

# The tutorials' commands, with the steps they mark long (root, real devices or many minutes), which `make test`
# leaves out: tests/test_tutorials.py runs each page's console blocks and compares what they print.
tutorials: install system-deps
	FEDGE_TUTORIALS=long $(BIN)/python -m pytest -v tests/test_tutorials.py

# The documentation site into site/ (open site/index.html from disk; search needs a server:
# python -m http.server -d site). --strict: every warning, a broken link or anchor included, fails.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: install
	$(BIN)/python bench/fedavg_fashion.py

# Which wheels the package index has for the device side (extras client and infer) on
# 64-bit and 32-bit ARM; needs the network, installs nothing, keeps no wheel.
check-wheels:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) tools/check_wheels.py \
	  --torch-version $(TORCH_VERSION) --json bench/results/arm_wheels.json

clean:
	rm -rf $(VENV) runs .pytest_cache site
