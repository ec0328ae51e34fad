"""Two runs' checkpoints compared, by the rule of docs/testing.md ("Comparing two
runs"):

- runs of the same world size, whatever stopped and resumed them, are equal bit
  for bit (`assert_identical`): the same sums in the same order;
- runs of different world sizes add the ranks' partial sums in another order, so
  they agree to rounding (`assert_close` with `CROSS_WORLD`) for a bounded number
  of steps (`CROSS_WORLD_STEPS`), the derivation below.

And which steps a checkpoint directory holds (`checkpoint_steps`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dlrm.checkpoint.format import list_checkpoints
from dlrm.checkpoint.reader import Checkpoint

# 1 process against 2 ranks, `models.MIXED_PLAN_FLAGS` (Adagrad 0.05, widths 8,
# MLPs 32-8 and 32-1), 12 runs of 300 steps (seeds 1-6, batches 768 and 1024) on an
# AVX2 CPU: until a ReLU input within rounding of zero switched sides, every weight
# and table row stayed within 3 % of this tolerance (at most 6e-7 apart). The first
# switch came at step 130 at the earliest (5 runs of 12 had one by step 300); the
# gap then grows to 1e-3 within 50 steps, past any tolerance that would still catch
# a lost or repeated step (a switch is one sample's gradient for one unit: 1-2 % of
# a step at once). So a comparison across world sizes trains at most
# `CROSS_WORLD_STEPS` steps from the first one on which the two runs' worlds
# differ, a fifth of that earliest switch. About 1.6e-3 switches a step were seen
# (5 in 3,100 steps before each run's first), so a comparison of 20 steps has about
# a 3 % chance of one on a given CPU (the suite holds four that long; being
# deterministic, each passes or fails on a CPU kind every time).
CROSS_WORLD = {"rtol": 2e-5, "atol": 1e-6}
CROSS_WORLD_STEPS = 20


def checkpoint_steps(directory: Path) -> list[int]:
    """The steps of the checkpoints published in `directory`, oldest first (read
    from their names: one may be deleted by the time it would be opened)."""
    return [int(path.name.removeprefix("step_")) for path in list_checkpoints(directory)]


def checkpoint_arrays(checkpoint: Checkpoint) -> dict[str, np.ndarray]:
    """Everything `checkpoint` holds, by name: the dense weights and optimizer
    state, and each table whole with each of its optimizer slots."""
    arrays = dict(checkpoint.dense())
    for table, stored in sorted(checkpoint.tables.items()):
        rows, columns = stored.shape
        slots = sorted({slot for shard in stored.shards for slot in shard.slots})
        for slot in [None, *slots]:
            arrays[f"table {table} {slot or 'weights'}"] = checkpoint.read_table_slice(
                table, (0, rows), (0, columns), slot
            )
    return arrays


def assert_identical(actual: Checkpoint, expected: Checkpoint) -> None:
    """The same arrays, bit for bit, at the same step."""
    assert actual.step == expected.step, (actual.path, expected.path)
    ours, theirs = checkpoint_arrays(actual), checkpoint_arrays(expected)
    assert sorted(ours) == sorted(theirs), (actual.path, expected.path)
    for name, value in theirs.items():
        difference = np.abs(ours[name].astype(np.float64) - value.astype(np.float64))
        assert np.array_equal(ours[name], value), (
            f"{name}: {actual.path} differs from {expected.path} by up to "
            f"{float(difference.max()):.3g} (same world size: expected equal)"
        )


def assert_close(actual: Checkpoint, expected: Checkpoint, rtol: float, atol: float) -> None:
    """The same arrays within `rtol` and `atol`, element by element, at the same step."""
    assert actual.step == expected.step, (actual.path, expected.path)
    ours, theirs = checkpoint_arrays(actual), checkpoint_arrays(expected)
    assert sorted(ours) == sorted(theirs), (actual.path, expected.path)
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=rtol, atol=atol, err_msg=name)
