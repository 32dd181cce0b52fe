# syntax=docker/dockerfile:1
# kvtier:<version>: kvtierd and the kvtier CLI, installed from the wheel that
# `python -m build --wheel` writes to dist/. Build from the repository root:
#   docker build -f deploy/images/kvtier.Dockerfile -t kvtier:0.1.0 .
# deploy/k8s runs it as uid:gid 10001:10001 with a read-only root filesystem; every directory
# kvtierd writes is a volume there, and is created here, owned by that user, for `docker run`.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS install
ARG KVTIER_VERSION=0.1.0
COPY dist/kvtier-${KVTIER_VERSION}-py3-none-any.whl /tmp/
# a virtualenv, so that the final stage copies one directory and no pip cache or wheel;
# s3 and gcs: the object-store overlays need their clients
RUN python -m venv /opt/kvtier \
    && /opt/kvtier/bin/pip install --no-cache-dir \
        "/tmp/kvtier-${KVTIER_VERSION}-py3-none-any.whl[s3,gcs]"

FROM ${PYTHON_IMAGE}
ARG KVTIER_VERSION=0.1.0
LABEL org.opencontainers.image.title="kvtier" \
      org.opencontainers.image.version="${KVTIER_VERSION}" \
      org.opencontainers.image.description="kvtierd, the tiered KV-cache daemon for vLLM, and its CLI" \
      org.opencontainers.image.licenses="Apache-2.0"

# the ids deploy/k8s runs kvtierd with (runAsUser, runAsGroup, fsGroup, server.group):
# files kvtierd creates in host directories carry them
RUN groupadd --gid 10001 kvtier \
    && useradd --uid 10001 --gid 10001 --home-dir /var/lib/kvtier \
        --no-create-home --shell /usr/sbin/nologin kvtier \
    && install -d -o 10001 -g 10001 -m 0750 /run/kvtier /kvtier/shm \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/kvtier /etc/kvtier/admin

COPY --from=install /opt/kvtier /opt/kvtier
# the configuration `docker run` starts with; deploy/k8s mounts its ConfigMap over this file
COPY deploy/images/kvtier.yaml /etc/kvtier/kvtier.yaml

# XDG_STATE_HOME: where kvtier's default paths lie, as in deploy/k8s; bytecode is compiled at
# install, and the root filesystem is read-only in deploy/k8s
ENV PATH=/opt/kvtier/bin:$PATH \
    XDG_STATE_HOME=/var/lib/kvtier \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

USER 10001:10001
# Prometheus /metrics and /healthz; the admin API listens on the container's loopback only
EXPOSE 7462

# Docker only (kubelet ignores HEALTHCHECK): /healthz on the metrics port, as the manifests'
# probes ask it, with no admin token; python's urllib, as -slim images have no curl
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request as r; r.urlopen('http://127.0.0.1:7462/healthz', timeout=5)"]

# SIGTERM drains the arena to lmdb (server.drain_timeout_s, 60 s): `docker stop -t 90`
ENTRYPOINT ["kvtier"]
CMD ["serve", "--config", "/etc/kvtier/kvtier.yaml"]
