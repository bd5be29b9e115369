# qserve worker image: serves the model directory mounted at /models/model on port 8000,
# with /health for probes, vLLM's metric names on /metrics, and a SIGTERM drain.
#
#   docker build -t qserve .                                                      # CPU torch
#   docker build -t qserve --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .  # CUDA torch
#   docker run --gpus all -p 8000:8000 -v /srv/qwen2.5-7b-gptq:/models/model:ro qserve \
#       --served-model-name qwen2.5-7b --gpu-memory-utilization 0.9
#
# Arguments after the image name are `qserve serve` flags (docs/worker.md lists them).
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    QSERVE_CACHE_DIR=/cache

# torch first, from the chosen wheel index (CPU or a CUDA build); the rest from PyPI.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/qserve
COPY pyproject.toml README.md ./
COPY qserve ./qserve
COPY quant_kernels ./quant_kernels
COPY loaders ./loaders
# The demo model and the recipes are package data (qserve/recipes/): a regular install carries them.
RUN pip install ".[server,kv-events]"

RUN useradd --create-home --uid 1000 qserve && mkdir -p /cache /models && chown qserve /cache
USER qserve

EXPOSE 8000
# Docker's own probe; Kubernetes uses the probes of docs/worker.md instead. 503 while loading or draining.
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["qserve", "serve", "/models/model", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--shutdown-timeout", "25"]
