"""The parallelism invariant under real `horovodrun --gloo -np 2` processes:
training with 2 ranks gives the weights of 1 rank on the same global batches,
for every way of placing tables, both input modes and every optimizer, and with
`--amp` (bfloat16 on CPU) and `--xla` on a mixed plan."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

from dataloading.synthetic import generate_split_binary
from tests.integration.conftest import horovodrun, run

CARDINALITIES = (23, 7, 300, 11, 5, 40, 9, 64)
HOTNESS = (1, 2, 1, 1, 3, 1, 1, 1)
KINDS = ("data_parallel", "table_wise", "column_wise", "row_wise", "mixed")
INPUT_MODES = ("model_parallel", "data_parallel")
OPTIMIZERS = ("sgd", "adagrad", "adam")
# Precision and compilation variants, on the mixed plan: (optimizer, variant).
VARIANTS = (("adagrad", "amp"), ("adam", "xla"))
# bfloat16 rounds to 8 bits of mantissa; the ranks' partial sums round differently.
TOLERANCE = {"fp32": {"rtol": 1e-5, "atol": 1e-6}, "xla": {"rtol": 1e-5, "atol": 1e-6}}
TOLERANCE["amp"] = {"rtol": 2e-2, "atol": 2e-3}
STEPS, GLOBAL_BATCH = "5", "64"
SCRIPT = "tests/integration/scripts/hybrid_steps.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hybrid")
    dataset = root / "data"
    generate_split_binary(dataset, CARDINALITIES, 3, rows={"train": 2000}, hotness=HOTNESS, seed=4)
    references = [f"local:model_parallel:{o}:fp32" for o in OPTIMIZERS]
    references += [f"local:model_parallel:{o}:{v}" for o, v in VARIANTS]
    one = run(
        [sys.executable, SCRIPT, str(dataset), str(root), STEPS, GLOBAL_BATCH, *references],
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    runs = [":".join((*c, "fp32")) for c in itertools.product(KINDS, INPUT_MODES, OPTIMIZERS)]
    runs += [f"mixed:{m}:{o}:{v}" for m in INPUT_MODES for o, v in VARIANTS]
    two = run(
        [
            horovodrun(),
            "--gloo",
            "-np",
            "2",
            "-H",
            "localhost:2",
            sys.executable,
            SCRIPT,
            str(dataset),
            str(root),
            STEPS,
            GLOBAL_BATCH,
            *runs,
        ],
        timeout=600,
    )
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    return root


def load(directory: Path, rank: int) -> dict[str, np.ndarray]:
    with np.load(directory / f"rank{rank}.npz") as data:
        return dict(data)


CASES = [(*c, "fp32") for c in itertools.product(KINDS, INPUT_MODES, OPTIMIZERS)]
CASES += [("mixed", m, o, v) for m in INPUT_MODES for o, v in VARIANTS]


@pytest.mark.parametrize(("kind", "input_mode", "optimizer", "variant"), CASES)
def test_two_ranks_equal_one(
    results: Path, kind: str, input_mode: str, optimizer: str, variant: str
) -> None:
    tolerance = TOLERANCE[variant]
    reference = load(results / f"local_model_parallel_{optimizer}_{variant}", 0)
    ranks = [load(results / f"{kind}_{input_mode}_{optimizer}_{variant}", r) for r in range(2)]
    tables = {
        key.split("_")[1]: value for key, value in reference.items() if key.startswith("table_")
    }
    # Per-rank losses are each rank's share of the global mean: they add up to it.
    np.testing.assert_allclose(
        ranks[0]["losses"] + ranks[1]["losses"], reference["losses"], rtol=tolerance["rtol"]
    )
    assert reference["losses"][-1] < reference["losses"][0]  # it trained
    dense = [k for k in reference if not k.startswith("table_") and k != "losses"]
    for name in dense:
        for r in range(2):  # replicated: identical on both ranks, equal to one rank's
            np.testing.assert_allclose(ranks[r][name], reference[name], **tolerance)
    covered = {t: np.zeros(v.shape, int) for t, v in tables.items()}
    for values in ranks:
        for key, shard in values.items():
            if not key.startswith("table_"):
                continue
            t, r0, r1, c0, c1 = key.split("_")[1:]
            r0, r1, c0, c1 = int(r0), int(r1), int(c0), int(c1)
            np.testing.assert_allclose(shard, tables[t][r0:r1, c0:c1], **tolerance)
            covered[t][r0:r1, c0:c1] += 1
    expected_copies = 2 if kind == "data_parallel" else None
    for t, count in covered.items():
        assert count.min() >= 1, f"table {t} not fully held by the ranks"
        if expected_copies:
            assert (count == expected_copies).all()
