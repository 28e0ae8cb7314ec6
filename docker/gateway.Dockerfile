# The Shepherd Model Gateway (smg) from PyPI, for compose's `gateway` profile: the OpenAI chat/completions,
# Responses and Anthropic Messages APIs over HTTP in front of the frontend, which it reaches over vLLM's gRPC
# worker protocol (docs/gateway.md). A wheel with smg's Rust binary inside; no Tandem code in this image.
#
#   docker build -f docker/gateway.Dockerfile -t tandem-gateway .
#
# Build arguments as in docker/frontend.Dockerfile: BASE_IMAGE, PIP_INDEX_URL / PIP_EXTRA_INDEX_URL /
# PIP_TRUSTED_HOST, and CA certificates of a TLS-intercepting proxy in docker/certs/*.crt.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/etc/ssl/certs/ca-certificates.crt
COPY docker/certs/ /usr/local/share/ca-certificates/tandem/
# the version tests/gateway runs against (pyproject.toml's test extra pins the same)
RUN update-ca-certificates >/dev/null && python3 -m venv /opt/smg && /opt/smg/bin/pip install smg==1.13.0

FROM ${BASE_IMAGE}
ENV PATH=/opt/smg/bin:$PATH PYTHONUNBUFFERED=1
COPY --from=build /opt/smg /opt/smg
RUN useradd --system --create-home --uid 10001 smg
USER smg
WORKDIR /home/smg

# the HTTP API and smg's Prometheus /metrics
EXPOSE 30000 29000
HEALTHCHECK --interval=5s --timeout=4s --start-period=30s --retries=5 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=3)"]
ENTRYPOINT ["smg", "launch"]
CMD ["--host", "0.0.0.0", "--port", "30000", "--prometheus-host", "0.0.0.0", "--prometheus-port", "29000", \
     "--worker-urls", "grpc://frontend:50051"]
