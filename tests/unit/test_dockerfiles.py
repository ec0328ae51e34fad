"""The Dockerfiles, read as text (hadolint lints them in `make lint`; the integration
test tests/integration/test_container_images.py builds and runs the CPU training and
Spark images): base images pinned by tag, the training image installed by the tested
packaging/install.sh, the Spark image by the project's pins, the wheelhouse mounted
for every install and never copied into an image, the code copied after the install,
the build context free of the host's virtual environment."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from harness.processes import REPO

DOCKERFILES = [REPO / "Dockerfile", *sorted((REPO / "docker").glob("*.Dockerfile"))]


@dataclasses.dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ...
    arguments: str  # continuation lines joined


def instructions(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile; comments dropped, continuation lines joined."""
    result: list[Instruction] = []
    pending = ""
    for line in path.read_text().splitlines():
        # Comments are dropped even inside a continued instruction; blank lines between.
        if line.lstrip().startswith("#") or (not pending and not line.strip()):
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


def arguments(stage: list[Instruction], keyword: str) -> list[str]:
    return [i.arguments for i in stage if i.keyword == keyword]


def listed(path: Path) -> list[str]:
    """The lines of a list file, stripped, without blank lines and comments."""
    return [
        line.strip() for line in path.read_text().splitlines() if line.strip() and line[0] != "#"
    ]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_by_tag(path: Path) -> None:
    defaults = global_arg_defaults(path)
    stages: set[str] = set()
    froms = arguments(instructions(path), "FROM")
    assert froms, f"{path}: no FROM"
    for line in froms:
        words = [w for w in line.split() if not w.startswith("--")]
        image = substitute(words[0], defaults)
        if image in stages:
            continue  # a stage of this file, not an image
        tag = image.rpartition(":")[2] if ":" in image else ""
        assert "@sha256:" in image or (tag and tag != "latest" and "/" not in tag), (
            f"{path.name}: FROM {line} resolves to {image!r}; expected an "
            "image pinned by a tag other than latest"
        )
        if len(words) == 3 and words[1].upper() == "AS":
            stages.add(words[2])


def stages(path: Path) -> dict[str, list[Instruction]]:
    """Each stage's instructions, from its FROM on, by its name ("" for the unnamed
    last stage, the image)."""
    result: dict[str, list[Instruction]] = {}
    current: list[Instruction] = []
    for instruction in instructions(path):
        if instruction.keyword == "FROM":
            words = instruction.arguments.split()
            current = result.setdefault(words[-1] if len(words) == 3 else "", [])
        current.append(instruction)
    return result


def test_training_image_variants_are_stages() -> None:
    """`--build-arg VARIANT=cpu|gpu` picks a stage that tells install.sh the variant."""
    by_name = stages(REPO / "Dockerfile")
    assert "base-${VARIANT}" in arguments(by_name[""], "FROM")
    for variant in ("cpu", "gpu"):
        env = " ".join(arguments(by_name[f"base-{variant}"], "ENV"))
        assert f"TENSORFLOW_VARIANT={variant}" in env
    gpu_env = " ".join(arguments(by_name["base-gpu"], "ENV"))
    # No GPU is visible during `docker build`: NCCL must be asked for, not detected.
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in gpu_env


def test_training_image_installs_with_the_tested_script_before_the_code() -> None:
    image = stages(REPO / "Dockerfile")[""]
    is_install = [i.keyword == "RUN" and "packaging/install.sh" in i.arguments for i in image]
    install = is_install.index(True)
    copied_before = " ".join(arguments(image[:install], "COPY"))
    # install.sh reads these (pyproject.toml: its fingerprint), so they must be in the
    # image before it runs; the code must not be, so that editing it keeps that layer.
    for name in (
        "requirements.txt",
        "requirements-dev.txt",
        "requirements-plot.txt",
        "constraints.txt",
        "pyproject.toml",
        "packaging/",
    ):
        assert name in copied_before
    for name in ("dlrm", "preproc", "--from=checkout"):
        assert name not in copied_before.split()
    assert any(copy.startswith("--from=checkout") for copy in arguments(image[install:], "COPY"))


def pins(path: Path) -> dict[str, str]:
    """name (lower case, - for _) -> version of each `name==version` line."""
    matches = [re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line) for line in listed(path)]
    return {m.group(1).lower().replace("_", "-"): m.group(2) for m in matches if m}


def test_spark_image_installs_the_project_pins() -> None:
    runs = arguments(instructions(REPO / "docker" / "spark.Dockerfile"), "RUN")
    assert any("-r docker/requirements-spark.txt -c constraints.txt" in run for run in runs)
    names = [line.lower() for line in listed(REPO / "docker" / "requirements-spark.txt")]
    assert "pyspark" in names
    constraints, requirements = pins(REPO / "constraints.txt"), pins(REPO / "requirements.txt")
    for name in names:
        assert name in constraints, f"{name}: not pinned in constraints.txt"
        assert constraints[name] == requirements.get(name, constraints[name])


def test_build_context_leaves_out_the_host_environment() -> None:
    # `COPY . .` after the install would otherwise replace the image's .venv.
    ignored = {line.rstrip("/") for line in listed(REPO / ".dockerignore")}
    assert {".venv", ".cache", ".git", "runs", "demo_output"} <= ignored
    # The builds mount docker/wheelhouse/ from the context: it must stay in it.
    assert not any(line.startswith("docker/wheelhouse") and "*.whl" not in line for line in ignored)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_install_step_takes_the_wheelhouse_when_it_has_wheels(path: Path) -> None:
    """pip reaches no index in the air-gapped builds (and in CI): each step that runs pip
    mounts docker/wheelhouse/ and points pip at it alone when it holds wheels."""
    runs = arguments(instructions(path), "RUN")
    installs = [run for run in runs if "pip install" in run or "install.sh" in run]
    assert installs, f"{path.name}: no install step"
    for run in installs:
        assert "--mount=type=bind,source=docker/wheelhouse,target=/wheelhouse" in run, run
        assert "export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse" in run, run
        if "install.sh" in run:
            # ... and the Horovod wheel found there is installed instead of built.
            assert "export HOROVOD_WHEEL" in run, run


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_wheelhouse_is_never_copied_into_an_image(path: Path) -> None:
    """`COPY . ...` happens only in the stage that then deletes docker/wheelhouse/; the
    image copies from that stage. (.dockerignore cannot leave the wheelhouse out of the
    context: docker build mounts nothing that it leaves out.)"""
    for name, stage in stages(path).items():
        copies_context = [c for c in arguments(stage, "COPY") if c.split()[0] in (".", "./")]
        if name == "checkout":
            assert copies_context
            assert "rm -rf /checkout/docker/wheelhouse" in arguments(stage, "RUN")
        else:
            assert not copies_context, f"{path.name}, stage {name or 'image'}: {copies_context}"


def test_both_images_build_from_the_same_fully_named_debian() -> None:
    """tests/integration imports a debootstrapped Debian under this name and builds
    with --pull=never. The name is written in full because `podman import` files a
    short one (debian:...) under localhost/, which docker would not pull."""
    bases = {global_arg_defaults(path)["DEBIAN_IMAGE"] for path in DOCKERFILES}
    assert len(bases) == 1, bases
    assert bases.pop().startswith("docker.io/library/debian:bookworm")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_uid_1000_through_the_entrypoint(path: Path) -> None:
    image = stages(path)[""]
    assert arguments(image, "USER") == ["1000:1000"]
    assert arguments(image, "ENTRYPOINT") == ['["/bin/sh", "/usr/local/bin/dlrm-entrypoint"]']
    assert "docker/entrypoint.sh /usr/local/bin/dlrm-entrypoint" in arguments(image, "COPY")
