# Stand-in for the OpenTelemetry collector and Jaeger where Docker Hub is out of reach: rotel (PyPI), an OTLP
# receiver that logs every span it gets, trace and span ids included (`docker compose logs otel-collector`).
ARG BASE_IMAGE=tandem-standin/python:3.11
FROM ${BASE_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/etc/ssl/certs/ca-certificates.crt
COPY certs/ /usr/local/share/ca-certificates/tandem/
# rotel-agent links libpython (it can embed Python processors)
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libpython3.11 \
 && rm -rf /var/lib/apt/lists/*
RUN update-ca-certificates >/dev/null && python3 -m venv /opt/rotel && /opt/rotel/bin/pip install "rotel==0.0.1a15"
ENTRYPOINT ["/opt/rotel/lib/python3.11/site-packages/rotel/rotel-agent", "start", "--exporter", "blackhole", \
            "--debug-log", "traces", "--debug-log-verbosity", "detailed"]
CMD ["--otlp-grpc-endpoint", "0.0.0.0:4317", "--otlp-http-endpoint", "0.0.0.0:4318"]
