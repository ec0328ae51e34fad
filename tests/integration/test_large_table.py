"""A table of more than 2^31 rows trains, checkpoints and restores in one process.

One categorical feature of 2^31 + 16 rows, width 1 (8 GiB of float32), SGD, ids
written by the test around 2^31 (the synthetic generator's power law never
draws them). The run (`scripts/large_table.py`, a child process so that its
memory is freed and its peak is its own) is compared with the same model on a
32-row table holding the looked-up rows: same rows, same updates.

About 2 minutes and 10 GiB of memory, and 8 GiB of disk for the checkpoint
(deleted at the end); skipped, saying so, on a machine without them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dataloading.synthetic import generate_split_binary
from harness.processes import run
from harness.scripts.large_table import BATCH, REFERENCE_ROWS

ROWS = 2**31 + 16
STEPS = 3
GIB = 2**30
NEEDS_MEMORY = 11 * GIB
NEEDS_DISK = 9 * GIB
# Ids of each batch: at and around 2^31 (the last row too), below it, and small
# ones; some repeated within a batch (their gradients add up).
IDS = [
    2**31 + 3, 2**31 - 1, 2**31 + 15, 0, 2**31, 5, 2**31 + 3, 1,
    2**31 - 2, 2**31 + 3, 2**31 + 15, 7, 0, 2**31 + 8, 2**31 - 1, 2**30,
]  # fmt: skip


def missing_resources(root: Path) -> str | None:
    """Why this machine cannot run the test, if it cannot."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    if available < NEEDS_MEMORY:
        return f"needs {NEEDS_MEMORY / GIB:.0f} GiB of memory, {available / GIB:.1f} GiB available"
    free = shutil.disk_usage(root).free
    if free < NEEDS_DISK:
        return f"needs {NEEDS_DISK / GIB:.0f} GiB of disk under {root}, {free / GIB:.1f} GiB free"
    return None


def write_datasets(root: Path) -> tuple[Path, Path]:
    """The large table's dataset with `IDS` in every batch, and the reference's
    FeatureSpec (its batches are the large one's, with ids remapped)."""
    large = root / "large"
    spec = generate_split_binary(
        large, (ROWS,), 2, rows={"train": STEPS * BATCH, "test": BATCH}, seed=5, id_dtype="int64"
    )
    (path,) = spec.files("train").categorical.values()
    ids = np.array(IDS * STEPS, np.int64)
    assert path.stat().st_size == ids.nbytes
    path.write_bytes(ids.tobytes())
    reference = root / "reference"
    generate_split_binary(
        reference, (REFERENCE_ROWS,), 2, rows={"train": BATCH, "test": BATCH}, seed=5
    )
    return large, reference


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("large_table")
    reason = missing_resources(root)
    if reason is not None:
        pytest.skip(reason)
    large, reference = write_datasets(root)
    checkpoints = root / "checkpoints"
    try:
        completed = run(
            [
                sys.executable,
                "harness/scripts/large_table.py",
                str(large),
                str(reference),
                str(checkpoints),
                str(STEPS),
            ],
            timeout=900,
        )
    finally:
        shutil.rmtree(checkpoints, ignore_errors=True)
    assert completed.returncode == 0, completed.stderr[-5000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_the_table_has_more_than_2_31_rows_and_int64_ids_reach_it(result: Any) -> None:
    assert result["rows"] == ROWS and result["variable_shape"] == [ROWS, 1]
    assert result["id_dtype"] == "int64"
    assert result["looked_up_ids"] == sorted(set(IDS))
    assert max(result["looked_up_ids"]) == ROWS - 1


def test_looked_up_rows_get_the_updates_of_the_small_reference(result: Any) -> None:
    """Same rows, same updates: the rows looked up (those >= 2^31 included) end
    where the 32-row table's do, and the losses and dense weights agree."""
    initial = np.array(result["initial"]["looked_up"])
    np.testing.assert_array_equal(initial, result["expected_initial"]["looked_up"])
    trained = np.array(result["trained"]["looked_up"])
    np.testing.assert_allclose(trained, result["reference_trained"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(result["losses"], result["reference_losses"], rtol=1e-6)
    assert result["dense_difference"] <= 1e-6
    high = [i for i, row in enumerate(result["looked_up_ids"]) if row >= 2**31]
    assert len(high) == 4
    assert all(trained[i] != initial[i] for i in high), (trained, initial)


def test_rows_not_looked_up_keep_their_initial_values(result: Any) -> None:
    assert max(result["untouched_ids"]) > 2**31
    for values in (result["initial"], result["trained"], result["restored"], result["in_file"]):
        np.testing.assert_array_equal(values["untouched"], result["expected_initial"]["untouched"])


def test_checkpoint_holds_and_restores_the_trained_rows(result: Any) -> None:
    assert result["manifest_shape"] == [ROWS, 1]
    (values,) = [
        entry for name, entry in result["checkpoint_files"].items() if name.endswith(".npy")
    ]
    assert values["bytes"] == ROWS * 4 + 128  # the .npy header, then the rows
    np.testing.assert_array_equal(result["in_file"]["looked_up"], result["trained"]["looked_up"])
    assert set(result["clobbered"]) == {9.0}
    np.testing.assert_array_equal(result["restored"]["looked_up"], result["trained"]["looked_up"])
    assert result["restored_step"] == STEPS
    assert result["last_rows"]["read_rows"] == result["last_rows"]["gather"]


def test_memory_stays_one_table_plus_the_runtime(result: Any) -> None:
    """No phase holds a second copy of the 8 GiB table: creating it fills it in
    chunks, sparse updates leave it in place, saving and restoring stream it."""
    table = result["table_bytes"]
    runtime = result["phases"]["start"]["peak_rss_bytes"]
    for name, phase in result["phases"].items():
        assert phase["peak_rss_bytes"] < table + runtime + 1.5 * GIB, (name, phase)
    assert result["seconds"] < 600
