"""The CPU training image (`Dockerfile`, VARIANT=cpu) and the Spark image
(`docker/spark.Dockerfile`), built with podman and run on data mounted from the host.

As an air-gapped cluster would build them: no registry (the Debian base is made with
debootstrap and imported under the name the Dockerfiles use) and no package index
(every wheel comes from the wheelhouse of `packaging/wheelhouse.sh`, Horovod's being
the one `make install` built). Then, in containers: training on 2 ranks under
horovodrun with a checkpoint, a SavedModel export, Spark preprocessing of a click log.
The host checks what they wrote: who owns it, and that it loads.

The output directories belong to a host user that the images do not know (uid
`HOST_USER`, neither root nor the images' own uid 1000) and the containers run as
that user with podman's `--passwd=false`, which gives them no passwd entry, as docker
does: the way docs/docker.md tells users to get outputs that they own. The export runs
as the images' own user into a directory owned by uid 1000, the other way it documents.

Everything podman keeps lives in a temporary directory removed at the end (CI runs on
a fresh machine, so keeping images between runs would save nothing there); the wheels
put into docker/wheelhouse/ are removed too.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tensorflow as tf

from dlrm.app.records import last_record
from feature_spec import FeatureSpec
from harness.models import JOB_FLAGS, JOB_STEPS, JOB_TABLES
from harness.podman import Podman, install_reason
from harness.processes import REPO, on_ranks, run

WHEELHOUSE = REPO / "docker" / "wheelhouse"
TRAINING_IMAGE = "dlrm-hybrid:cpu"
SPARK_IMAGE = "dlrm-spark"
IMAGE_USER = 1000  # the user the Dockerfiles create and run as
HOST_USER = 4321  # a host user (uid = gid) the images have no entry for
ROWS_PER_DAY = 5000
# Seconds: builds on 2 shared cores (docs/docker.md has the measured times).
BUILD_TIMEOUT = 1800
RUN_TIMEOUT = 600


def base_image() -> str:
    """The base the Dockerfiles build FROM (their DEBIAN_IMAGE default), which the test
    makes instead of pulling; both files must name the same one."""
    names = set()
    for dockerfile in (REPO / "Dockerfile", REPO / "docker" / "spark.Dockerfile"):
        match = re.search(r"^ARG DEBIAN_IMAGE=(\S+)$", dockerfile.read_text(), re.MULTILINE)
        assert match, f"{dockerfile}: no `ARG DEBIAN_IMAGE=...` default"
        names.add(match.group(1))
    assert len(names) == 1, f"the Dockerfiles' DEBIAN_IMAGE defaults differ: {names}"
    return names.pop()


def step(name: str, start: float) -> None:
    # Shown with `pytest -s`; docs/docker.md's table of build times comes from these.
    print(f"[containers] {name}: {time.monotonic() - start:.0f} s", file=sys.stderr)


def synthetic(*args: str, output: Path) -> Path:
    """`dlrm-synthetic ARGS --output_dir OUTPUT` on the host (the venv's command), its
    output made readable by every user: the containers read it as other users."""
    command = [str(Path(sys.executable).parent / "dlrm-synthetic"), *args, f"--output_dir={output}"]
    run(command, timeout=300, check=True)
    for path in [output, *output.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0))
    return output


def owned_directory(path: Path, uid: int) -> Path:
    """A new directory for a container's outputs, owned by `uid` (and gid = uid)."""
    path.mkdir(parents=True)
    os.chown(path, uid, uid)
    return path


def assert_owned_and_readable(root: Path, uid: int) -> None:
    """Everything under `root` belongs to `uid` and its owner may read it (and enter
    its directories): the host user `uid` reads what the container wrote."""
    paths = [root, *root.rglob("*")]
    assert len(paths) > 1, f"{root} is empty"
    for path in paths:
        info = path.lstat()
        assert (info.st_uid, info.st_gid) == (uid, uid), (
            f"{path}: owned by {info.st_uid}:{info.st_gid}, expected {uid}:{uid}"
        )
        needed = stat.S_IRUSR | (stat.S_IXUSR if path.is_dir() else 0)
        assert info.st_mode & needed == needed, f"{path}: mode {stat.filemode(info.st_mode)}"


@pytest.fixture(scope="module")
def podman() -> Iterator[Podman]:
    reason = install_reason()  # installs podman, runc and debootstrap with apt-get if missing
    if reason is not None:
        pytest.skip(reason)
    engine = Podman.create()
    try:
        start = time.monotonic()
        engine.import_debian_base(base_image())
        step(f"debootstrap + import of {base_image()}", start)
        yield engine
    finally:
        engine.remove()


@pytest.fixture(scope="module")
def wheelhouse() -> Iterator[Path]:
    """docker/wheelhouse/ filled for the images (no test tools: they build WITH_DEV=0);
    what was not there before is removed at the end."""
    before = set(WHEELHOUSE.iterdir())
    start = time.monotonic()
    try:
        made = subprocess.run(
            ["bash", str(REPO / "packaging" / "wheelhouse.sh"), str(WHEELHOUSE)],
            env=dict(os.environ, WITH_DEV="0"),
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
        assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
        step("wheelhouse", start)
        yield WHEELHOUSE
    finally:
        for path in set(WHEELHOUSE.iterdir()) - before:
            path.unlink()


def build(podman: Podman, tag: str, dockerfile: str, *build_args: str) -> None:
    start = time.monotonic()
    podman.check(
        "build",
        "--pull=never",  # the base is the imported one; no registry is reachable
        "--format=docker",  # OCI images have no SHELL: RUN would ignore the Dockerfiles'
        *(f"--build-arg={arg}" for arg in build_args),
        f"--file={REPO / dockerfile}",
        f"--tag={tag}",
        str(REPO),
        timeout=BUILD_TIMEOUT,
    )
    step(f"build {tag}", start)


@pytest.fixture(scope="module")
def training_image(podman: Podman, wheelhouse: Path) -> str:
    build(podman, TRAINING_IMAGE, "Dockerfile", "VARIANT=cpu", "WITH_DEV=0")
    return TRAINING_IMAGE


@pytest.fixture(scope="module")
def spark_image(podman: Podman, wheelhouse: Path) -> str:
    build(podman, SPARK_IMAGE, "docker/spark.Dockerfile")
    return SPARK_IMAGE


def run_container(podman: Podman, image: str, *args: str, user: int | None = None) -> str:
    """`podman run` of `args` in `image` with no network; `user`: run as that uid:gid
    with no passwd entry (as docker does), else as the image's user. `args` begins
    with podman's own options (-v ...), then `--`, then the command."""
    split = args.index("--")
    options = ["--network=none", *args[:split]]
    if user is not None:
        options += [f"--user={user}:{user}", "--passwd=false"]
    start = time.monotonic()
    output = podman.check("run", "--rm", *options, image, *args[split + 1 :], timeout=RUN_TIMEOUT)
    step(f"run {image} {args[split + 1]}", start)
    return output


def test_images_run_as_a_user_and_hold_no_wheels_or_caches(
    podman: Podman, training_image: str, spark_image: str
) -> None:
    for image in (training_image, spark_image):
        user = podman.check("image", "inspect", "--format={{.Config.User}}", image, timeout=60)
        assert user.strip() == f"{IMAGE_USER}:{IMAGE_USER}", image
        # The wheelhouse is mounted during the build, never copied; pip's cache is a
        # cache mount. (Debian's own venv wheels live in /usr/share/python-wheels.)
        found = run_container(
            podman,
            image,
            "--",
            "sh",
            "-c",
            "find /opt /root /tmp -name '*.whl' 2>/dev/null; ls -d /root/.cache/pip 2>/dev/null;"
            " true",
            user=0,
        )
        assert found.strip() == "", f"{image} holds: {found}"


def test_training_image_trains_two_ranks_and_exports(podman: Podman, training_image: str) -> None:
    dataset = synthetic(
        "dataset",
        "--train_rows=20000",
        "--test_rows=4000",
        f"--cardinalities={','.join(map(str, JOB_TABLES))}",
        output=podman.root / "dataset",
    )
    runs = owned_directory(podman.root / "runs", HOST_USER)
    train = ["dlrm-train", "--dataset_path=/data/synthetic", *JOB_FLAGS]
    output = run_container(
        podman,
        training_image,
        f"--volume={dataset}:/data/synthetic:ro",
        f"--volume={runs}:/runs",
        "--",
        # The image's horovodrun.
        *on_ranks(2, [*train, "--save_checkpoint_path=/runs/checkpoints"], launcher="horovodrun"),
        user=HOST_USER,
    )
    assert_owned_and_readable(runs, HOST_USER)
    checkpoints = runs / "checkpoints"
    written = sorted(checkpoints.glob("step_*"))
    assert written, f"no step_* checkpoint in {checkpoints}\n{output[-3000:]}"
    manifest = json.loads((written[-1] / "manifest.json").read_text())
    assert (manifest["step"], manifest["world_size"]) == (JOB_STEPS, 2), output[-3000:]
    summary = last_record(checkpoints / "metrics.jsonl", "summary")
    assert summary["world_size"] == 2 and summary["samples"] == 4000, summary

    # The export as the image's own user, from the checkpoint mounted read-only.
    exports = owned_directory(podman.root / "exports", IMAGE_USER)
    run_container(
        podman,
        training_image,
        f"--volume={runs}:/runs:ro",
        f"--volume={exports}:/exports",
        "--",
        "dlrm-train",
        "--mode=export",
        f"--restore_checkpoint_path=/runs/checkpoints/{written[-1].name}",
        "--saved_model_output_path=/exports/saved_model",
    )
    assert_owned_and_readable(exports, IMAGE_USER)
    serving = tf.saved_model.load(str(exports / "saved_model")).signatures["serving_default"]
    assert set(serving.structured_outputs) == {"probability"}


def test_spark_image_preprocesses_a_click_log(podman: Podman, spark_image: str) -> None:
    raw = synthetic(
        "clicklog", "--days=2", f"--rows_per_day={ROWS_PER_DAY}", output=podman.root / "raw"
    )
    out = owned_directory(podman.root / "preprocessed", HOST_USER)
    output = run_container(
        podman,
        spark_image,
        f"--volume={raw}:/data/raw:ro",
        f"--volume={out}:/runs",
        "--",
        "dlrm-preprocess",
        "--input_dir=/data/raw",
        "--output_dir=/runs/criteo",
        "--train_days=0",
        "--test_days=1",
        "--shuffle_partitions=2",
        "--spark_conf",
        "spark.ui.enabled=false",
        user=HOST_USER,
    )
    assert_owned_and_readable(out, HOST_USER)
    spec = FeatureSpec.load(out / "criteo", required_mappings=("train", "test"))
    assert spec.files("train").label.stat().st_size == ROWS_PER_DAY, output[-3000:]  # day 0
    assert spec.files("test").label.stat().st_size == ROWS_PER_DAY, output[-3000:]  # day 1
    assert len(spec.categorical_features) == 26, output[-3000:]
