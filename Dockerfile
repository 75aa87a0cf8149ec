# syntax=docker/dockerfile:1
#
# rose-worker image.
#   CPU (default):  docker build -t rose-worker .
#   CUDA:           docker build -t rose-worker:cuda \
#                     --build-arg BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime .
#                   (any image with Python >= 3.11 and a CUDA build of torch; its torch is kept as is, so pick
#                   the tag of the torch pinned below)
#                   or keep the slim base and take torch's CUDA wheels:
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Configuration is by ROSE_* environment variables (see `rose-worker --help` and docs/deploy.md).

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Where torch comes from when the base image has none (CPU wheels by default).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The same torch as the README's install line (tests/test_deploy.py checks they agree).
ARG TORCH_SPEC=torch==2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    ROSE_REDIS_URL=redis://redis:6379/0 \
    ROSE_QUEUES=rose \
    ROSE_MODEL=tiny-llama \
    ROSE_DEVICE=auto \
    ROSE_METRICS_PORT=9400

RUN python -c "import torch" 2>/dev/null \
    || pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

WORKDIR /opt/rose
COPY pyproject.toml README.md ./
COPY rose ./rose
RUN pip install ".[engine]" && rm -rf build

# Unprivileged runtime user; models are mounted read-only at /models.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin rose && mkdir -p /models
USER rose
WORKDIR /home/rose

EXPOSE 9400
# rose-worker drains on SIGTERM (up to ROSE_DRAIN_TIMEOUT s); give it longer than that to stop.
STOPSIGNAL SIGTERM
ENTRYPOINT ["rose-worker"]
CMD []
