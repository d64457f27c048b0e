# stk: make install | demo | test | docs | lint | bench | lock | test-latest | gpu-wheels, then gpu-check on a GPU machine
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

.PHONY: install lock demo test test-latest test-deps test-unit test-integration docs lint bench gpu-wheels gpu-check clean

install: $(STAMP)

# constraints.txt is the lock: every distribution an install takes, pinned (`make lock` writes it from setup.cfg).
# PINS is how an install honours it; `make test-latest` empties it to try the newest releases.
PINS ?= -c constraints.txt

$(STAMP): setup.cfg constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(PINS) --upgrade pip setuptools wheel
	$(PIP) install -q $(PINS) torch==2.13.0
ifeq ($(MPI),site)
	MPICC=$(MPICC) $(PIP) install -q --no-binary=mpi4py --no-cache-dir $(PINS) mpi4py
	$(PIP) install -q $(PINS) -e '.[dev]'
else
	$(PIP) install -q $(PINS) -e '.[dev,mpich]'
endif
	$(if $(shell command -v nvidia-smi),,DS_ACCELERATOR=cpu) $(PY) -m stk.train.deepspeed.opbuilds
	touch $@

# The lock for every platform and Python stk supports (markers where versions differ), with the install tools.
lock: install
	printf 'pip\nsetuptools\nwheel\n' | $(VENV)/bin/uv pip compile setup.cfg - --extra dev --extra mpich --universal \
	  --python-version 3.10 --annotation-style line --custom-compile-command 'make lock' -o constraints.txt

# The suite against the newest release of everything (torch stays pinned by setup.cfg), in a venv of its own,
# so that a release that breaks stk is seen before the lock moves to it.
LATEST_VENV := .venv-latest
test-latest:
	rm -rf $(LATEST_VENV)
	$(MAKE) test VENV=$(LATEST_VENV) PINS=

demo: install
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m stk.demo

# STK_PYTHON: the checkout's bin/ scripts (stk-launch, the sbatch templates) run the python under test too
TEST_ENV = STK_PYTHON=$(abspath $(PY))

test: install test-deps docs
	$(TEST_ENV) $(PY) -m pytest -q -ra --durations=25 tests

# Debian packages the integration tests drive (a real one-node Slurm), installed only when missing.
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || ! command -v sudo >/dev/null || echo sudo)
test-deps:
	@command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v ip >/dev/null || \
	  ($(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y --no-install-recommends slurm-wlm munge iproute2)

# The documentation site (mkdocs.yml, docs/): --strict fails on a broken link or a page missing from it. The
# option tables and the family pages are generated from stk's code, so the build imports this checkout's stk.
DOCS_DIR ?= site
docs: install
	PYTHONPATH=$(CURDIR) NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q -d $(DOCS_DIR)

test-unit: install
	$(TEST_ENV) $(PY) -m pytest -q -m "not integration" tests

test-integration: install test-deps
	$(TEST_ENV) $(PY) -m pytest -q -m integration tests

lint: install
	$(VENV)/bin/ruff check stk tests bench docs/hooks
	$(VENV)/bin/ruff format --check stk tests bench docs/hooks
	$(VENV)/bin/mypy stk

bench: install
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/scan.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/cache.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/train.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/memory.py

# The GPU proof kit (bench/gpu.py; docs/development/gpu-kit.md). A lent GPU machine has a python3
# with torch, transformers, peft, h5py, pyarrow and nvidia-ml-py, reaches no registry, and gets only the working
# tree: `make gpu-wheels` here puts the rest of stk's dependencies (this venv's versions) into .whl/ for it to
# carry; `make gpu-check` there installs them beside its torch and runs every part (GPU_CHECK_ARGS: --only PART).
GPU_WHEELS := diffusers zstandard boto3 botocore s3transfer jmespath apprise requests-oauthlib oauthlib \
	pillow-heif pillow-jxl-plugin lion-pytorch hjson pydantic pydantic-core annotated-types typing-inspection \
	importlib-metadata torchao
GPU_BUILT := deepspeed python-hostlist  # sources only on PyPI: built into pure-Python wheels here
GPU_PLATFORMS := $(foreach n,2_28 2_27 2_17 2014,--platform manylinux$(if $(filter 2014,$(n)),2014,_$(n))_x86_64)
GPU_SITE ?= /tmp/stk-site

gpu-wheels: install
	rm -rf .whl && mkdir .whl
	$(PY) -c 'import sys, importlib.metadata as m; print("\n".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' \
	  $(GPU_WHEELS) > .whl/binary.txt
	$(PY) -c 'import sys, importlib.metadata as m; print("\n".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' \
	  $(GPU_BUILT) > .whl/built.txt
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $(GPU_PLATFORMS) \
	  -d .whl -r .whl/binary.txt
	$(PIP) wheel -q --no-deps -w .whl -r .whl/built.txt
	rm .whl/*.txt
	du -sh .whl

gpu-check:
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl
	PYTHONPATH=$(GPU_SITE):$(CURDIR) PYTHONUNBUFFERED=1 python3 bench/gpu.py --record $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(LATEST_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .whl site
