"""The GPU code path on CPUs (`DLRM_GPU_PATH_ON_CPU=1`) under `horovodrun --gloo`:
float16 with loss scaling on 2 and 3 ranks trains as one process does, ranks
that resolve different code paths stop before the first step, and an overflow
skips the step on every rank, with the loss scale carried across `--resume`."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from dlrm.checkpoint.reader import Checkpoint
from dlrm.distributed.devices import GPU_PATH_ON_CPU_ENV
from dlrm.train.precision import INITIAL_LOSS_SCALE_ENV
from dlrm.train.state import LOSS_SCALE_KEYS, SKIPPED_STEPS_KEY, STEP_KEY
from harness.checkpoints import assert_close, checkpoint_arrays
from harness.datasets import dataset_fixture
from harness.models import EIGHT_TABLES, MIXED_PLAN_FLAGS
from harness.processes import main_py, on_ranks, output_tail, run

BATCH = 768  # divides by 2 and by 3
STEPS = 5
LEARNING_RATE = 0.05  # MIXED_PLAN_FLAGS's (Adagrad)
dataset = dataset_fixture(EIGHT_TABLES, 5, {"train": (STEPS + 1) * BATCH, "test": BATCH}, seed=3)
GPU_PATH = {GPU_PATH_ON_CPU_ENV: "1"}
FLAGS = [*MIXED_PLAN_FLAGS, f"--batch_size={BATCH}", f"--learning_rate={LEARNING_RATE}", "--amp"]

# float16 keeps 11 significant bits: a rounding errs by at most u = 2^-11 of the
# value. Across world sizes the same float16 products are summed in other groups
# (each rank's rows in float16, then over the ranks in float32, against all rows
# in float16 at once), so a step's gradient element differs by up to about 2u of
# itself (a float16 rounding on each side). Adagrad's update, lr * g /
# sqrt(accumulator), is at most lr in size (the accumulator holds g^2 and more), so
# it differs by at most 2u * lr a step, and the weights after S steps by S * 2u * lr
# (to first order: the weights' own differences move the next gradients by far
# less); the accumulators, 0.1 + sum g^2, by 4u of themselves. With lr 0.05 and 5
# steps: atol 2.4e-4, rtol 2e-3. Measured on an AVX2 CPU: at most 1.2e-5 apart on
# 2 ranks, 1.6e-5 on 3. A lost or repeated step moves the weights that the batches
# touch by a whole update, of order lr * 0.3.
FLOAT16_UNIT_ROUNDOFF = 2.0**-11
FLOAT16_CROSS_WORLD = {
    "rtol": 4 * FLOAT16_UNIT_ROUNDOFF,
    "atol": STEPS * 2 * FLOAT16_UNIT_ROUNDOFF * LEARNING_RATE,
}


def train(ranks: int, directory: Path, *flags: str, env: dict[str, str] | None = None) -> None:
    """main.py of `FLAGS` then `flags` on `ranks` ranks, each on the GPU code path
    (and `env`), checkpoints in `directory`; it must succeed."""
    main_py(
        ranks,
        *FLAGS,
        *flags,
        f"--save_checkpoint_path={directory}",
        env={**GPU_PATH, **(env or {})},
        timeout=240,
        check=True,
    )


@pytest.fixture(scope="module")
def one_process(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """The float16 checkpoint of one process after `STEPS` steps."""
    directory = tmp_path_factory.mktemp("one")
    train(1, directory, f"--dataset_path={dataset}", f"--max_steps={STEPS}")
    return Checkpoint(directory / f"step_{STEPS:09d}")


@pytest.mark.parametrize("ranks", [2, 3])
def test_float16_on_n_ranks_trains_as_one_process(
    dataset: Path, tmp_path: Path, one_process: Checkpoint, ranks: int
) -> None:
    train(ranks, tmp_path, f"--dataset_path={dataset}", f"--max_steps={STEPS}")
    written = Checkpoint(tmp_path / f"step_{STEPS:09d}")
    assert written.manifest["precision"] == one_process.manifest["precision"] == "mixed_float16"
    assert written.manifest["world_size"] == ranks
    dense = written.dense()
    assert float(dense[LOSS_SCALE_KEYS[0]]) == 2.0**15  # no overflow: the scale as it started
    assert int(dense[LOSS_SCALE_KEYS[1]]) == STEPS
    assert_close(written, one_process, **FLOAT16_CROSS_WORLD)


def test_ranks_on_different_code_paths_stop_before_the_first_step(dataset: Path) -> None:
    """Rank 1 alone on the GPU code path: without comparing what the ranks resolved,
    rank 0 sent bfloat16 vectors where rank 1 expected float16 (Horovod: "Mismatched
    data types"), after both had built their models."""
    rank_1_on_the_gpu_path = (
        f'if [ "$HOROVOD_RANK" = 1 ]; then export {GPU_PATH_ON_CPU_ENV}=1; fi; '
        f'exec {shlex.quote(sys.executable)} main.py "$@"'
    )
    command = ["bash", "-c", rank_1_on_the_gpu_path, "main.py", *FLAGS]
    result = run(
        on_ranks(2, [*command, f"--dataset_path={dataset}", f"--max_steps={STEPS}"]),
        timeout=120,
        env={GPU_PATH_ON_CPU_ENV: None},
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output_tail(result)
    expected = (
        "rank 1 differs from rank 0 in resolved.code_path (rank 0: 'cpu', rank 1: 'gpu, "
        "emulated on a CPU (DLRM_GPU_PATH_ON_CPU=1)')"
    )
    assert expected in output, output_tail(result)
    assert "resolved.dtype_policy ('mixed_bfloat16' against 'mixed_float16')" in output
    assert "Mismatched data types" not in output


@pytest.mark.parametrize("ranks", [2, 3])
def test_an_overflow_skips_the_step_on_every_rank_and_resume_keeps_the_loss_scale(
    dataset: Path, tmp_path: Path, ranks: int
) -> None:
    """From a loss scale of 2^60 every gradient overflows float16 for dozens of
    halvings: every step is skipped, on every rank (no table shard, no accumulator
    moves), and the scale halves each step. The resumed run continues from the
    checkpoint's scale and count of skipped steps, not from 2^15 (which would train)."""
    data = f"--dataset_path={dataset}"
    train(ranks, tmp_path, data, "--max_steps=2", env={INITIAL_LOSS_SCALE_ENV: str(2.0**60)})
    first = Checkpoint(tmp_path / "step_000000002")
    dense = first.dense()
    assert float(dense[LOSS_SCALE_KEYS[0]]) == 2.0**58
    assert (int(dense[LOSS_SCALE_KEYS[1]]), int(dense[SKIPPED_STEPS_KEY])) == (0, 2)
    arrays = checkpoint_arrays(first)
    accumulators = [value for name, value in arrays.items() if name.endswith("accumulator")]
    assert len(accumulators) == 2 * 4 + 8  # every dense weight's and every table's
    assert all(np.all(value == np.float32(0.1)) for value in accumulators)  # never updated
    assert int(arrays["optimizer/iterations"]) == 0

    train(ranks, tmp_path, data, f"--max_steps={STEPS}", "--resume")
    last = Checkpoint(tmp_path / f"step_{STEPS:09d}")
    dense = last.dense()
    assert float(dense[LOSS_SCALE_KEYS[0]]) == 2.0**60 / 2**STEPS
    assert (int(dense[LOSS_SCALE_KEYS[1]]), int(dense[SKIPPED_STEPS_KEY])) == (0, STEPS)
    moved = {STEP_KEY, *LOSS_SCALE_KEYS, SKIPPED_STEPS_KEY}
    for name, value in checkpoint_arrays(last).items():
        if name not in moved:
            np.testing.assert_array_equal(value, arrays[name], err_msg=name)
