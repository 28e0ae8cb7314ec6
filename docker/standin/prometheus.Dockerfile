# Stand-in for prom/prometheus where Docker Hub is out of reach: Debian's prometheus package on the
# debootstrap base (scripts/docker_standins.sh). Same flags as the upstream image.
ARG BASE_IMAGE=tandem-standin/python:3.11
FROM ${BASE_IMAGE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml"]
