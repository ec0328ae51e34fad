#!/usr/bin/env bash
# Installs everything the project needs, on a fresh Debian/Ubuntu machine or in the
# Docker image: system packages, the virtual environment with pinned Python
# packages, Horovod built from source with TensorFlow + Gloo (+ MPI, NCCL when
# present), and the project itself as an editable install (its commands, such as
# dlrm-train, on the venv's PATH; the code stays this checkout). Idempotent: when
# nothing it depends on changed since the last successful run, it only checks and
# returns (a stamp file in the venv).
#
# Environment: VENV (default .venv), PYTHON (default python3), WITH_DEV=0 to skip
# test/lint tools, HOROVOD_WHEEL_CACHE (default .cache/horovod), HOROVOD_WHEEL (a
# prebuilt Horovod wheel to install instead of building one, as image builds without
# a package index do), TENSORFLOW_VARIANT (auto: the CUDA build when nvidia-smi sees
# a GPU, else the CPU build; cpu; gpu), WITH_MPI=0 to leave out OpenMPI (Horovod is
# then built with Gloo only), ALLOW_GPU_WITHOUT_NCCL=1 to accept, with a warning, a
# GPU machine whose Horovod has no NCCL (require_gpu_nccl). pip's own PIP_NO_INDEX /
# PIP_FIND_LINKS point it at a wheelhouse (packaging/wheelhouse.sh).
#
# Usage: install.sh            install, or check and return when up to date
#        install.sh --check    only check the installed venv: Horovod's build (NCCL on
#                              a GPU machine); changes nothing
# Sourced (tests), it defines its functions and runs nothing.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"
python="${PYTHON:-python3}"
with_dev="${WITH_DEV:-1}"
stamp="$venv/.install-stamp"

log() { echo "[install] $*"; }

gpu_present() {
    case "${TENSORFLOW_VARIANT:-auto}" in
        gpu) return 0 ;;
        cpu) return 1 ;;
        auto) command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 ;;
        *) echo "[install] TENSORFLOW_VARIANT: expected auto, cpu or gpu, got" \
                "'$TENSORFLOW_VARIANT'" >&2; exit 2 ;;
    esac
}

requirements=("$root/requirements.txt")
[ "$with_dev" = 1 ] && requirements+=("$root/requirements-dev.txt")
# Everything the installed result depends on; MPI's presence changes the Horovod build.
# Of packaging/'s Python only the Horovod patch: the demo scripts change no install.
fingerprint() {
    {
        cat "${requirements[@]}" "$root/requirements-plot.txt" "$root/constraints.txt" \
            "$root"/packaging/*.sh \
            "$root/packaging/patch_horovod.py" "$root/pyproject.toml"
        "$python" --version 2>&1
        gpu_present && echo gpu
        echo "with_mpi=${WITH_MPI:-1} horovod_wheel=${HOROVOD_WHEEL:-}"
        echo "allow_gpu_without_nccl=${ALLOW_GPU_WITHOUT_NCCL:-0}"
        command -v mpicxx || true
        # The CUDA toolkit decides whether Horovod gets NCCL (build_horovod.sh): one
        # installed or upgraded after the last run must rebuild it.
        cuda_toolkit
    } | sha256sum | cut -c1-16
}

# nvcc's path and release line ("Cuda compilation tools, release 12.5, V12.5.82"), or
# nothing without one.
cuda_toolkit() {
    command -v nvcc || return 0
    nvcc --version 2>&1 | grep -i 'release' || true
}

# Sets $build_info to Horovod's build report, in `horovodrun --check-build`'s "[X] name"
# form; false when Horovod does not load. One process asks the loaded library
# (TensorFlow: its ops load at all): --check-build starts a process per item, each
# importing TensorFlow, 20-35 s on 2 cores against about 5.
horovod_build_info() {
    build_info="$(TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c '
import horovod.tensorflow as h
for name, built in [("TensorFlow", True), ("Gloo", h.gloo_built()), ("MPI", h.mpi_built()),
                    ("NCCL", h.nccl_built())]:
    print("[X]" if built else "[ ]", name)' 2>/dev/null)"
}

# True when $build_info lists TensorFlow and Gloo (and MPI, NCCL where asked for).
check_horovod() {
    horovod_build_info || return 1
    grep -q '\[X\] TensorFlow' <<<"$build_info" && grep -q '\[X\] Gloo' <<<"$build_info" \
        || return 1
    # With an MPI compiler present the build must include MPI (a Gloo-only wheel from
    # before OpenMPI was installed is rebuilt).
    [ "${WITH_MPI:-1}" != 1 ] || ! command -v mpicxx >/dev/null 2>&1 \
        || grep -q '\[X\] MPI' <<<"$build_info" || return 1
    # A GPU build must hold NCCL: a CPU wheel (a prebuilt HOROVOD_WHEEL from a CPU
    # machine, say) is refused there.
    [ "${HOROVOD_GPU_OPERATIONS:-}" != NCCL ] || grep -q '\[X\] NCCL' <<<"$build_info"
}

# Quick re-check for the up-to-date path: Horovod's TensorFlow ops load, with Gloo
# (and $build_info is set, for require_gpu_nccl).
horovod_loads() {
    horovod_build_info && grep -q '\[X\] Gloo' <<<"$build_info"
}

# Where Horovod's build would find NCCL's header (its FindNCCL.cmake: HOROVOD_NCCL_INCLUDE,
# HOROVOD_NCCL_HOME, the CUDA toolkit, the system's include directories); a hint for
# the message below, not a check: CMake searches further.
nccl_header() {
    local dir nvcc_path
    nvcc_path="$(command -v nvcc 2>/dev/null || true)"
    for dir in "${HOROVOD_NCCL_INCLUDE:-}" "${HOROVOD_NCCL_HOME:+$HOROVOD_NCCL_HOME/include}" \
            "${nvcc_path:+$(dirname "$nvcc_path")/../include}" /usr/local/cuda/include \
            /usr/include /usr/local/include; do
        if [ -n "$dir" ] && [ -f "$dir/nccl.h" ]; then
            echo "$dir/nccl.h"
            return 0
        fi
    done
    return 1
}

# GPUs, and a Horovod without NCCL: what is missing and how to fix it, on stderr,
# after the first words ($1); $2: "is built" (installed) or "would be built".
explain_gpu_without_nccl() {
    local gpus nvcc_path header
    gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    nvcc_path="$(command -v nvcc 2>/dev/null || true)"
    {
        echo "[install] $1 GPUs are present (nvidia-smi -L: ${gpus:-0} GPU(s);" \
             "TENSORFLOW_VARIANT=${TENSORFLOW_VARIANT:-auto}), but"
        echo "  Horovod ${2:-is built} without NCCL: every collective (the embeddings'" \
             "alltoall, the"
        echo "  gradients' allreduce) would go through Gloo and host memory."
        if [ -n "${HOROVOD_WHEEL:-}" ]; then
            echo "  - HOROVOD_WHEEL=$HOROVOD_WHEEL: a prebuilt wheel without NCCL (built on" \
                 "a machine without CUDA?)"
        fi
        if [ -z "$nvcc_path" ]; then
            echo "  - nvcc (the CUDA toolkit): not on PATH; build_horovod.sh enables NCCL" \
                 "only with it"
        else
            echo "  - nvcc: $nvcc_path ($(nvcc --version 2>&1 | grep -i release || true))"
        fi
        if header="$(nccl_header)"; then
            echo "  - NCCL headers: $header"
        else
            echo "  - NCCL headers (nccl.h): not found in HOROVOD_NCCL_INCLUDE," \
                 "HOROVOD_NCCL_HOME/include, the CUDA toolkit's include/ or /usr/include"
        fi
        echo "  Fix: install the CUDA 12 toolkit and NCCL's development files (NVIDIA's CUDA"
        echo "  repository: apt-get install cuda-toolkit-12-5 libnccl-dev), put nvcc on PATH"
        echo "  (export PATH=/usr/local/cuda/bin:\$PATH) or point HOROVOD_NCCL_HOME at an NCCL"
        echo "  installed elsewhere, then run \`make install\` again: it rebuilds Horovod."
        echo "  To run over Gloo anyway (one GPU on one host, where Horovod has no peers; or"
        echo "  on purpose): ALLOW_GPU_WITHOUT_NCCL=1 make install"
    } >&2
}

# Where GPUs are present, Horovod must hold NCCL ($build_info, from horovod_build_info).
# Failing, not warning: without NCCL training still runs, only its throughput
# shows that every collective is copied to host memory and sent over Gloo's TCP, so a
# warning among an install's output would be missed, and the fix (the CUDA toolkit,
# then this script again) is known here. ALLOW_GPU_WITHOUT_NCCL=1 turns the failure
# into a warning, repeated on every later run.
require_gpu_nccl() {
    gpu_present || return 0
    grep -q '\[X\] NCCL' <<<"${build_info:-}" && return 0
    if [ "${ALLOW_GPU_WITHOUT_NCCL:-0}" = 1 ]; then
        explain_gpu_without_nccl "WARNING (ALLOW_GPU_WITHOUT_NCCL=1):"
        return 0
    fi
    explain_gpu_without_nccl "ERROR:"
    return 1
}

# Before the downloads and the build: a GPU machine with no nvcc would end with a
# Horovod without NCCL, so require_gpu_nccl would fail after minutes of work.
preflight_gpu_nccl() {
    gpu_present || return 0
    [ "${ALLOW_GPU_WITHOUT_NCCL:-0}" != 1 ] || return 0
    [ -z "${HOROVOD_WHEEL:-}" ] || return 0           # checked once installed
    [ "${HOROVOD_GPU_OPERATIONS:-}" != NCCL ] || return 0   # the build fails without nvcc
    command -v nvcc >/dev/null 2>&1 && return 0
    explain_gpu_without_nccl "ERROR:" "would be built"
    return 1
}

# The project's CPU kernels (dlrm/kernels): compiled against the venv's TensorFlow
# into the venv, under a name that follows their sources, so this runs on the
# up-to-date path too (it returns at once when that library exists). Without it
# training runs TensorFlow's ops instead, slower; the Dockerfile's install layer has
# no code yet and builds them after copying it.
build_kernels() {
    [ -f "$root/dlrm/kernels/__main__.py" ] || return 0
    if out="$(cd "$root" && "$venv/bin/python" -m dlrm.kernels --if_missing \
            2>"$venv/kernels.log")"; then
        case "$out" in *built*) log "${out#\[kernels\] }" ;; esac
    else
        log "CPU kernels not built (see $venv/kernels.log): training works without them," \
            "slower"
    fi
}

# The project, installed editable from this checkout: its commands exist and import
# the code from here (a moved checkout is installed again).
project_installed() {
    [ -x "$venv/bin/dlrm-train" ] || return 1
    [ "$(cd / && "$venv/bin/python" -c 'import dlrm, pathlib
print(pathlib.Path(dlrm.__file__).resolve().parents[1])' 2>/dev/null)" = "$root" ]
}

install_project() {
    [ -f "$root/dlrm/__init__.py" ] || return 0  # the Dockerfile's install layer: no code yet
    project_installed && return 0
    log "pip install -e $root (the project: dlrm-train, dlrm-preprocess, ...)"
    "$venv/bin/python" -m pip --disable-pip-version-check install --quiet --no-deps \
        --no-build-isolation -e "$root" 2>"$venv/project-install.log" \
        || { cat "$venv/project-install.log" >&2; exit 1; }
}

# Headers TensorFlow 2.21's C++ API includes (Horovod's build needs them), a C++
# toolchain and CMake for that build, Java for Spark, and OpenMPI so that Horovod is
# built with MPI as well as Gloo (srun --mpi=pmix on Slurm; WITH_MPI=0 skips it).
install_system_packages() {
    apt_packages=(libhighwayhash-dev libfarmhash-dev g++ cmake make)
    [ "${WITH_MPI:-1}" = 1 ] && apt_packages+=(libopenmpi-dev openmpi-bin)
    command -v java >/dev/null 2>&1 || apt_packages+=(openjdk-17-jre-headless)
    missing=()
    for pkg in "${apt_packages[@]}"; do
        # Only a fully installed package counts (an interrupted apt leaves "half-installed").
        [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" = "install ok installed" ] \
            || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        sudo=""
        if [ "$(id -u)" != 0 ]; then
            command -v sudo >/dev/null 2>&1 || {
                echo "[install] missing system packages: ${missing[*]}; run as root or install" \
                     "them with apt-get" >&2; exit 1; }
            sudo="sudo"
        fi
        log "apt-get install ${missing[*]}"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
    fi
}

# The virtual environment and the pinned packages (the CUDA TensorFlow on GPUs).
install_python_packages() {
    if [ ! -x "$venv/bin/python" ]; then
        log "creating $venv"
        "$python" -m venv "$venv"
    fi
    pip=("$venv/bin/python" -m pip --disable-pip-version-check)
    "${pip[@]}" install --quiet --upgrade pip==26.3 setuptools==84.2.1 wheel==0.48.0

    reqs=()
    for file in "${requirements[@]}"; do reqs+=(-r "$file"); done
    if gpu_present; then
        # GPU machine: the CUDA build of the same TensorFlow (not exercised on CI).
        sed 's/^tensorflow-cpu==/tensorflow[and-cuda]==/' "$root/requirements.txt" \
            > "$venv/requirements-gpu.txt"
        reqs[1]="$venv/requirements-gpu.txt"
        "${pip[@]}" uninstall --quiet -y tensorflow-cpu >/dev/null 2>&1 || true
    fi
    log "pip install ${requirements[*]##*/}"
    "${pip[@]}" install --quiet "${reqs[@]}" -c "$root/constraints.txt"
    if [ "$with_dev" = 1 ]; then
        # make bench's plotting library, beside the venv's packages and not among them:
        # Keras imports matplotlib with TensorFlow whenever it can, 0.4 s more to start
        # every process that imports TensorFlow. benchmarks/suite.py adds it to its path.
        log "pip install requirements-plot.txt (into $venv/plot-packages)"
        "${pip[@]}" install --quiet --no-deps --upgrade --target "$venv/plot-packages" \
            -r "$root/requirements-plot.txt" -c "$root/constraints.txt"
    fi
}

# Always through build_horovod.sh: it installs the wheel for the current TensorFlow,
# build options and patch (from its cache when one was built; a changed patch builds
# anew, which an installed Horovod that merely loads would hide).
install_horovod() {
    "$root/packaging/build_horovod.sh" "$venv"
    if ! check_horovod; then
        echo "[install] Horovod's build does not list TensorFlow and Gloo" \
             "(and MPI, with mpicxx installed; NCCL, with HOROVOD_GPU_OPERATIONS=NCCL):" >&2
        echo "${build_info:-<no output>}" >&2
        exit 1
    fi
    log "horovod built with: $(built_with)"
    require_gpu_nccl || exit 1
}

# What $build_info lists as built in, on one line ("TensorFlow Gloo MPI").
built_with() {
    local names
    names="$(grep -oE '\[X\] (TensorFlow|Gloo|MPI|NCCL)' <<<"$build_info" \
        | sed 's/\[X\] //' | sort -u | tr '\n' ' ')"
    echo "${names% }"
}

# The Spark class archive: local-mode preprocessing maps Spark's classes from it
# (preproc/class_archive.py), about 2 s less per run. It needs the project's code,
# which the Dockerfile's install layer does not have yet; without the archive Spark
# reads its classes from its jars.
write_class_archive() {
    if [ -f "$root/preproc/class_archive.py" ]; then
        if archive="$(cd "$root" && "$venv/bin/python" -m preproc.class_archive \
                2>"$venv/class-archive.log")"; then
            log "${archive#\[class_archive\] }"
        else
            log "no Spark class archive (see $venv/class-archive.log); preprocessing works" \
                "without it, starting about 2 s slower"
        fi
    fi
}

# install.sh --check: the installed venv's Horovod, and NCCL where GPUs are present.
check_only() {
    horovod_build_info || {
        echo "[install] Horovod does not load in $venv: run \`make install\`" >&2; return 1; }
    log "horovod built with: $(built_with)"
    require_gpu_nccl || return 1
    log "ok ($venv)"
}

main() {
    case "${1:-}" in
        "") ;;
        --check) check_only; return ;;
        *) echo "[install] usage: install.sh [--check], got '$1'" >&2; exit 2 ;;
    esac
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(fingerprint)" ] && horovod_loads; then
        require_gpu_nccl || exit 1   # warns again where ALLOW_GPU_WITHOUT_NCCL=1
        install_project
        build_kernels
        log "up to date ($venv)"
        exit 0
    fi
    preflight_gpu_nccl || exit 1
    install_system_packages
    install_python_packages
    install_horovod
    write_class_archive
    install_project
    build_kernels
    fingerprint > "$stamp"
    log "done ($venv)"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
