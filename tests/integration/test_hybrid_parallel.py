"""The parallelism invariant under real `horovodrun --gloo` processes: training
with N ranks gives the weights of 1 rank on the same global batches.

With 2 ranks: every way of placing tables, on both input modes, and every
optimizer on the mixed plan, which holds tables of all four kinds (so every kind
meets every optimizer; the uniform plans' cases, such as no alltoall at all, do not
depend on the optimizer and run with Adam); and on a mixed plan `--amp` (bfloat16
on CPU), `--xla`, and the DCNv2 cross interaction with tables of unequal widths (in
fp32 and `--amp`), and the dense part compiled and run in chunks of a rank's rows.
With 2, 3 and 4 ranks: the plans that once hung or could not be built: a rank with no
model-parallel shard (and, with one table, no ids to read at all), no
model-parallel table at all, a rank holding only row ranges, the planner's own
plan of a single table (sliced so that every rank has a share), on both input
modes (3 and 4 ranks take turns: each runs every plan on one input mode).
Replicated tables' gradients go both ways (dense allreduce for the smallest, sparse
allgather for the others). And a dataset stored with int64
ids, on a mixed plan, both input modes.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

from dataloading.synthetic import generate_split_binary
from feature_spec import FeatureSpec
from tests.harness.processes import horovodrun, run

CARDINALITIES = (23, 7, 300, 11, 5, 40, 9, 64)
HOTNESS = (1, 2, 1, 1, 3, 1, 1, 1)
ONE_TABLE = (300,)
KINDS = ("data_parallel", "table_wise", "column_wise", "row_wise", "mixed")
INPUT_MODES = ("model_parallel", "data_parallel")
OPTIMIZERS = ("sgd", "adagrad", "adam")
# Precision and compilation variants, on the mixed plan: (optimizer, variant).
VARIANTS = (
    ("adagrad", "amp"),
    ("adam", "xla"),
    ("sgd", "cross"),
    ("adagrad", "cross+amp"),
    ("sgd", "xla+chunks"),
)
# Plans that must train on any number of ranks (see the module docstring).
HARD_PLANS = ("idle_rank", "row_wise_rank", "planner", "data_parallel")
ONE_TABLE_PLANS = ("idle_rank", "planner")
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
STEPS, GLOBAL_BATCH = "5", "96"  # 96 divides by 2, 3 and 4 ranks
SCRIPT = "tests/integration/scripts/hybrid_steps.py"
REFERENCES = [f"local:model_parallel:{o}:fp32" for o in OPTIMIZERS] + [
    f"local:model_parallel:{o}:{v}" for o, v in VARIANTS
]


def fp32_cases() -> list[tuple[str, str, str, str]]:
    """(kind, input mode, optimizer, "fp32"): every kind on both input modes with
    Adam, and the mixed plan with every optimizer."""
    cases = [(k, m, "adam", "fp32") for k, m in itertools.product(KINDS, INPUT_MODES)]
    others = [o for o in OPTIMIZERS if o != "adam"]
    return cases + [("mixed", m, o, "fp32") for m, o in itertools.product(INPUT_MODES, others)]


def two_rank_runs() -> list[str]:
    runs = [":".join(case) for case in fp32_cases()]
    runs += [f"mixed:{m}:{o}:{v}" for m in INPUT_MODES for o, v in VARIANTS]
    return runs + hard_runs()


def hard_runs() -> list[str]:
    return [f"{k}:{m}:adam:fp32" for k in HARD_PLANS for m in INPUT_MODES if k != "data_parallel"]


def larger_world_runs() -> list[str]:
    """The tables' runs on 3 and 4 ranks: the hard plans and the mixed plan, each on
    both input modes (in pairs)."""
    plans = [(k, "adam") for k in HARD_PLANS] + [("mixed", "adagrad")]
    return [f"{k}:{m}:{o}:fp32" for k, o in plans for m in INPUT_MODES]


def one_table_runs() -> list[str]:
    return [f"{k}:{m}:adam:fp32" for k in ONE_TABLE_PLANS for m in INPUT_MODES]


LARGER_WORLDS = (3, 4)


def share_of(runs: list[str], ranks: int) -> list[str]:
    """What a world of `ranks` > 2 ranks runs of `runs` (each plan on both input modes,
    in pairs): each plan once, the input modes taken in turn, the other world the
    other half. So every plan runs on both input modes, each on a world of more than 2
    ranks. (On 2 cores, 3 and 4 ranks running everything took half the file's time.)"""
    turn = LARGER_WORLDS.index(ranks)
    return [run for j, run in enumerate(runs) if (j // 2 + j % 2) % 2 == turn]


def hybrid_steps(ranks: int, dataset: Path, out: Path, runs: list[str]) -> None:
    command = [sys.executable, SCRIPT, str(dataset), str(out), STEPS, GLOBAL_BATCH, *runs]
    if ranks > 1:
        command = [horovodrun(), "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", *command]
    result = run(command, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    tables, one = root / "tables", root / "one_table"
    generate_split_binary(tables, CARDINALITIES, 3, rows={"train": 2000}, hotness=HOTNESS, seed=4)
    generate_split_binary(one, ONE_TABLE, 3, rows={"train": 2000}, seed=4)
    for dataset in (tables, one):
        hybrid_steps(1, dataset, dataset / "out_1", REFERENCES)
    return {"tables": tables, "one_table": one}


@pytest.fixture(scope="module")
def two_ranks(datasets: dict[str, Path]) -> Path:
    out = datasets["tables"] / "out_2"
    hybrid_steps(2, datasets["tables"], out, two_rank_runs())
    return out


@pytest.fixture(scope="module", params=[2, 3, 4])
def many_ranks(request: pytest.FixtureRequest, datasets: dict[str, Path]) -> tuple[int, Path]:
    """The hard plans on `ranks` ranks, both datasets (runs for 2 ranks include
    only the one-table ones: the others are in `two_ranks`; 3 and 4 ranks share
    them, `share_of`)."""
    ranks = int(request.param)
    for dataset, runs in runs_on(ranks).items():
        hybrid_steps(ranks, datasets[dataset], datasets[dataset] / f"out_{ranks}", runs)
    return ranks, datasets["tables"].parent


def runs_on(ranks: int) -> dict[str, list[str]]:
    """`many_ranks`' runs on `ranks` ranks, by dataset."""
    if ranks == 2:
        return {"one_table": one_table_runs()}
    return {
        "tables": share_of(larger_world_runs(), ranks),
        "one_table": share_of(one_table_runs(), ranks),
    }


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


CASES = fp32_cases()
CASES += [("mixed", m, o, v) for m in INPUT_MODES for o, v in VARIANTS]


@pytest.mark.parametrize(("kind", "input_mode", "optimizer", "variant"), CASES)
def test_two_ranks_equal_one(
    datasets: dict[str, Path],
    two_ranks: Path,
    kind: str,
    input_mode: str,
    optimizer: str,
    variant: str,
) -> None:
    reference = datasets["tables"] / "out_1" / f"local_model_parallel_{optimizer}_{variant}"
    run_dir = two_ranks / f"{kind}_{input_mode}_{optimizer}_{variant}"
    assert_ranks_equal_one(reference, run_dir, 2, variant, kind)
    if "cross" in variant:  # the cross layers trained, over tables of unequal widths
        weights = load(reference, 0)
        assert any(k.startswith("cross_interaction/") for k in weights), sorted(weights)
        widths = {v.shape[1] for k, v in weights.items() if k.startswith("table_")}
        assert widths == {4, 6, 8}


def test_every_plan_trains_on_any_number_of_ranks(
    datasets: dict[str, Path], two_ranks: Path, many_ranks: tuple[int, Path]
) -> None:
    ranks, _ = many_ranks
    checked = []
    for name, dataset in datasets.items():
        out = dataset / f"out_{ranks}"
        for run_dir in sorted(p for p in out.iterdir() if p.is_dir()):
            kind, _, optimizer, variant = run_dir.name.rsplit("_", 3)
            kind = kind.removesuffix("_model").removesuffix("_data")
            reference = dataset / "out_1" / f"local_model_parallel_{optimizer}_{variant}"
            assert_ranks_equal_one(reference, run_dir, ranks, variant, kind)
            checked.append(f"{name}/{run_dir.name}")
    expected = [f"{d}/{r.replace(':', '_')}" for d, runs in runs_on(ranks).items() for r in runs]
    if ranks == 2:
        expected += [f"tables/{r.replace(':', '_')}" for r in two_rank_runs()]
    assert sorted(checked) == sorted(expected)


@pytest.fixture(scope="module")
def wide_ids(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tables of `datasets`, their ids stored as int64 (as tables of more
    than 2^31 rows need), with a 1-rank reference."""
    path = tmp_path_factory.mktemp("hybrid") / "wide_ids"
    generate_split_binary(
        path, CARDINALITIES, 3, rows={"train": 2000}, hotness=HOTNESS, seed=4, id_dtype="int64"
    )
    hybrid_steps(1, path, path / "out_1", ["local:model_parallel:adam:fp32"])
    return path


def test_int64_ids_on_two_ranks_equal_one(wide_ids: Path) -> None:
    runs = [f"mixed:{m}:adam:fp32" for m in INPUT_MODES]
    hybrid_steps(2, wide_ids, wide_ids / "out_2", runs)
    spec = FeatureSpec.load(wide_ids / "feature_spec.yaml")
    assert {f.dtype for f in spec.categorical_features} == {"int64"}
    reference = wide_ids / "out_1" / "local_model_parallel_adam_fp32"
    for mode in INPUT_MODES:
        run_dir = wide_ids / "out_2" / f"mixed_{mode}_adam_fp32"
        assert_ranks_equal_one(reference, run_dir, 2, "fp32", "mixed")


# Tables 1 to 4 hold a variable number of ids per row (0 to 5, empty rows too):
# on the mixed plan, one of each sharding kind.
VARIABLE_HOTNESS = (1, 0, 0, 0, 0, 1, 2, 1)


@pytest.fixture(scope="module")
def variable_length(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tables with variable-length rows, with 1-rank references pooled by mean."""
    path = tmp_path_factory.mktemp("hybrid") / "variable_length"
    generate_split_binary(
        path,
        CARDINALITIES,
        3,
        rows={"train": 2000},
        hotness=VARIABLE_HOTNESS,
        max_variable_hotness=5,
        seed=4,
    )
    hybrid_steps(
        1, path, path / "out_1", [f"local:model_parallel:{o}:mean" for o in ("sgd", "adam")]
    )
    return path


def test_variable_length_mean_pooling_on_two_ranks_equal_one(variable_length: Path) -> None:
    """Ragged ids through the loader, the id alltoalls (lengths, then ids) and
    every sharding kind (the mixed plan places the variable-length tables 1-4
    table-, column-, row-wise and replicated), in both input modes: the weights
    of one process."""
    runs = [f"mixed:{m}:sgd:mean" for m in INPUT_MODES] + ["row_wise:data_parallel:adam:mean"]
    hybrid_steps(2, variable_length, variable_length / "out_2", runs)
    spec = FeatureSpec.load(variable_length / "feature_spec.yaml")
    assert [f.is_variable_length for f in spec.categorical_features] == [
        h == 0 for h in VARIABLE_HOTNESS
    ]
    for run_name in runs:
        kind, _mode, optimizer, variant = run_name.split(":")
        reference = variable_length / "out_1" / f"local_model_parallel_{optimizer}_mean"
        run_dir = variable_length / "out_2" / run_name.replace(":", "_")
        assert_ranks_equal_one(reference, run_dir, 2, variant, kind)
