#!/usr/bin/env bash
# Builds a wheelhouse: every wheel an installation of the project needs, for a machine
# or an image build that cannot reach a package index (an air-gapped cluster; the
# container builds of CI, docs/docker.md). It holds
#   - the pinned packages, requirements.txt and (unless WITH_DEV=0) requirements-dev.txt
#     and requirements-plot.txt under constraints.txt, as wheels: downloaded where the
#     index has one, built here from the sdist where it has none (pyspark);
#   - pip, setuptools and wheel at the versions of the venv (install.sh upgrades a new
#     venv to them first, and setuptools builds the project);
#   - the Horovod wheel that `make install` built against that TensorFlow, or the one
#     HOROVOD_WHEEL names;
#   - the project's own wheel (dlrm-hybrid: dlrm-train, dlrm-preprocess, ...).
# The wheels are for this machine's Python (3.11) and platform; the Horovod wheel also
# links this system's libraries (libstdc++, OpenMPI's libmpi when built with MPI), so
# its target is a system of the same release (Debian bookworm here and in the images).
# Install from it, with no index:
#   pip install --no-index --find-links DIR -r requirements.txt -c constraints.txt \
#       horovod dlrm-hybrid
# or build the images from it: packaging/wheelhouse.sh docker/wheelhouse, then
# docker build / podman build as usual (docs/docker.md).
#
# Usage: packaging/wheelhouse.sh [DIR]   (default: .cache/wheelhouse; run `make install`
# first). Environment: VENV (default .venv), WITH_DEV, HOROVOD_WHEEL. Run again, it
# takes the wheels it has from pip's cache and rebuilds the project's wheel.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"
out="$(mkdir -p "${1:-$root/.cache/wheelhouse}" && cd "${1:-$root/.cache/wheelhouse}" && pwd)"
python="$venv/bin/python"
pip=("$python" -m pip --disable-pip-version-check)
log() { echo "[wheelhouse] $*"; }

[ -x "$python" ] || {
    echo "[wheelhouse] no virtual environment at $venv: run \`make install\` first" >&2; exit 1; }
if [ -z "${HOROVOD_WHEEL:-}" ]; then
    [ -f "$venv/horovod-wheel.txt" ] || {
        echo "[wheelhouse] $venv/horovod-wheel.txt is missing: run \`make install\` first" \
             "(it builds the Horovod wheel), or name a wheel with HOROVOD_WHEEL=" >&2; exit 1; }
    HOROVOD_WHEEL="$(cat "$venv/horovod-wheel.txt")"
fi
[ -f "$HOROVOD_WHEEL" ] || {
    echo "[wheelhouse] the Horovod wheel $HOROVOD_WHEEL is gone: rerun \`make install\`" >&2
    exit 1; }

files=(requirements.txt)
[ "${WITH_DEV:-1}" = 1 ] && files+=(requirements-dev.txt requirements-plot.txt)
requirements=()
for file in "${files[@]}"; do requirements+=(-r "$root/$file"); done
# The versions install.sh put in the venv, so that the same step in a build finds them.
mapfile -t bootstrap < <("${pip[@]}" freeze --all | grep -iE '^(pip|setuptools|wheel)==')
log "pinned packages (${files[*]}, constraints.txt) -> $out"
# `pip wheel`, not `pip download`: pyspark is published as an sdist only.
"${pip[@]}" wheel --quiet --find-links "$out" -w "$out" \
    "${requirements[@]}" "${bootstrap[@]}" -c "$root/constraints.txt"
cp "$HOROVOD_WHEEL" "$out/"

# The project's wheel, built from a copy of what it is made of (pyproject.toml, its
# README and the packages it includes), so that the build leaves no build/ or
# *.egg-info in the checkout; without build isolation, from the venv's setuptools.
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mapfile -t sources < <("$python" - "$root" <<'EOF'
import fnmatch
import sys
import tomllib
from pathlib import Path

root = Path(sys.argv[1])
project = tomllib.loads((root / "pyproject.toml").read_text())
patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
print("pyproject.toml")
print(project["project"]["readme"])
for path in sorted(root.iterdir()):
    if (path / "__init__.py").is_file() and any(fnmatch.fnmatch(path.name, p) for p in patterns):
        print(path.name)
EOF
)
(cd "$root" && cp -r "${sources[@]}" "$stage/")
find "$stage" -name __pycache__ -type d -prune -exec rm -rf {} +
rm -f "$out"/dlrm_hybrid-*.whl
"${pip[@]}" wheel --quiet --no-deps --no-build-isolation -w "$out" "$stage" \
    >"$stage/build.log" 2>&1 || { cat "$stage/build.log" >&2; exit 1; }
log "$(find "$out" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$out" | cut -f1)" \
    "in $out"
