# Training image: TensorFlow 2.21 + Horovod 0.28.1 + the project, installed by the
# same script as `make install` (packaging/install.sh), so the tested path and the
# image path are one. Two variants of one recipe (docs/docker.md):
#   docker build -t dlrm-hybrid:gpu .                             # CUDA 12, Horovod NCCL + MPI + Gloo
#   docker build --build-arg VARIANT=cpu -t dlrm-hybrid:cpu .     # CPU, Horovod MPI + Gloo
#   docker run --rm dlrm-hybrid:cpu dlrm-train --help
# Without a package index (an air-gapped cluster, CI): fill docker/wheelhouse/ with
# packaging/wheelhouse.sh first, and the build installs from it alone. With podman, add
# --format docker (the OCI format drops SHELL).
# The Spark preprocessing image is docker/spark.Dockerfile.

# gpu or cpu: picks the base stage below.
ARG VARIANT=gpu
# TensorFlow 2.21's CUDA wheels need CUDA 12 (>= 12.5) and cuDNN 9 (>= 9.3), and bring
# both as pip packages (tensorflow[and-cuda]); the base image supplies what Horovod's
# NCCL build needs: nvcc, the CUDA headers and NCCL (linked statically). Ubuntu 22.04
# is the newest Ubuntu whose archive has Python 3.11, which our pins require.
ARG CUDA_IMAGE=nvidia/cuda:12.5.1-devel-ubuntu22.04
# Debian bookworm, whose python3 is the 3.11 our pins require, and the platform CI
# runs install.sh on. Named in full so that podman finds a base imported without a
# registry (docs/docker.md) under the same name that docker pulls.
ARG DEBIAN_IMAGE=docker.io/library/debian:bookworm-slim

FROM ${DEBIAN_IMAGE} AS base-cpu
# Python with venv, its headers for building Horovod from source (no wheelhouse), and
# nss_wrapper for docker/entrypoint.sh.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev libnss-wrapper \
    && apt-get clean && rm -rf /var/lib/apt/lists/*
ENV PYTHON=python3 TENSORFLOW_VARIANT=cpu

FROM ${CUDA_IMAGE} AS base-gpu
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3.11 python3.11-dev python3.11-venv libnss-wrapper \
    && apt-get clean && rm -rf /var/lib/apt/lists/*
# Compute capabilities of Horovod's CUDA kernels: Volta to Hopper, plus PTX of the last
# one for newer GPUs (fewer means a faster build).
ARG HOROVOD_BUILD_CUDA_CC_LIST=70,75,80,86,89,90
# No GPU is visible at build time, so install.sh cannot detect one: TENSORFLOW_VARIANT
# selects tensorflow[and-cuda], and build_horovod.sh passes HOROVOD_GPU_OPERATIONS on
# to Horovod's build (NCCL ops; NCCL and the CUDA runtime are linked statically).
ENV PYTHON=python3.11 TENSORFLOW_VARIANT=gpu HOROVOD_GPU_OPERATIONS=NCCL \
    HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST}

# The checkout less docker/wheelhouse/, for the final stage's copy: the wheels are
# mounted where they are used and would otherwise stay in a layer of the image (they
# are as large as what they install). The context's .dockerignore applies as usual.
# base-cpu or base-gpu: a stage above, not an image, so it has no tag to pin.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS checkout
COPY . /checkout
RUN rm -rf /checkout/docker/wheelhouse

# hadolint ignore=DL3006
FROM base-${VARIANT}
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
# WITH_DEV=0 leaves out the test and lint tools; WITH_MPI=0 builds Horovod with Gloo only.
ARG WITH_DEV=1
ARG WITH_MPI=1
ENV WITH_DEV=${WITH_DEV} WITH_MPI=${WITH_MPI} TF_CPP_MIN_LOG_LEVEL=2
WORKDIR /opt/dlrm

# Only what install.sh reads, so that editing the code does not redo the install.
COPY requirements.txt requirements-dev.txt requirements-plot.txt constraints.txt pyproject.toml ./
COPY packaging/ packaging/
# install.sh apt-installs the compilers, headers, OpenMPI and Java it needs (as root),
# creates .venv and installs the pinned packages and Horovod. docker/wheelhouse/ is
# mounted, not copied: when it holds wheels (packaging/wheelhouse.sh), pip takes every
# package from it and no index, and Horovod's wheel there is installed instead of
# built; when it holds none, pip uses the index and Horovod is built from its sdist.
# The cache mounts keep pip downloads and the built Horovod wheel between builds
# without putting them in the image; apt's downloaded packages are removed.
RUN --mount=type=bind,source=docker/wheelhouse,target=/wheelhouse \
    --mount=type=cache,target=/root/.cache/pip \
    --mount=type=cache,target=/opt/dlrm/.cache \
    if [ -n "$(find /wheelhouse -maxdepth 1 -name '*.whl' -print -quit)" ]; then \
        export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse; \
        HOROVOD_WHEEL="$(find /wheelhouse -maxdepth 1 -name 'horovod-*.whl' -print -quit)"; \
        [ -z "$HOROVOD_WHEEL" ] || export HOROVOD_WHEEL; \
    fi; \
    bash packaging/install.sh \
    && apt-get clean && rm -rf /var/lib/apt/lists/*

COPY --from=checkout /checkout/ ./
# install.sh again, now with the code: the rest is up to date, so it only installs the
# project (editable, from /opt/dlrm: dlrm-train, dlrm-preprocess, ... on PATH) and
# builds its CPU kernels against the image's TensorFlow. The same wheelhouse settings,
# should it find anything to install. The last command fails the build when the
# kernels did not compile (install.sh only warns).
RUN --mount=type=bind,source=docker/wheelhouse,target=/wheelhouse \
    if [ -n "$(find /wheelhouse -maxdepth 1 -name '*.whl' -print -quit)" ]; then \
        export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse; \
        HOROVOD_WHEEL="$(find /wheelhouse -maxdepth 1 -name 'horovod-*.whl' -print -quit)"; \
        [ -z "$HOROVOD_WHEEL" ] || export HOROVOD_WHEEL; \
    fi; \
    bash packaging/install.sh \
    && .venv/bin/python -m dlrm.kernels --if_missing
# The code and .venv stay root-owned (read-only to the user); /data and /runs are
# the mount points for datasets and outputs. A numeric UID, so that hosts and
# Kubernetes' runAsNonRoot can resolve it.
RUN useradd --uid 1000 --user-group --create-home --shell /bin/bash dlrm \
    && install -d -o dlrm -g dlrm /data /runs
# Lets `--user` name any uid, such as the host user's (docker/entrypoint.sh). Run by sh,
# so that it does not depend on the file mode the checkout gave it.
COPY docker/entrypoint.sh /usr/local/bin/dlrm-entrypoint
USER 1000:1000
ENV PATH=/opt/dlrm/.venv/bin:$PATH
ENTRYPOINT ["/bin/sh", "/usr/local/bin/dlrm-entrypoint"]
CMD ["dlrm-train", "--help"]
