# stk: make install | demo | test | lint | bench
#
# MPI=pip  (default) installs MPICH from PyPI next to mpi4py: works on any machine.
# MPI=site builds mpi4py against the site's MPI (the mpicc on PATH, or MPICC=/path/mpicc),
#          which is what a cluster wants for its interconnect.

PYTHON ?= python3
VENV ?= .venv
MPI ?= pip
MPICC ?= mpicc
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(MPI)
export DS_BUILD_OPS := 0

.PHONY: install demo test test-deps test-unit test-integration lint bench clean

install: $(STAMP)

$(STAMP): setup.cfg constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -c constraints.txt torch==2.13.0
ifeq ($(MPI),site)
	MPICC=$(MPICC) $(PIP) install -q --no-binary=mpi4py --no-cache-dir -c constraints.txt mpi4py
	$(PIP) install -q -c constraints.txt -e '.[dev]'
else
	$(PIP) install -q -c constraints.txt -e '.[dev,mpich]'
endif
	touch $@

demo: install
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m stk.demo

test: install test-deps
	$(PY) -m pytest -q -ra --durations=25 tests

# Debian packages the integration tests drive (a real one-node Slurm), installed only when missing.
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || ! command -v sudo >/dev/null || echo sudo)
test-deps:
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	  ($(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y --no-install-recommends slurm-wlm munge)

test-unit: install
	$(PY) -m pytest -q -m "not integration" tests

test-integration: install test-deps
	$(PY) -m pytest -q -m integration tests

lint: install
	$(VENV)/bin/ruff check stk tests bench
	$(VENV)/bin/ruff format --check stk tests bench
	$(VENV)/bin/mypy stk

bench: install
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/scan.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/cache.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/train.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/memory.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
