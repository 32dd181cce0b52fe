# syntax=docker/dockerfile:1
# vllm-kvtier:<version>: vLLM's OpenAI server image with kvtier's connector
# (kvtier_vllm.connector) added from the wheel that `python -m build --wheel` writes to dist/.
# Build from the repository root:
#   docker build -f deploy/images/vllm-kvtier.Dockerfile -t vllm-kvtier:0.1.0 .
# vLLM 0.32 is the version the connector is checked against end to end; any tag inside the
# `vllm` extra's range in pyproject.toml may be given with --build-arg VLLM_IMAGE=...

ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

FROM ${VLLM_IMAGE}
ARG KVTIER_VERSION=0.1.0
LABEL org.opencontainers.image.title="vllm-kvtier" \
      org.opencontainers.image.version="${KVTIER_VERSION}" \
      org.opencontainers.image.description="vLLM's OpenAI server with kvtier's KV connector" \
      org.opencontainers.image.licenses="Apache-2.0"

COPY dist/kvtier-${KVTIER_VERSION}-py3-none-any.whl /tmp/
# Without the `vllm` extra: the image's vLLM is a CUDA build, and pip resolving that extra could
# replace it (or the torch it was built against) with other builds. The constraint holds vLLM and
# the torch stack at the versions installed, so that pip fails rather than swap them.
# s3 and gcs: the connector reaches only kvtierd, but `kvtier hidden export` run here opens the
# tiers itself, the object store among them.
RUN python3 -m pip list --format=freeze \
        | grep -iE '^(vllm|torch|torchvision|torchaudio|triton|xformers|flashinfer-python)==' \
        > /tmp/keep.txt \
    && python3 -m pip install --no-cache-dir --constraint /tmp/keep.txt \
        "/tmp/kvtier-${KVTIER_VERSION}-py3-none-any.whl[s3,gcs]" \
    && rm /tmp/keep.txt /tmp/kvtier-${KVTIER_VERSION}-py3-none-any.whl \
    && kvtier --version

# deploy/k8s runs vLLM as a user without a passwd entry, whose HOME would be / : the Hugging
# Face and vLLM caches need a writable home, whatever the uid (sticky, like /tmp)
RUN install -d -m 1777 /home/vllm
ENV HOME=/home/vllm

# vLLM's own ENTRYPOINT (`vllm serve`) is kept: deploy/k8s and `docker run` pass the model and
# --kv-transfer-config as vLLM documents
