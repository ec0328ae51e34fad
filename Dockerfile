# syntax=docker/dockerfile:1
# Training image: TensorFlow 2.21 + Horovod 0.28.1 + the project, installed by the
# same script as `make install` (packaging/install.sh), so the tested path and the
# image path are one. Two variants of one recipe (docs/docker.md):
#   docker build -t dlrm-hybrid:gpu .                             # CUDA 12, Horovod NCCL + MPI + Gloo
#   docker build --build-arg VARIANT=cpu -t dlrm-hybrid:cpu .     # CPU, Horovod MPI + Gloo
#   docker run --rm dlrm-hybrid:cpu python -m pytest tests/unit
# The Spark preprocessing image is docker/spark.Dockerfile.

# gpu or cpu: picks the base stage below.
ARG VARIANT=gpu
# TensorFlow 2.21's CUDA wheels need CUDA 12 (>= 12.5) and cuDNN 9 (>= 9.3), and bring
# both as pip packages (tensorflow[and-cuda]); the base image supplies what Horovod's
# NCCL build needs: nvcc, the CUDA headers and NCCL (linked statically). Ubuntu 22.04
# is the newest Ubuntu whose archive has Python 3.11, which our pins require.
ARG CUDA_IMAGE=nvidia/cuda:12.5.1-devel-ubuntu22.04
# Debian bookworm with Python 3.11.7: the platform CI runs install.sh on.
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS base-cpu
ENV PYTHON=python3 TENSORFLOW_VARIANT=cpu

FROM ${CUDA_IMAGE} AS base-gpu
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3.11 python3.11-dev python3.11-venv \
    && rm -rf /var/lib/apt/lists/*
# Compute capabilities of Horovod's CUDA kernels: Volta to Hopper, plus PTX of the last
# one for newer GPUs (fewer means a faster build).
ARG HOROVOD_BUILD_CUDA_CC_LIST=70,75,80,86,89,90
# No GPU is visible at build time, so install.sh cannot detect one: TENSORFLOW_VARIANT
# selects tensorflow[and-cuda], and build_horovod.sh passes HOROVOD_GPU_OPERATIONS on
# to Horovod's build (NCCL ops; NCCL and the CUDA runtime are linked statically).
ENV PYTHON=python3.11 TENSORFLOW_VARIANT=gpu HOROVOD_GPU_OPERATIONS=NCCL \
    HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST}

# base-cpu or base-gpu: a stage above, not an image, so it has no tag to pin.
# hadolint ignore=DL3006
FROM base-${VARIANT}
# WITH_DEV=0 leaves out the test and lint tools; WITH_MPI=0 builds Horovod with Gloo only.
ARG WITH_DEV=1
ARG WITH_MPI=1
ENV WITH_DEV=${WITH_DEV} WITH_MPI=${WITH_MPI} TF_CPP_MIN_LOG_LEVEL=2
WORKDIR /opt/dlrm

# Only what install.sh reads, so that editing the code does not redo the install.
COPY requirements.txt requirements-dev.txt constraints.txt ./
COPY packaging/ packaging/
# install.sh apt-installs the compilers, headers, OpenMPI and Java it needs (as root),
# creates .venv and builds Horovod. The cache mounts keep pip downloads and the built
# Horovod wheel between builds without putting them in the image.
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=cache,target=/opt/dlrm/.cache \
    bash packaging/install.sh \
    && rm -rf /var/lib/apt/lists/*

COPY . .
# The project's CPU kernels (dlrm/kernels), compiled against the image's TensorFlow.
RUN .venv/bin/python -m dlrm.kernels
# The code and .venv stay root-owned (read-only to the user); /data and /runs are
# the mount points for datasets and outputs. A numeric UID, so that hosts and
# Kubernetes' runAsNonRoot can resolve it.
RUN useradd --uid 1000 --user-group --create-home --shell /bin/bash dlrm \
    && install -d -o dlrm -g dlrm /data /runs
USER 1000:1000
ENV PATH=/opt/dlrm/.venv/bin:$PATH
CMD ["python", "main.py", "--help"]
