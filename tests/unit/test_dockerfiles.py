"""The Dockerfiles, read as text (no Docker engine here or in CI; hadolint lints them in
`make lint`): base images pinned by tag, the training image installed by the tested
packaging/install.sh, the Spark image by the project's pins, the build context free of
the host's virtual environment."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "Dockerfile", *sorted((ROOT / "docker").glob("*.Dockerfile"))]


@dataclasses.dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ...
    arguments: str  # continuation lines joined


def instructions(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile; comments dropped, continuation lines joined."""
    result: list[Instruction] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).strip().partition(" ")
        result.append(Instruction(keyword.upper(), " ".join(arguments.split())))
        pending = ""
    assert not pending, f"{path}: ends inside a continued instruction"
    return result


def global_arg_defaults(path: Path) -> dict[str, str]:
    """ARG defaults declared before the first FROM (the ones FROM lines may use)."""
    defaults: dict[str, str] = {}
    for instruction in instructions(path):
        if instruction.keyword == "FROM":
            break
        if instruction.keyword == "ARG":
            name, _, value = instruction.arguments.partition("=")
            defaults[name] = value
    return defaults


def substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values[m.group(1) or m.group(2)], text)


def run_lines(path: Path) -> list[str]:
    return [i.arguments for i in instructions(path) if i.keyword == "RUN"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_by_tag(path: Path) -> None:
    defaults = global_arg_defaults(path)
    stages: set[str] = set()
    froms = [i for i in instructions(path) if i.keyword == "FROM"]
    assert froms, f"{path}: no FROM"
    for instruction in froms:
        words = [w for w in instruction.arguments.split() if not w.startswith("--")]
        image = substitute(words[0], defaults)
        if image in stages:
            continue  # a stage of this file, not an image
        tag = image.rpartition(":")[2] if ":" in image else ""
        assert "@sha256:" in image or (tag and tag != "latest" and "/" not in tag), (
            f"{path.name}: FROM {instruction.arguments} resolves to {image!r}; expected an "
            "image pinned by a tag other than latest"
        )
        if len(words) == 3 and words[1].upper() == "AS":
            stages.add(words[2])


def test_training_image_variants_are_stages() -> None:
    """`--build-arg VARIANT=cpu|gpu` picks a stage that tells install.sh the variant."""
    stages: dict[str, list[Instruction]] = {}
    current: list[Instruction] = []
    for instruction in instructions(ROOT / "Dockerfile"):
        if instruction.keyword == "FROM":
            words = instruction.arguments.split()
            current = stages.setdefault(words[-1] if len(words) == 3 else "", [])
        current.append(instruction)
    assert "FROM base-${VARIANT}" in [f"FROM {i.arguments}" for i in stages[""]]
    for variant in ("cpu", "gpu"):
        env = " ".join(i.arguments for i in stages[f"base-{variant}"] if i.keyword == "ENV")
        assert f"TENSORFLOW_VARIANT={variant}" in env
    gpu_env = " ".join(i.arguments for i in stages["base-gpu"] if i.keyword == "ENV")
    # No GPU is visible during `docker build`: NCCL must be asked for, not detected.
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in gpu_env


def test_training_image_runs_the_tested_install_script() -> None:
    assert any("packaging/install.sh" in run for run in run_lines(ROOT / "Dockerfile"))
    copies = [i.arguments for i in instructions(ROOT / "Dockerfile") if i.keyword == "COPY"]
    # install.sh reads these, so they must be in the image before it runs.
    first_copies = " ".join(copies[:2])
    for name in ("requirements.txt", "requirements-dev.txt", "constraints.txt", "packaging/"):
        assert name in first_copies


def pins(path: Path) -> dict[str, str]:
    """name (lower case, - for _) -> version of each `name==version` line."""
    result: dict[str, str] = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if match:
            result[match.group(1).lower().replace("_", "-")] = match.group(2)
    return result


def test_spark_image_installs_the_project_pins() -> None:
    runs = run_lines(ROOT / "docker" / "spark.Dockerfile")
    assert any("-r docker/requirements-spark.txt -c constraints.txt" in run for run in runs)
    names = [
        line.strip().lower()
        for line in (ROOT / "docker" / "requirements-spark.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert "pyspark" in names
    constraints, requirements = pins(ROOT / "constraints.txt"), pins(ROOT / "requirements.txt")
    for name in names:
        assert name in constraints, f"{name}: not pinned in constraints.txt"
        assert constraints[name] == requirements.get(name, constraints[name])


def test_build_context_leaves_out_the_host_environment() -> None:
    # `COPY . .` after the install would otherwise replace the image's .venv.
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".cache", ".git", "runs", "demo_output"} <= ignored
