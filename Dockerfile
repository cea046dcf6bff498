# syntax=docker/dockerfile:1
#
# The ELMo embedding service: onnxruntime-gpu with CUDA 13 + cuDNN 9 from its pip extras (no CUDA base image,
# no torch), gRPC on 50051, the HTTP/JSON API and web page on 8080, Prometheus metrics on 9090, the shipped default
# model inside.
#
#   docker build -t elmo-service .
#   docker run --gpus all -p 50051:50051 -p 8080:8080 -p 9090:9090 elmo-service    # GPU host (NVIDIA Container Toolkit)
#   docker run -p 50051:50051 -p 8080:8080 -p 9090:9090 elmo-service               # no GPU: CPU, one log line says so
#   docker run --gpus all -p 50051:50051 -p 8080:8080 -p 9090:9090 -v /srv/models/mine:/models/mine:ro elmo-service \
#       --model /models/mine --host 0.0.0.0 --port 50051 --http-port 8080 --metrics-port 9090   # another model
#
# docs/how-to/deploy.md explains the flags, logs, metrics, shutdown, TLS/bearer options and sizing.
# tests/test_dockerfile.py checks this file with Docker's own parser, our rules, and a pip resolution of every
# `pip install` below for this image's Python and platform.

# Pinned by exact version. For a reproducible production build also pin the digest on the build host
# (this repo's machines cannot reach Docker Hub):
#   docker buildx imagetools inspect python:3.11.13-slim-bookworm   ->   FROM python:3.11.13-slim-bookworm@sha256:<digest>
FROM python:3.11.13-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# No LD_LIBRARY_PATH: where a GPU is visible (a /dev/nvidiaN node, i.e. run with --gpus) the runtime loads the
# CUDA/cuDNN wheels' libraries from the venv's site-packages itself (onnxruntime.preload_dlls), as a pip install does.
# Ask the NVIDIA Container Toolkit for the compute libraries (libcuda) when run with --gpus.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# A CJK font (WenQuanYi Micro Hei, ~5 MB), so that a browser run inside the container (a headless screenshot of
# the layer explorer page, say) draws the page's Chinese example sentences instead of empty boxes.
RUN apt-get update \
    && apt-get install -y --no-install-recommends fonts-wqy-microhei \
    && rm -rf /var/lib/apt/lists/*

RUN python -m venv /opt/venv

# The heavy layer first (~1.5 GB of CUDA/cuDNN wheels), so that a code change does not reinstall it.
# The `gpu` extra's requirement, at the `serve` extra's pin (the test checks they agree).
RUN pip install "onnxruntime-gpu[cuda,cudnn]==1.31.1"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY elmo ./elmo
COPY service ./service
COPY export ./export
COPY bench ./bench
# The `serve` and `gpu` extras (torch-free; `gpu` is already satisfied by the layer above); then prove that the
# serving path imports without torch.
RUN pip install ".[serve,gpu]" \
    && python -c "import sys, elmo.service.server; assert 'torch' not in sys.modules, 'torch leaked into the image'"

COPY scripts/healthcheck.py /app/scripts/healthcheck.py
RUN groupadd --system --gid 10001 elmo \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /app --shell /usr/sbin/nologin elmo

# The shipped default model. Another one: mount it (-v DIR:/models/NAME:ro) and pass --model /models/NAME.
# Owned by the service user: COPY keeps the context's file modes, and weights written by training may be 0600.
COPY --chown=10001:10001 models/default /app/models/default

USER 10001:10001

EXPOSE 50051 8080 9090

# grpc.health.v1 reports SERVING only once the model is loaded and has answered a warm-up forward pass.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "/app/scripts/healthcheck.py", "127.0.0.1:50051"]

# Every interface (--host 0.0.0.0): a container's port is reached through its published port, and `elmo serve`'s
# own default, 127.0.0.1, would answer nobody outside it. Set a token for anything beyond a trusted network:
# docker run -e ELMO_AUTH_TOKEN=... (every flag is also an ELMO_<NAME> variable).
# On SIGTERM `elmo serve` turns health NOT_SERVING, refuses new RPCs and gives in-flight ones --drain-timeout-s
# (default 30) before it exits 0. Docker's default stop grace is 10 s: use `docker stop -t 40` (or a shorter
# --drain-timeout-s); in Kubernetes keep terminationGracePeriodSeconds above --drain-timeout-s.
STOPSIGNAL SIGTERM
ENTRYPOINT ["elmo", "serve"]
CMD ["--model", "/app/models/default", "--host", "0.0.0.0", "--port", "50051", "--http-port", "8080", "--metrics-port", "9090"]
