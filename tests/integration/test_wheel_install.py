"""The product as a user outside the checkout has it: the project's wheel installed
into a new virtual environment, beside the pinned packages and the Horovod wheel
that `make install` built (all from the wheelhouse of `packaging/wheelhouse.sh`,
with no package index), then the README's quick start run as written with that
venv's commands, from a directory outside the checkout: generate a click log,
preprocess it with Spark, train on 2 ranks under horovodrun, evaluate, export, score
with the SavedModel (`harness/documents.run_readme_quick_start` checks what
they leave). The CPU kernels, which the wheel carries as sources, compile on first use
into the new environment, and the commands print no start-up noise."""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest

from harness.documents import run_readme_quick_start
from harness.processes import REPO
from harness.quiet import noise_in

WHEELHOUSE = REPO / ".cache" / "wheelhouse"


def _run(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, f"{args}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of a new venv holding the installed wheel and its dependencies."""
    made = subprocess.run(
        ["bash", str(REPO / "packaging" / "wheelhouse.sh"), str(WHEELHOUSE)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    root = tmp_path_factory.mktemp("installed")
    venv.create(root / "venv", with_pip=True)
    python = root / "venv" / "bin" / "python"
    _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--find-links",
            str(WHEELHOUSE),
            "-r",
            str(REPO / "requirements.txt"),
            "-c",
            str(REPO / "constraints.txt"),
            "horovod",
            "dlrm-hybrid",
        ],
        cwd=root,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        timeout=1200,
    )
    return python.parent


def test_the_readme_quick_start_runs_on_the_installed_wheel(
    installed: Path, tmp_path: Path
) -> None:
    # Nothing of the checkout's: no PYTHONPATH, a working directory outside it, and
    # TensorFlow's logging left at the product's own default.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL")}
    work = tmp_path / "work"
    work.mkdir()
    where = _run(
        [
            str(installed / "python"),
            "-c",
            "import dlrm, preproc; print(dlrm.__file__); print(preproc.__file__)",
        ],
        work,
        env,
    )
    for module_file in where.stdout.split():
        assert Path(module_file).is_relative_to(installed.parent), module_file
        assert not Path(module_file).is_relative_to(REPO), module_file

    # The scoring snippet imports TensorFlow itself: its notices are TensorFlow's, not
    # the product's, so its stderr goes to a file of its own.
    result = run_readme_quick_start(work, installed, python_stderr=tmp_path / "python.stderr")
    output = result.stdout + result.stderr
    # The kernels compiled on first use, into the new environment, once.
    kernels = list((installed.parent / "lib" / "dlrm-kernels").glob("dlrm_kernels-*.so"))
    assert len(kernels) == 1, kernels
    assert "the CPU kernels are not in use" not in output
    assert noise_in(output) == []
