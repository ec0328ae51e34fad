"""Failures under `horovodrun --gloo -np 2`: every rank stops with a clear error,
within a bounded time, and never hangs: bad flags, plans or FeatureSpecs that
differ between ranks, ids outside their table, a rank that dies, and a rank
whose checkpoint write or restore fails."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dlrm.app.records import read_records
from dlrm.checkpoint.reader import Checkpoint
from dlrm.embedding.planner.placement import PlannerConfig, plan_sharding
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import TableSpec
from feature_spec import FeatureSpec
from harness.datasets import dataset_fixture
from harness.processes import (
    has_exited,
    main_py,
    main_py_command,
    on_ranks,
    rank_pids,
    run,
    started,
    wait_for,
)

CARDINALITIES = (40, 300, 7, 1000)
DIM = 8
MODEL = [
    "--optimizer=adagrad",
    "--learning_rate=0.05",
    "--warmup_steps=0",
    "--decay_start_step=0",
    f"--embedding_dim={DIM}",
    f"--bottom_mlp_dims=16,{DIM}",
    "--top_mlp_dims=16,1",
    "--evals_per_epoch=0",
]
# A surviving rank must be gone this long after its peer was killed.
EXIT_LIMIT_S = 60


dataset = dataset_fixture(CARDINALITIES, 4, {"train": 200_000, "test": 2_000}, seed=5)


def test_batch_that_does_not_divide_stops_every_rank(dataset: Path) -> None:
    result = main_py(2, f"--dataset_path={dataset}", "--batch_size=1025", *MODEL, timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    message = (
        "--batch_size: the global batch must divide by the number of ranks (2); "
        "got 1025 = 512 * 2 + 1"
    )
    # Every rank finds it alike, from the same flags: rank 0 says it, once.
    assert output.count(message) == 1, output[-3000:]
    assert "[0]<stderr>:main.py: invalid flags: " + message in output


def test_plan_for_another_world_size_is_refused(dataset: Path, tmp_path: Path) -> None:
    tables = [TableSpec(rows, DIM) for rows in CARDINALITIES]
    plan_file = tmp_path / "plan.json"
    plan_sharding(tables, PlannerConfig(world_size=3)).save(plan_file)
    result = main_py(
        2,
        f"--dataset_path={dataset}",
        "--batch_size=1024",
        f"--sharding_plan={plan_file}",
        *MODEL,
        timeout=120,
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    message = f"--sharding_plan {plan_file}: the sharding plan is for 3 ranks, this run has 2"
    # The ranks agree on a plan's failure (one allgather): rank 0 says it, once.
    assert output.count(message) == 1, output[-3000:]
    assert f"[0]<stderr>:main.py: {message}" in output


def test_a_killed_rank_makes_the_other_exit(dataset: Path, tmp_path: Path) -> None:
    output = tmp_path / "run"
    log = tmp_path / "horovodrun.log"
    command = main_py_command(
        2,
        f"--dataset_path={dataset}",
        "--batch_size=256",
        "--print_freq=1",
        f"--save_checkpoint_path={output}",
        *MODEL,
    )
    with started(command, log) as launcher:
        # Until both ranks are training: rank 0 has logged a few steps.
        wait_for(
            lambda: len(read_records(output / "metrics.jsonl", "train")) >= 3, launcher, 180, log
        )
        survivors = rank_pids(0, str(output))
        victims = rank_pids(1, str(output))
        assert len(survivors) == 1 and len(victims) == 1, (survivors, victims)
        os.kill(victims[0], signal.SIGKILL)
        killed_at = time.monotonic()
        returncode = launcher.wait(timeout=EXIT_LIMIT_S)
        elapsed = time.monotonic() - killed_at
    print(f"horovodrun exited {returncode} {elapsed:.1f} s after rank 1 was killed")
    assert returncode != 0, log.read_text()[-3000:]
    assert elapsed < EXIT_LIMIT_S
    # The surviving rank is gone too, not left hanging in a collective.
    assert has_exited(survivors[0])
    # Rank 0 never reported success.
    assert not read_records(output / "metrics.jsonl", "summary")


# Small tables replicated, the others model-parallel: each rank holds shards.
MIXED = ["--data_parallel_threshold=100", "--batch_size=1024"]
# Horovod's stall shutdown (900 s by default) is what a rank waiting in a
# collective its peer never joins would hit; these failures must end far sooner.
FAILURE_LIMIT_S = 60


def per_rank(command: str) -> list[str]:
    """horovodrun -np 2 of a shell command, where ${HOROVOD_RANK} differs by rank."""
    return on_ranks(2, ["bash", "-c", command])


def timed(command: list[str], limit: float = 240) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    result = run(command, timeout=limit)
    return result, time.monotonic() - start


def test_ranks_with_different_plan_files_stop_naming_the_rank(
    dataset: Path, tmp_path: Path
) -> None:
    tables = [TableSpec(rows, DIM) for rows in CARDINALITIES]
    plan = plan_sharding(tables, PlannerConfig(world_size=2, data_parallel_threshold=100))
    plan.save(tmp_path / "plan_0.json")
    data = plan.to_dict()  # the same plan with one table moved to the other rank
    moved = next(t for t in data["tables"] if t["kind"] == "table_wise")
    moved["shards"][0]["rank"] = 1 - moved["shards"][0]["rank"]
    ShardingPlan.from_dict(data).save(tmp_path / "plan_1.json")
    flags = " ".join([f"--dataset_path={dataset}", *MIXED, *MODEL])
    result, elapsed = timed(
        per_rank(
            f"exec {sys.executable} main.py {flags} "
            f"--sharding_plan={tmp_path}/plan_${{HOROVOD_RANK}}.json"
        )
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    message = f"rank 1 differs from rank 0 in plan.tables[{moved['table']}].shards[0].rank"
    # Every rank stops on its own; horovodrun may end the second before it prints.
    assert output.count(message) >= 1, output[-3000:]
    assert not re.search(r"training: [\d,]+ rows", output)  # stopped before the first step
    print(f"mismatched plans: both ranks stopped {elapsed:.1f} s after the launch")


def test_ranks_with_different_feature_specs_stop_naming_the_rank(
    dataset: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    shutil.copytree(dataset, other)
    spec = (other / "feature_spec.yaml").read_text()
    assert spec.count("cardinality: 1000") == 1
    (other / "feature_spec.yaml").write_text(spec.replace("cardinality: 1000", "cardinality: 999"))
    flags = " ".join([*MIXED, *MODEL])
    paths = f"{dataset} {other}"
    result, _ = timed(
        per_rank(
            f"paths=({paths}); exec {sys.executable} main.py {flags} "
            f"--dataset_path=${{paths[$HOROVOD_RANK]}}"
        )
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    message = "rank 1 differs from rank 0 in model.cardinalities[3] (rank 0: 1000, rank 1: 999)"
    assert message in output, output[-3000:]


def test_an_id_outside_its_table_stops_training_naming_table_file_and_row(
    dataset: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    spec = FeatureSpec.load(bad)
    feature = spec.categorical_features[0]  # cardinality 40, model-parallel here
    path = bad / next(
        chunk.files[0] for chunk in spec.source_spec["train"] if chunk.features == (feature.name,)
    )
    ids = np.fromfile(path, dtype=feature.dtype)
    ids[1500] = 40
    ids.tofile(path)
    result, elapsed = timed(
        main_py_command(2, f"--dataset_path={bad}", *MIXED, *MODEL, "--max_steps=4")
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert (
        f"{path}: table 0 (feature {feature.name!r}) row 1500: expected ids in [0, 40), got 40"
        in output
    ), output[-3000:]
    assert elapsed < FAILURE_LIMIT_S + 60  # start-up included


def test_a_rank_failing_to_save_or_restore_stops_every_rank(dataset: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    flags = [
        f"--dataset_path={dataset}",
        *MIXED,
        *[f for f in MODEL if not f.startswith("--evals_per_epoch")],
        "--evals_per_epoch=2",
        f"--save_checkpoint_path={run_dir}",
    ]
    script = "harness/scripts/fail_on_rank.py"
    # Rank 1's disk fills up while writing the second checkpoint.
    result, elapsed = timed(on_ranks(2, [sys.executable, script, "1", "save", "1", *flags]))
    output = result.stdout + result.stderr
    assert result.returncode != 0
    steps = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("step_"))
    assert len(steps) == 1, steps  # the first checkpoint, published before the failure
    second = "failed on rank 1: OSError: [Errno 28] No space left on device (injected)"
    assert second in output, output[-3000:]  # rank 0 stops with rank 1's error
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".partial")]
    Checkpoint(run_dir / steps[0]).verify()  # still whole
    print(f"failed save: every rank exited, run took {elapsed:.1f} s")

    # A file that only rank 1 reads is corrupted: rank 1 finds it (it verifies
    # what it reads), and rank 0 stops too, with rank 1's message.
    checkpoint = Checkpoint(run_dir / steps[0])
    shard = next(
        s
        for table in checkpoint.manifest["tables"]
        for s in table["shards"]
        if s.get("rank") == 1 and s.get("kind") != "data_parallel"
    )
    target = checkpoint.path / shard["file"]
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    resume = [
        *flags[:-1],
        f"--save_checkpoint_path={tmp_path / 'resumed'}",
        f"--restore_checkpoint_path={run_dir}",
        f"--sharding_plan={run_dir / 'sharding_plan.json'}",
    ]
    result, elapsed = timed(main_py_command(2, *resume))
    output = result.stdout + result.stderr
    assert result.returncode != 0
    message = f"failed on rank 1: CheckpointError: {target}: corrupted"
    assert message in output, output[-3000:]
    print(f"corrupted shard: every rank exited, run took {elapsed:.1f} s")
