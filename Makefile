# The two front doors (see README):
#   make serve   serve the shipped default model (creates .venv-serve with the torch-free `serve` extra)
#   make test    install everything the tests need into .venv and run them
PYTHON ?= python3
VENV ?= .venv
SERVE_VENV ?= .venv-serve
MODEL ?= models/default
PORT ?= 50051
METRICS_PORT ?= 9090

.PHONY: test serve lint clean proto

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[serve,train,dev,batch]'
	touch $@

$(SERVE_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install -q -e '.[serve]'
	touch $@

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q

serve: $(SERVE_VENV)/.installed
	$(SERVE_VENV)/bin/elmo serve --model $(MODEL) --port $(PORT) --metrics-port $(METRICS_PORT)

# regenerate elmo/v1/*_pb2*.py from proto/ (committed; tests/test_proto.py checks they match)
proto: $(VENV)/.installed
	$(VENV)/bin/python scripts/gen_proto.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(SERVE_VENV) .pytest_cache
