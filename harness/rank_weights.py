"""The parallelism invariant under real processes: runs of
harness/scripts/hybrid_steps.py (a few steps of each placement of the
tables, each rank's weights saved) on N ranks give the weights of one process on
the same global batches (`assert_ranks_equal_one`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from harness.processes import on_ranks, run

SCRIPT = "harness/scripts/hybrid_steps.py"
STEPS, GLOBAL_BATCH = "5", "96"  # 96 divides by 2, 3 and 4 ranks
# The tables of the runs' dataset, and their ids per row.
CARDINALITIES = (23, 7, 300, 11, 5, 40, 9, 64)
HOTNESS = (1, 2, 1, 1, 3, 1, 1, 1)
FP32_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# bfloat16 rounds to 8 bits of significand, and the ranks' partial sums round
# differently, so `--amp` runs are compared tensor by tensor: the norm of the
# difference against the norm of the weights. Element by element, a small weight
# can move by more than its own size: on an AVX2 CPU (bfloat16 emulated) a
# 2-rank Adagrad run put one bottom-MLP weight at 0.0405 against 1 rank's 0.0347,
# while the whole tensor differed by 0.4 % (bfloat16 against float32 on 1 rank:
# 0.8 %).
AMP_NORM_RTOL = 2e-2
# Biases start at zero, so their norm is all update, not diluted by initial values,
# and the rounding of their bfloat16 batch sums shows in full: on an AVX-512 BF16 CPU
# both cross-layer biases of a 2-rank Adagrad run differed by 2.5 % from 1 rank's,
# every other tensor by at most 0.3 %.
AMP_BIAS_NORM_RTOL = 5e-2


# Runs of the script on one dataset: (dataset, output directory, runs).
RunGroup = tuple[Path, Path, Sequence[str]]


def hybrid_steps_command(dataset: Path, out: Path, runs: Sequence[str]) -> list[str]:
    """The script's command line: `runs` (KIND:INPUT_MODE:OPTIMIZER[:VARIANT]) on
    `dataset`, their weights written under `out`."""
    return groups_command([(dataset, out, runs)])


def groups_command(groups: Sequence[RunGroup]) -> list[str]:
    """The script's command line for several datasets' runs, trained in turn by the
    same processes."""
    command = [sys.executable, SCRIPT, STEPS, GLOBAL_BATCH]
    for j, (dataset, out, runs) in enumerate(groups):
        command += [*(["--"] if j else []), str(dataset), str(out), *runs]
    return command


def hybrid_steps(ranks: int, dataset: Path, out: Path, runs: Sequence[str]) -> None:
    """Runs the script as `ranks` processes on this host."""
    hybrid_steps_groups(ranks, [(dataset, out, runs)])


def hybrid_steps_groups(ranks: int, groups: Sequence[RunGroup]) -> None:
    """Runs the script on several datasets (`groups_command`) as one launch of `ranks`
    processes on this host."""
    run(on_ranks(ranks, groups_command(groups)), timeout=900, check=True)


def load(directory: Path, rank: int) -> dict[str, np.ndarray]:
    with np.load(directory / f"rank{rank}.npz") as data:
        return dict(data)


def assert_weights_close(
    actual: np.ndarray, desired: np.ndarray, use_norms: bool, name: str
) -> None:
    if not use_norms:
        np.testing.assert_allclose(actual, desired, **FP32_TOLERANCE, err_msg=name)
        return
    difference = float(np.linalg.norm(actual - desired))
    scale = float(np.linalg.norm(desired))
    rtol = AMP_BIAS_NORM_RTOL if name.endswith("/bias") else AMP_NORM_RTOL
    assert difference <= rtol * scale + 1e-6, (
        f"{name}: |actual - desired| = {difference:.3g}, more than {rtol} x "
        f"|desired| = {rtol * scale:.3g}"
    )


def assert_ranks_equal_one(
    reference_dir: Path, run_dir: Path, ranks: int, variant: str, kind: str
) -> None:
    use_norms = "amp" in variant.split("+")
    reference = load(reference_dir, 0)
    per_rank = [load(run_dir, r) for r in range(ranks)]
    tables = {
        key.split("_")[1]: value for key, value in reference.items() if key.startswith("table_")
    }
    # Per-rank losses are each rank's share of the global mean: they add up to it.
    np.testing.assert_allclose(
        sum(r["losses"] for r in per_rank),
        reference["losses"],
        rtol=AMP_NORM_RTOL if use_norms else FP32_TOLERANCE["rtol"],
    )
    assert reference["losses"][-1] < reference["losses"][0]  # it trained
    dense = [k for k in reference if not k.startswith("table_") and k not in ("losses", "hostname")]
    for name in dense:
        for values in per_rank:  # replicated: identical on every rank, equal to one rank's
            assert_weights_close(values[name], reference[name], use_norms, name)
    covered = {t: np.zeros(v.shape, int) for t, v in tables.items()}
    for values in per_rank:
        for key, shard in values.items():
            if not key.startswith("table_"):
                continue  # dense weights, losses, hostname
            t, r0, r1, c0, c1 = key.split("_")[1:]
            r0, r1, c0, c1 = int(r0), int(r1), int(c0), int(c1)
            assert_weights_close(shard, tables[t][r0:r1, c0:c1], use_norms, key)
            covered[t][r0:r1, c0:c1] += 1
    for t, count in covered.items():
        assert count.min() >= 1, f"table {t} not fully held by the ranks"
        if kind == "data_parallel":
            assert (count == ranks).all()
