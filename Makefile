# The two commands of the README: `make demo` and `make test`. Both create/refresh .venv first.
# `make gpu-check` (on a GPU machine): the `gpu` tests and the training benchmarks, see tools/gpu_check.py.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch goes in first and on its own: deepspeed builds against the installed torch, and a
# resolver left alone may pick a multi-GB CUDA build. On a GPU cluster set TORCH_SPEC to the
# CUDA build you want (e.g. TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>").
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test files run on TEST_WORKERS processes (pytest-xdist; a file's tests stay on one worker, so a
# module's fixtures are built once). Many tests run one single-threaded training process and leave a
# core idle; 2 workers use it. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2

.PHONY: demo test gpu-check env mpi clean-env

env: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The optional extra `mpi` (mpi4py, for data_prep.preprocess under mpirun): needs an MPI runtime,
# e.g. Debian's `apt-get install openmpi-bin libopenmpi-dev` (the tests install both themselves).
mpi: $(STAMP)
	@command -v mpirun >/dev/null || { echo "no mpirun: install an MPI runtime first, e.g. apt-get install openmpi-bin libopenmpi-dev" >&2; exit 1; }
	$(PY) -m pip install --quiet -e '.[mpi]'

# DEMO_INPUT="a.txt b.jsonl" and VOCAB=path/to/vocab.txt are optional.
demo: $(STAMP)
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(PY) -m megatron_pmlm.demo \
		$(if $(DEMO_INPUT),--input $(DEMO_INPUT)) $(if $(VOCAB),--vocab-file $(VOCAB)) $(DEMO_ARGS)

test: $(STAMP)
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) tests

# GPU_CHECK_ARGS="--skip-tests" etc. are optional ("--cpu-dry-run": the tooling at the tiny preset on a
# CPU); results go to outputs/gpu-check/<time>/ (printed).
gpu-check: $(STAMP)
	$(PY) tools/gpu_check.py $(GPU_CHECK_ARGS)

clean-env:
	rm -rf $(VENV)
