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
# then built with Gloo only). pip's own PIP_NO_INDEX / PIP_FIND_LINKS point it at a
# wheelhouse (packaging/wheelhouse.sh).
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
        command -v mpicxx || true
    } | sha256sum | cut -c1-16
}

# Sets $build_info to Horovod's build report, in `horovodrun --check-build`'s "[X] name"
# form; true when it lists TensorFlow and Gloo. One process asks the loaded library
# (TensorFlow: its ops load at all): --check-build starts a process per item, each
# importing TensorFlow, 20-35 s on 2 cores against about 5.
check_horovod() {
    build_info="$(TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c '
import horovod.tensorflow as h
for name, built in [("TensorFlow", True), ("Gloo", h.gloo_built()), ("MPI", h.mpi_built()),
                    ("NCCL", h.nccl_built())]:
    print("[X]" if built else "[ ]", name)' 2>/dev/null)" || return 1
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

# Quick re-check for the up-to-date path: Horovod's TensorFlow ops load, with Gloo.
horovod_loads() {
    TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c \
        'import sys, horovod.tensorflow as h; sys.exit(0 if h.gloo_built() else 1)' 2>/dev/null
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

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(fingerprint)" ] && horovod_loads; then
    install_project
    build_kernels
    log "up to date ($venv)"
    exit 0
fi

# --- system packages -------------------------------------------------------------
# Headers TensorFlow 2.21's C++ API includes (Horovod's build needs them), a C++
# toolchain and CMake for that build, Java for Spark, and OpenMPI so that Horovod is
# built with MPI as well as Gloo (srun --mpi=pmix on Slurm; WITH_MPI=0 skips it).
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

# --- virtual environment ---------------------------------------------------------
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

# --- Horovod ---------------------------------------------------------------------
# Always through build_horovod.sh: it installs the wheel for the current TensorFlow,
# build options and patch (from its cache when one was built; a changed patch builds
# anew, which an installed Horovod that merely loads would hide).
"$root/packaging/build_horovod.sh" "$venv"
if ! check_horovod; then
    echo "[install] Horovod's build does not list TensorFlow and Gloo" \
         "(and MPI, with mpicxx installed; NCCL, with HOROVOD_GPU_OPERATIONS=NCCL):" >&2
    echo "${build_info:-<no output>}" >&2
    exit 1
fi
log "horovod built with: $(grep -oE '\[X\] (TensorFlow|Gloo|MPI|NCCL)' <<<"$build_info" \
    | sed 's/\[X\] //' | sort -u | tr '\n' ' ')"

# --- Spark class archive -----------------------------------------------------------
# Local-mode preprocessing maps Spark's classes from it (preproc/class_archive.py):
# about 2 s less per run. It needs the project's code, which the Dockerfile's install
# layer does not have yet; without the archive Spark reads its classes from its jars.
if [ -f "$root/preproc/class_archive.py" ]; then
    if archive="$(cd "$root" && "$venv/bin/python" -m preproc.class_archive \
            2>"$venv/class-archive.log")"; then
        log "${archive#\[class_archive\] }"
    else
        log "no Spark class archive (see $venv/class-archive.log); preprocessing works" \
            "without it, starting about 2 s slower"
    fi
fi
install_project
build_kernels
fingerprint > "$stamp"
log "done ($venv)"
