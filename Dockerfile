# MineDraft serving image: one image for all three services; the Helm chart picks the subcommand
# (`minedraft serve` for a whole pair in one pod, or `minedraft target`, `draft`, `coordinator`) and
# configures it through MINEDRAFT_* environment variables.
#
#   docker build -t minedraft:0.1.0 .
#   docker run --gpus all -v /data/models:/models minedraft:0.1.0 target --model /models/target --port 50052 --device cuda
#
# The PyPI torch wheel for Linux x86_64 is a CUDA build that brings its own CUDA libraries, so a
# plain Python base works on GPU nodes (the NVIDIA container runtime provides the driver).
FROM python:3.11-slim

# TORCH: the torch requirement, installed first in its own (large, rarely changing) layer,
#   e.g. --build-arg TORCH="torch==2.9.1".
# EXTRAS: the package's extras to install ("gpu" adds CuPy, which the nccl channel runs over on GPUs; "" for none).
ARG TORCH="torch>=2.4"
ARG EXTRAS="gpu"

# HF_HUB_OFFLINE: models come from a mounted directory; never reach for a model hub at run time.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1

# tini forwards SIGTERM from Kubernetes to the server, which does not run as PID 1 then.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 minedraft \
    && useradd --create-home --uid 10001 --gid 10001 minedraft

# Versions: TORCH above, the rest from the ranges in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install "${TORCH}"

WORKDIR /tmp/minedraft
COPY . .
# hadolint ignore=DL3013
RUN pip install ".${EXTRAS:+[${EXTRAS}]}" \
    && rm -rf /tmp/minedraft

WORKDIR /home/minedraft
# A UID above the host's users; the Helm chart runs as it (securityContext.runAsUser) with a read-only root.
USER 10001:10001

# Default ports: coordinator (public API), target, draft, Prometheus metrics.
EXPOSE 50051 50052 50053 9090

ENTRYPOINT ["tini", "--", "minedraft"]
CMD ["--help"]
