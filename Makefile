# Two entry points on a fresh Debian machine: `make demo` and `make test`.
# Both create .venv, install torch==2.13.0 (pinned: an unpinned torch pulls a multi-GB
# CUDA build) and fedge with all extras. `make test` also installs Mosquitto and the
# Fashion-MNIST files with apt when they are missing and we are root.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
APT_PACKAGES := mosquitto mosquitto-clients dataset-fashion-mnist

.PHONY: demo test install system-deps bench clean

$(BIN)/.fedge-installed: pyproject.toml
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
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else \
	    echo "missing:$$missing (run as root or: sudo apt-get install$$missing)"; \
	  fi; \
	fi

test: install system-deps
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python bench/fedavg_fashion.py

clean:
	rm -rf $(VENV) runs .pytest_cache
