"""docs/troubleshooting.md's table of the messages a user meets in a first week
quotes what the tools print: each message is produced here, the way a user meets
it, and every quote must be in one of them (and every one of them quoted)."""

from __future__ import annotations

import io
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import numpy as np
import pytest

from dataloading.errors import DatasetError
from dataloading.split_binary import ShardSpec, SplitBinaryDataset
from dlrm.app.assembly import assemble_run, model_config_for
from dlrm.app.cli import preempted_message
from dlrm.app.config import ConfigError, RunConfig, check_world_size
from dlrm.app.modes.training import NothingToTrainError, train
from dlrm.app.reporting import MetricsLog
from dlrm.app.sharding import plan_for
from dlrm.checkpoint.format import CheckpointError
from dlrm.checkpoint.model_state import check_model_matches
from dlrm.checkpoint.reader import Checkpoint
from dlrm.distributed.agreement import RankMismatchError, check_ranks_agree
from dlrm.distributed.collectives import Collectives
from dlrm.embedding.planner.types import PlanError
from dlrm.train.precision import Precision, bfloat16_note
from dlrm.train.trainer import NonFiniteLossError
from feature_spec import FeatureSpec
from harness.datasets import dataset_fixture
from preproc.spark import SparkSettings, _ui_line

DOC = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
ROWS, BATCH = 512, 64


def quoted_messages() -> list[str]:
    """The first cell's quotes of each row of the "first week" table."""
    text = DOC.read_text().split("## Your first week", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    return [quote for row in rows for quote in re.findall(r"`([^`]+)`", row.split(" | ")[0])]


dataset = dataset_fixture((23, 7, 11), 2, {"train": ROWS, "test": 64}, seed=2)


def config(dataset: Path, **overrides: object) -> RunConfig:
    values: dict = {
        "dataset_path": str(dataset),
        "batch_size": BATCH,
        "embedding_dim": 4,
        "bottom_mlp_dims": (8, 4),
        "top_mlp_dims": (8, 1),
        "warmup_steps": 0,
        "decay_start_step": 0,
        "learning_rate": 0.1,
        "evals_per_epoch": 0,
    }
    return RunConfig(**{**values, **overrides})


def run_of(dataset: Path, console: TextIO | None = None, **overrides: object) -> dict:
    log = MetricsLog(None, None, console=console or io.StringIO())
    return train(assemble_run(config(dataset, **overrides), log))


def message_of(action: Callable[[], object], error: type[BaseException]) -> str:
    with pytest.raises(error) as raised:
        action()
    return str(raised.value)


def messages(dataset: Path, tmp_path: Path) -> list[str]:
    """Each message of the table, produced as a user meets it."""
    yesterday = tmp_path / "yesterday"
    run_of(dataset, save_checkpoint_path=str(yesterday), max_steps=6)
    console = io.StringIO()  # where resuming a finished run says so
    run_of(dataset, console, save_checkpoint_path=str(yesterday), resume=True, max_steps=6)
    other_model = {**Checkpoint(yesterday).manifest["model"], "bottom_mlp_dims": [9, 4]}
    spec = FeatureSpec.load(dataset)
    return [
        message_of(lambda: check_world_size(config(dataset, batch_size=65), 2), ConfigError),
        message_of(
            lambda: run_of(dataset, restore_checkpoint_path=str(yesterday), max_steps=4),
            NothingToTrainError,
        ),
        console.getvalue(),
        message_of(
            lambda: check_model_matches(Checkpoint(yesterday), other_model), CheckpointError
        ),
        message_of(lambda: run_of(dataset, batch_size=1024), DatasetError),
        out_of_range_ids(dataset, tmp_path),
        shrunk_file(dataset, tmp_path),
        message_of(
            lambda: plan_for(
                config(dataset, embedding_memory_budget_gib=1e-7),
                model_config_for(spec, config(dataset)),
                spec,
                2,
            ),
            PlanError,
        ),
        str(NonFiniteLossError(7, float("nan"), Precision("float32"), 0.1)),
        preempted_message({"steps": 5, "checkpoint": "run/step_000000005"}),
        message_of(lambda: check_ranks_agree(TwoRanks(), {"plan": "mine"}), RankMismatchError),
        bfloat16_note(float32_gflops=200.0, bfloat16_gflops=100.0),
        _ui_line(SparkSettings(), "http://node1:4040"),
    ]


def out_of_range_ids(dataset: Path, tmp_path: Path) -> str:
    spec = FeatureSpec.load(shutil.copytree(dataset, tmp_path / "bad_ids"))
    path = spec.files("train").categorical["cat_0"]
    ids = np.fromfile(path, dtype=spec.categorical_features[0].dtype)
    ids[3] = 99
    ids.tofile(path)
    data = SplitBinaryDataset(spec, "train", ShardSpec(BATCH))
    return message_of(lambda: data.read_batch(0), DatasetError)


def shrunk_file(dataset: Path, tmp_path: Path) -> str:
    spec = FeatureSpec.load(shutil.copytree(dataset, tmp_path / "shrunk"))
    data = SplitBinaryDataset(spec, "train", ShardSpec(BATCH))
    os.truncate(spec.files("train").label, ROWS // 2)
    return message_of(lambda: data.read_batch(data.num_batches - 1), DatasetError)


class TwoRanks(Collectives):
    """Rank 0 of two, whose rank 1 holds another plan."""

    world_size = 2

    def allgather_object(self, value: object, name: str) -> list[object]:
        return [value, {"plan": "theirs"}]


def test_every_quoted_message_is_one_the_tools_print(dataset: Path, tmp_path: Path) -> None:
    printed = messages(dataset, tmp_path)
    quotes = quoted_messages()
    assert len(quotes) >= len(printed)
    for quote in quotes:
        assert any(quote in message for message in printed), f"no message says {quote!r}"
    for message in printed:
        assert any(quote in message for quote in quotes), f"not in the table: {message!r}"
