#!/usr/bin/env bash
# Builds Horovod 0.28.1 from its PyPI sdist against the TensorFlow installed in the
# virtual environment, and installs it. Gloo always; MPI when an MPI compiler is
# installed (mpicxx) and WITH_MPI is not 0; NCCL (HOROVOD_GPU_OPERATIONS=NCCL) when
# nvcc is installed and the machine has a GPU (or TENSORFLOW_VARIANT=gpu).
#
# The wheel is cached under $HOROVOD_WHEEL_CACHE, keyed by everything that changes
# the binary (Python, TensorFlow, build options, the patch), so a rebuild happens
# only when one of those changes.
#
# Usage: build_horovod.sh VENV_DIR
set -euo pipefail

HOROVOD_VERSION=0.28.1
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:?usage: build_horovod.sh VENV_DIR}"
py="$venv/bin/python"
cache="${HOROVOD_WHEEL_CACHE:-$here/../.cache/horovod}"

export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITH_GLOO=1
if [ "${WITH_MPI:-1}" = 1 ] && command -v mpicxx >/dev/null 2>&1; then
    export HOROVOD_WITH_MPI=1
    unset HOROVOD_WITHOUT_MPI
else
    export HOROVOD_WITHOUT_MPI=1
fi
# NCCL where install.sh installs the CUDA TensorFlow (TENSORFLOW_VARIANT=gpu, or auto
# and nvidia-smi lists a GPU) and nvcc can build it; without nvcc, install.sh refuses
# the result on a GPU machine unless ALLOW_GPU_WITHOUT_NCCL=1. GPU path: not exercised
# on the CPU-only CI.
gpu_wanted() {
    case "${TENSORFLOW_VARIANT:-auto}" in
        gpu) return 0 ;;
        cpu) return 1 ;;
        *) command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 ;;
    esac
}
if [ -z "${HOROVOD_GPU_OPERATIONS:-}" ] && command -v nvcc >/dev/null 2>&1 && gpu_wanted; then
    export HOROVOD_GPU_OPERATIONS=NCCL
fi

# A wheel built beforehand for this Python, TensorFlow and these options
# (packaging/wheelhouse.sh; the image builds of docs/docker.md, which reach no index):
# installed as it is instead of building from source; install.sh checks what it holds.
if [ -n "${HOROVOD_WHEEL:-}" ]; then
    [ -f "$HOROVOD_WHEEL" ] || {
        echo "[install] HOROVOD_WHEEL=$HOROVOD_WHEEL: no such file" >&2; exit 1; }
    echo "[install] installing the prebuilt Horovod wheel $HOROVOD_WHEEL"
    "$py" -m pip install --quiet --no-deps --force-reinstall "$HOROVOD_WHEEL"
    echo "$HOROVOD_WHEEL" > "$venv/horovod-wheel.txt"
    exit 0
fi

tf_version="$("$py" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null)"
key="$( {
    echo "horovod=$HOROVOD_VERSION tf=$tf_version"
    "$py" -c 'import sys; print(sys.version)'
    env | grep '^HOROVOD_' | sort
    # The CUDA toolkit a GPU build compiles with (nothing without nvcc).
    if [ -n "${HOROVOD_GPU_OPERATIONS:-}" ] && command -v nvcc >/dev/null 2>&1; then
        command -v nvcc
        nvcc --version 2>&1 | grep -i release || true
    fi
    cat "$here/patch_horovod.py" "$here/build_horovod.sh"
} | sha256sum | cut -c1-16)"
wheel_dir="$cache/$key"

if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    echo "[install] building Horovod $HOROVOD_VERSION from source (TensorFlow $tf_version," \
         "$(env | grep -E '^HOROVOD_(WITH_MPI|GPU_OPERATIONS)=' | tr '\n' ' ')Gloo); takes 2-4 min"
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    "$py" -m pip download --quiet --no-deps --no-binary :all: -d "$work" \
        "horovod==$HOROVOD_VERSION"
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"
    "$py" "$here/patch_horovod.py" "$src"
    # No build isolation: Horovod compiles against the TensorFlow of this venv.
    ( cd "$src" && PATH="$venv/bin:$PATH" MAKEFLAGS="-j$(nproc)" \
        "$py" -m pip wheel --no-deps --no-build-isolation -w "$work/wheel" . \
        > "$work/build.log" 2>&1 ) || { tail -n 60 "$work/build.log"; \
        echo "[install] Horovod build failed (log above)" >&2; exit 1; }
    mkdir -p "$wheel_dir.tmp"
    cp "$work"/wheel/horovod-*.whl "$wheel_dir.tmp/"
    rm -rf "$wheel_dir"
    mv "$wheel_dir.tmp" "$wheel_dir"
else
    echo "[install] reusing built Horovod wheel $wheel_dir"
fi
"$py" -m pip install --quiet --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
# Where the installed wheel is, for packaging/wheelhouse.sh (images, air-gapped installs).
ls "$wheel_dir"/horovod-*.whl > "$venv/horovod-wheel.txt"
