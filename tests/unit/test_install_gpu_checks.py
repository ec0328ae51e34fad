"""packaging/install.sh's GPU checks without a GPU: fake `nvidia-smi` and `nvcc`
scripts on PATH, and install.sh's functions sourced (its guard runs nothing then).

- the up-to-date stamp follows the CUDA toolkit: installing or upgrading nvcc after
  an install rebuilds (Horovod then gets NCCL);
- a GPU machine whose Horovod lacks NCCL fails the install, saying what is missing
  and how to fix it, unless ALLOW_GPU_WITHOUT_NCCL=1, which only warns;
- build_horovod.sh asks for NCCL where install.sh installs the CUDA TensorFlow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.processes import REPO

INSTALL = REPO / "packaging" / "install.sh"
BUILD_HOROVOD = REPO / "packaging" / "build_horovod.sh"
WITHOUT_NCCL = "[X] TensorFlow\n[X] Gloo\n[ ] MPI\n[ ] NCCL"
WITH_NCCL = "[X] TensorFlow\n[X] Gloo\n[ ] MPI\n[X] NCCL"


def _script(path: Path, text: str) -> None:
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)


# What the scripts run, besides nvidia-smi and nvcc (which development machines may
# have: some have a CUDA toolkit and no GPU).
TOOLS = ("bash", "cat", "cut", "dirname", "env", "grep", "ls", "sed", "sha256sum", "sort", "tr")


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """The directory of the fake nvidia-smi and nvcc, empty until a test adds them;
    `sandbox_env`'s PATH is it and the TOOLS, nothing else."""
    directory = tmp_path / "bin"
    directory.mkdir()
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found is not None, tool
        (tools / tool).symlink_to(found)
    return directory


def sandbox_env(fake_bin: Path, **env: str) -> dict[str, str]:
    """This process's environment less the settings install.sh reads, with PATH
    limited to the fakes and TOOLS, a throwaway VENV, and `env`."""
    base = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("HOROVOD_", "TENSORFLOW_VARIANT", "ALLOW_GPU", "WITH_"))
    }
    base.update(
        PATH=f"{fake_bin}:{fake_bin.parent / 'tools'}",
        PYTHON=sys.executable,
        VENV=str(fake_bin.parent / "venv"),
        **env,
    )
    return base


def add_gpus(fake_bin: Path, count: int = 1) -> None:
    lines = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-0000000{i})'\n" for i in range(count))
    _script(fake_bin / "nvidia-smi", f'[ "$1" = -L ] || exit 0\n{lines}')


def add_nvcc(fake_bin: Path, release: str) -> None:
    _script(
        fake_bin / "nvcc",
        "echo 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        f"echo 'Cuda compilation tools, release {release}, V{release}.82'\n",
    )


def run_sourced(fake_bin: Path, commands: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`commands` in bash after sourcing install.sh, in `sandbox_env`."""
    # Sourcing an install.sh without its guard would run the whole install.
    assert 'if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then\n    main "$@"' in INSTALL.read_text()
    return subprocess.run(
        ["bash", "-c", f'source "{INSTALL}"\n{commands}'],
        env=sandbox_env(fake_bin, **env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def fingerprint(fake_bin: Path) -> str:
    result = run_sourced(fake_bin, "fingerprint")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_stamp_follows_the_cuda_toolkit(fake_bin: Path) -> None:
    add_gpus(fake_bin)
    without = fingerprint(fake_bin)
    assert fingerprint(fake_bin) == without  # deterministic
    add_nvcc(fake_bin, "12.4")
    cuda_12_4 = fingerprint(fake_bin)
    assert cuda_12_4 != without  # CUDA installed after the first install: rebuild
    add_nvcc(fake_bin, "12.5")
    assert fingerprint(fake_bin) not in (without, cuda_12_4)  # upgraded: rebuild


def test_the_stamp_follows_the_permission_to_run_without_nccl(fake_bin: Path) -> None:
    # An install allowed without NCCL is not up to date once the permission is gone.
    allowed = run_sourced(fake_bin, "fingerprint", ALLOW_GPU_WITHOUT_NCCL="1").stdout
    assert allowed.strip() != fingerprint(fake_bin)


def require(fake_bin: Path, build_info: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_sourced(fake_bin, f"build_info='{build_info}'\nrequire_gpu_nccl", **env)


def test_gpus_and_a_horovod_without_nccl_fail_the_install(fake_bin: Path) -> None:
    add_gpus(fake_bin, count=2)
    result = require(fake_bin, WITHOUT_NCCL)
    assert result.returncode == 1
    message = result.stderr
    assert message.startswith("[install] ERROR: GPUs are present (nvidia-smi -L: 2 GPU(s);")
    assert "but\n  Horovod is built without NCCL: every collective" in message
    assert "would go through Gloo and host memory." in message
    # What is missing, how to fix it, and the way out.
    assert "nvcc (the CUDA toolkit): not on PATH" in message
    assert "NCCL headers (nccl.h): not found" in message
    assert "apt-get install cuda-toolkit-12-5 libnccl-dev" in message
    assert "ALLOW_GPU_WITHOUT_NCCL=1 make install" in message


def test_the_message_names_the_toolkit_and_headers_found(fake_bin: Path, tmp_path: Path) -> None:
    add_gpus(fake_bin)
    add_nvcc(fake_bin, "12.5")
    nccl = tmp_path / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
    wheel = tmp_path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    result = require(fake_bin, WITHOUT_NCCL, HOROVOD_NCCL_HOME=str(nccl), HOROVOD_WHEEL=str(wheel))
    assert result.returncode == 1
    assert f"nvcc: {fake_bin / 'nvcc'} (Cuda compilation tools, release 12.5" in result.stderr
    assert f"NCCL headers: {nccl}/include/nccl.h" in result.stderr
    assert f"HOROVOD_WHEEL={wheel}: a prebuilt wheel without NCCL" in result.stderr


def test_allow_gpu_without_nccl_warns_loudly_and_passes(fake_bin: Path) -> None:
    add_gpus(fake_bin)
    result = require(fake_bin, WITHOUT_NCCL, ALLOW_GPU_WITHOUT_NCCL="1")
    assert result.returncode == 0
    assert result.stderr.startswith(
        "[install] WARNING (ALLOW_GPU_WITHOUT_NCCL=1): GPUs are present"
    )
    assert "nvcc (the CUDA toolkit): not on PATH" in result.stderr


@pytest.mark.parametrize(
    ("gpus", "build_info", "env"),
    [
        (1, WITH_NCCL, {}),  # a GPU and NCCL: what the check wants
        (0, WITHOUT_NCCL, {}),  # no nvidia-smi: a CPU machine
        (1, WITHOUT_NCCL, {"TENSORFLOW_VARIANT": "cpu"}),  # the CPU build, asked for
    ],
)
def test_nothing_to_say_without_gpus_or_with_nccl(
    fake_bin: Path, gpus: int, build_info: str, env: dict[str, str]
) -> None:
    if gpus:
        add_gpus(fake_bin, gpus)
    result = require(fake_bin, build_info, **env)
    assert (result.returncode, result.stderr) == (0, "")


def test_the_gpu_variant_without_a_visible_gpu_needs_nccl_too(fake_bin: Path) -> None:
    # An image build (no GPU visible) that asks for the CUDA TensorFlow.
    result = require(fake_bin, WITHOUT_NCCL, TENSORFLOW_VARIANT="gpu")
    assert result.returncode == 1
    assert "nvidia-smi -L: 0 GPU(s); TENSORFLOW_VARIANT=gpu" in result.stderr


def test_the_preflight_fails_before_any_download_without_nvcc(fake_bin: Path) -> None:
    add_gpus(fake_bin)
    result = run_sourced(fake_bin, "preflight_gpu_nccl")
    assert result.returncode == 1
    assert "but\n  Horovod would be built without NCCL" in result.stderr
    assert "nvcc (the CUDA toolkit): not on PATH" in result.stderr
    # Passes where the build can get NCCL, or is checked once installed, or is allowed.
    for env in (
        {"ALLOW_GPU_WITHOUT_NCCL": "1"},
        {"HOROVOD_WHEEL": "/wheels/horovod.whl"},
        {"TENSORFLOW_VARIANT": "cpu"},
    ):
        result = run_sourced(fake_bin, "preflight_gpu_nccl", **env)
        assert (result.returncode, result.stderr) == (0, ""), env
    add_nvcc(fake_bin, "12.5")
    assert run_sourced(fake_bin, "preflight_gpu_nccl").returncode == 0


def fake_venv(tmp_path: Path, python: str) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    _script(venv / "bin" / "python", python)
    return venv


def test_install_check_reports_a_gpu_machine_without_nccl(fake_bin: Path, tmp_path: Path) -> None:
    """`install.sh --check`: the installed Horovod, asked as install.sh asks it."""
    fake_venv(tmp_path, f"printf '{WITHOUT_NCCL}\\n'\n")
    env = sandbox_env(fake_bin)
    check = ["bash", str(INSTALL), "--check"]
    result = subprocess.run(check, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr  # no GPU here
    assert result.stdout.splitlines() == [
        "[install] horovod built with: Gloo TensorFlow",
        f"[install] ok ({tmp_path / 'venv'})",
    ]
    add_gpus(fake_bin)
    result = subprocess.run(check, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 1
    assert result.stderr.startswith("[install] ERROR: GPUs are present")


def build_horovod_options(fake_bin: Path, tmp_path: Path, **env: str) -> str:
    """The HOROVOD_GPU_OPERATIONS build_horovod.sh exports, seen by a fake venv
    python installing a prebuilt wheel (no build)."""
    seen = tmp_path / "seen"
    venv = fake_venv(tmp_path, f'echo "gpu_operations=$HOROVOD_GPU_OPERATIONS" > {seen}\n')
    wheel = tmp_path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"PK")
    subprocess.run(
        ["bash", str(BUILD_HOROVOD), str(venv)],
        env=sandbox_env(fake_bin, HOROVOD_WHEEL=str(wheel), **env),
        capture_output=True,
        text=True,
        check=True,
    )
    return seen.read_text().strip()


def test_build_horovod_asks_for_nccl_where_the_cuda_tensorflow_goes(
    fake_bin: Path, tmp_path: Path
) -> None:
    assert build_horovod_options(fake_bin, tmp_path) == "gpu_operations="
    add_nvcc(fake_bin, "12.5")
    assert build_horovod_options(fake_bin, tmp_path) == "gpu_operations="  # no GPU
    # The image build: no GPU visible, the CUDA TensorFlow asked for.
    variant_gpu = build_horovod_options(fake_bin, tmp_path, TENSORFLOW_VARIANT="gpu")
    assert variant_gpu == "gpu_operations=NCCL"
    add_gpus(fake_bin)
    assert build_horovod_options(fake_bin, tmp_path) == "gpu_operations=NCCL"
    cpu = build_horovod_options(fake_bin, tmp_path, TENSORFLOW_VARIANT="cpu")
    assert cpu == "gpu_operations="
