# The two front doors (see README):
#   make serve   serve the shipped default model (creates .venv-serve with the torch-free `serve` extra, plus the
#                `gpu` extra where `nvidia-smi -L` lists a GPU)
#   make test    install everything the tests need into .venv (the README's OpenAI-compatible clients into
#                .venv-clients, Debian's chromium, haproxy, wrk and h2load for the browser, balancer and load
#                generator tests), run them all on one worker per core (what CI runs), then list the 25 slowest
#   make dev     only create .venv (what `make test` installs first): the serving install plus torch, for the
#                training commands (train, adapt, mix train, export, imports) of the README, and the spaCy extra
# and, for the inner loop:
#   make check   ruff (lint and format) and the fast tier, `pytest -m "not slow"` (about 3.5 minutes on 2 cores; .venv
#                only: no .venv-clients, no chromium). tests/conftest.py says which tests are slow and how it was chosen.
PYTHON ?= python3
VENV ?= .venv
SERVE_VENV ?= .venv-serve
CLIENTS_VENV ?= .venv-clients
MODEL ?= models/default
# `make serve` listens on this machine only; HOST=0.0.0.0 opens gRPC, HTTP, the page and /metrics to the network
# (then give a token: ELMO_AUTH_TOKEN=... make serve HOST=0.0.0.0). The container image listens on 0.0.0.0.
HOST ?= 127.0.0.1
PORT ?= 50051
HTTP_PORT ?= 8080
METRICS_PORT ?= 9090

# The tests run on one pytest-xdist worker per core (TEST_WORKERS=0: all in one process), each worker handed whole
# test files in the order tests/conftest.py gives them (slow-tier files first: no worker ends on a long file alone).
TEST_WORKERS ?= $(shell nproc)
PYTEST_WORKERS = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: test check dev serve lint format clean proto browser haproxy generators

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[serve,train,dev,batch,spacy,manylangs-parity,otel]'
	touch $@

# The OpenAI-compatible clients of the README's snippets, in a venv of their own (the `clients` extra): chromadb
# brings the CPU onnxruntime, which must never share a venv with onnxruntime-gpu (tests/test_readme_commands.py).
$(CLIENTS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install -q -e '.[clients]'
	touch $@

# The serving venv in two flavours: `cpu` = the `serve` extra; `gpu` adds the `gpu` extra (CUDA 13 + cuDNN 9 wheels,
# ~1.3 GB). One stamp per flavour, so a host that gains a GPU later gets the extra on its next `make serve`.
SERVE_EXTRAS_cpu := serve
SERVE_EXTRAS_gpu := serve,gpu
$(SERVE_VENV)/.installed-%: pyproject.toml
	$(if $(SERVE_EXTRAS_$*),,$(error SERVE_FLAVOUR must be cpu or gpu, not '$*'))
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install -q -e '.[$(SERVE_EXTRAS_$*)]'
	touch $@

# Debian's packages that tests drive, installed when their command is missing:
# $(call debian_tool,COMMAND,PACKAGE,what for).
define debian_tool
	@command -v $(1) >/dev/null 2>&1 || { \
		echo "installing Debian's $(2) for $(3)"; \
		sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$sudo apt-get update -q >/dev/null && \
		DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q --no-install-recommends $(2) >/dev/null; }
	@command -v $(1) >/dev/null 2>&1 || { echo "$(2) could not be installed"; exit 1; }
endef

# The web page's browser test drives Debian's Chromium (tests/browser.py).
browser:
	$(call debian_tool,chromium,chromium,the browser test (tests/service/test_page.py))

# The balancer test runs deploy/haproxy.cfg in Debian's HAProxy (tests/deploy/test_haproxy.py).
haproxy:
	$(call debian_tool,haproxy,haproxy,the balancer test (tests/deploy/test_haproxy.py))

# The compiled load generators of bench.service.compiled_load, wrk and nghttp2's h2load, run by their test
# (tests/test_bench_generators.py).
generators:
	$(call debian_tool,wrk,wrk,the load generators' test (tests/test_bench_generators.py))
	$(call debian_tool,h2load,nghttp2-client,the load generators' test (tests/test_bench_generators.py))

test: $(VENV)/.installed $(CLIENTS_VENV)/.installed browser haproxy generators
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -q $(PYTEST_WORKERS) --durations=25

dev: $(VENV)/.installed
	@echo "$(VENV) is ready: $(VENV)/bin/elmo --help lists its commands"

check: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -q -m "not slow" $(PYTEST_WORKERS)

# The flavour is decided when `make serve` runs (SERVE_FLAVOUR=cpu|gpu overrides): nvidia-smi ships with the driver.
serve:
	@flavour='$(SERVE_FLAVOUR)'; \
	if [ -z "$$flavour" ]; then \
		if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then flavour=gpu; else flavour=cpu; fi; \
	fi; \
	$(MAKE) --no-print-directory $(SERVE_VENV)/.installed-$$flavour
	$(SERVE_VENV)/bin/elmo serve --model $(MODEL) --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT) --metrics-port $(METRICS_PORT)

# regenerate elmo/v1/*_pb2*.py from proto/ (committed; tests/test_proto.py checks they match)
proto: $(VENV)/.installed
	$(VENV)/bin/python scripts/gen_proto.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# rewrite the tree in the house's format (what `ruff format --check` in `make check` and `make test` asks for)
format: $(VENV)/.installed
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) $(SERVE_VENV) $(CLIENTS_VENV) .pytest_cache
