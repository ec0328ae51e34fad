"""The parallelism invariant under real `horovodrun --gloo` processes: training
with N ranks gives the weights of 1 rank on the same global batches.

With 2 ranks: every way of placing tables, on both input modes, and every
optimizer on the mixed plan, which holds tables of all four kinds (so every kind
meets every optimizer; the uniform plans' cases, such as no alltoall at all, do not
depend on the optimizer and run with Adam); and on a mixed plan `--amp` (bfloat16
on CPU), `--xla`, and the DCNv2 cross interaction with tables of unequal widths (in
fp32 and `--amp`), and the dense part compiled and run in chunks of a rank's rows.
With 2, 3 and 4 ranks: the plans that are easy to get wrong: a rank with no
model-parallel shard (and, with one table, no ids to read at all), no
model-parallel table at all, a rank holding only row ranges, the planner's own
plan of a single table (sliced so that every rank has a share), on both input
modes (3 and 4 ranks take turns: each runs every plan on one input mode).
Replicated tables' gradients go both ways (dense allreduce for the smallest, sparse
allgather for the others). And a dataset stored with int64
ids, on a mixed plan, both input modes; variable-length tables pooled by mean; and
`--optimizer rowwise_adagrad` on plans without column-wise tables, on 2 and 3 ranks.
Every world size is one launch of harness/scripts/hybrid_steps.py, all datasets' runs
in it (a launch's start costs more than most of its runs).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from feature_spec import FeatureSpec
from harness.datasets import synthetic_dataset
from harness.rank_weights import (
    CARDINALITIES,
    HOTNESS,
    assert_ranks_equal_one,
    hybrid_steps_groups,
    load,
)

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


# Tables 1 to 4 hold a variable number of ids per row (0 to 5, empty rows too):
# on the mixed plan, one of each sharding kind.
VARIABLE_HOTNESS = (1, 0, 0, 0, 0, 1, 2, 1)
# Ragged ids through the loader, the id alltoalls (lengths, then ids) and every
# sharding kind (the mixed plan places the variable-length tables 1-4 table-,
# column-, row-wise and replicated), in both input modes.
VARIABLE_LENGTH_RUNS = [f"mixed:{m}:sgd:mean" for m in INPUT_MODES] + [
    "row_wise:data_parallel:adam:mean"
]
INT64_RUNS = [f"mixed:{m}:adam:fp32" for m in INPUT_MODES]
# Row-wise Adagrad's [rows, 1] accumulators: row ranges beside whole tables, and every
# table replicated (its gradient exchanged dense for the smallest tables, sparse for
# the others). No column-wise tables: a column shard keeps its own row accumulators,
# so it trains differently from the whole table (tests/unit/test_rowwise_adagrad.py).
ROWWISE_ADAGRAD_RUNS = {
    2: ["row_wise_rank:model_parallel", "data_parallel:data_parallel"],
    3: ["row_wise_rank:data_parallel"],
}
ROWWISE_ADAGRAD_REFERENCE = "local:model_parallel:rowwise_adagrad:fp32"
# The datasets whose runs `test_every_plan_trains_on_any_number_of_ranks` checks.
PLAN_DATASETS = ("tables", "one_table")


def rowwise_adagrad_runs(ranks: int) -> list[str]:
    return [f"{run}:rowwise_adagrad:fp32" for run in ROWWISE_ADAGRAD_RUNS.get(ranks, [])]


def references() -> dict[str, list[str]]:
    """The 1-process runs that the ranks' runs are compared with, by dataset."""
    return {
        "tables": REFERENCES,
        "one_table": ["local:model_parallel:adam:fp32"],
        "wide_ids": ["local:model_parallel:adam:fp32"],
        "variable_length": [f"local:model_parallel:{o}:mean" for o in ("sgd", "adam")],
        "rowwise_adagrad": [ROWWISE_ADAGRAD_REFERENCE],
    }


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The datasets by name, each with its 1-process references (`out(..., 1)`), all
    trained in one process. `wide_ids`: the tables of `tables`, their ids stored as
    int64 (as tables of more than 2^31 rows need); `variable_length`: tables with
    variable-length rows, pooled by mean; `rowwise_adagrad`: `tables` again (its
    runs in other directories)."""
    rows = {"train": 2000}
    tables = synthetic_dataset(tmp_path_factory, CARDINALITIES, 3, rows, 4, hotness=HOTNESS)
    found = {
        "tables": tables,
        "one_table": synthetic_dataset(tmp_path_factory, ONE_TABLE, 3, rows, 4),
        "wide_ids": synthetic_dataset(
            tmp_path_factory, CARDINALITIES, 3, rows, 4, hotness=HOTNESS, id_dtype="int64"
        ),
        "variable_length": synthetic_dataset(
            tmp_path_factory,
            CARDINALITIES,
            3,
            rows,
            4,
            hotness=VARIABLE_HOTNESS,
            max_variable_hotness=5,
        ),
        "rowwise_adagrad": tables,
    }
    groups = [(found[name], out(found, name, 1), runs) for name, runs in references().items()]
    hybrid_steps_groups(1, groups)
    return found


def out(datasets: dict[str, Path], name: str, ranks: int) -> Path:
    """Where the runs of dataset `name` on `ranks` ranks write their weights."""
    return datasets[name] / f"out_{name}_{ranks}"


@pytest.fixture(scope="module")
def two_ranks(datasets: dict[str, Path]) -> Path:
    """Every run on 2 ranks, of every dataset, in one launch; `tables`' output directory."""
    groups = [(datasets[name], out(datasets, name, 2), runs) for name, runs in runs_on(2).items()]
    hybrid_steps_groups(2, groups)
    return out(datasets, "tables", 2)


@pytest.fixture(scope="module", params=[2, 3, 4])
def many_ranks(request: pytest.FixtureRequest, datasets: dict[str, Path]) -> int:
    """The hard plans on `ranks` ranks (returned), every dataset's runs in one launch
    (those for 2 ranks are in `two_ranks`; 3 and 4 ranks share them, `share_of`)."""
    ranks = int(request.param)
    if ranks == 2:
        request.getfixturevalue("two_ranks")
    else:
        groups = [(datasets[n], out(datasets, n, ranks), r) for n, r in runs_on(ranks).items()]
        hybrid_steps_groups(ranks, groups)
    return ranks


def runs_on(ranks: int) -> dict[str, list[str]]:
    """The runs on `ranks` ranks, by dataset."""
    if ranks == 2:
        return {
            "tables": two_rank_runs(),
            "one_table": one_table_runs(),
            "wide_ids": INT64_RUNS,
            "variable_length": VARIABLE_LENGTH_RUNS,
            "rowwise_adagrad": rowwise_adagrad_runs(2),
        }
    found = {
        "tables": share_of(larger_world_runs(), ranks),
        "one_table": share_of(one_table_runs(), ranks),
        "rowwise_adagrad": rowwise_adagrad_runs(ranks),
    }
    return {name: runs for name, runs in found.items() if runs}


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
    reference = out(datasets, "tables", 1) / f"local_model_parallel_{optimizer}_{variant}"
    run_dir = two_ranks / f"{kind}_{input_mode}_{optimizer}_{variant}"
    assert_ranks_equal_one(reference, run_dir, 2, variant, kind)
    if "cross" in variant:  # the cross layers trained, over tables of unequal widths
        weights = load(reference, 0)
        assert any(k.startswith("cross_interaction/") for k in weights), sorted(weights)
        widths = {v.shape[1] for k, v in weights.items() if k.startswith("table_")}
        assert widths == {4, 6, 8}


def test_every_plan_trains_on_any_number_of_ranks(
    datasets: dict[str, Path], many_ranks: int
) -> None:
    ranks = many_ranks
    checked = []
    for name in PLAN_DATASETS:
        for run_dir in sorted(p for p in out(datasets, name, ranks).iterdir() if p.is_dir()):
            kind, _, optimizer, variant = run_dir.name.rsplit("_", 3)
            kind = kind.removesuffix("_model").removesuffix("_data")
            reference = out(datasets, name, 1) / f"local_model_parallel_{optimizer}_{variant}"
            assert_ranks_equal_one(reference, run_dir, ranks, variant, kind)
            checked.append(f"{name}/{run_dir.name}")
    runs = runs_on(ranks)
    expected = [f"{d}/{r.replace(':', '_')}" for d in PLAN_DATASETS for r in runs[d]]
    assert sorted(checked) == sorted(expected)


def test_int64_ids_on_two_ranks_equal_one(datasets: dict[str, Path], two_ranks: Path) -> None:
    """The tables of `tables`, their ids stored as int64, on a mixed plan in both
    input modes."""
    spec = FeatureSpec.load(datasets["wide_ids"] / "feature_spec.yaml")
    assert {f.dtype for f in spec.categorical_features} == {"int64"}
    reference = out(datasets, "wide_ids", 1) / "local_model_parallel_adam_fp32"
    for run_name in INT64_RUNS:
        run_dir = out(datasets, "wide_ids", 2) / run_name.replace(":", "_")
        assert_ranks_equal_one(reference, run_dir, 2, "fp32", "mixed")


def test_variable_length_mean_pooling_on_two_ranks_equal_one(
    datasets: dict[str, Path], two_ranks: Path
) -> None:
    """Ragged ids through the loader, the id alltoalls (lengths, then ids) and
    every sharding kind (the mixed plan places the variable-length tables 1-4
    table-, column-, row-wise and replicated), in both input modes: the weights
    of one process."""
    spec = FeatureSpec.load(datasets["variable_length"] / "feature_spec.yaml")
    assert [f.is_variable_length for f in spec.categorical_features] == [
        h == 0 for h in VARIABLE_HOTNESS
    ]
    for run_name in VARIABLE_LENGTH_RUNS:
        kind, _mode, optimizer, variant = run_name.split(":")
        reference = out(datasets, "variable_length", 1) / f"local_model_parallel_{optimizer}_mean"
        run_dir = out(datasets, "variable_length", 2) / run_name.replace(":", "_")
        assert_ranks_equal_one(reference, run_dir, 2, variant, kind)


# Moved from test_rowwise_adagrad.py, to share this file's launches.
@pytest.mark.parametrize("many_ranks", list(ROWWISE_ADAGRAD_RUNS), indirect=True)
def test_rowwise_adagrad_ranks_equal_one(datasets: dict[str, Path], many_ranks: int) -> None:
    """`--optimizer rowwise_adagrad` on N ranks trains as one process does."""
    ranks = many_ranks
    runs = rowwise_adagrad_runs(ranks)
    reference = out(datasets, "rowwise_adagrad", 1) / ROWWISE_ADAGRAD_REFERENCE.replace(":", "_")
    for run in runs:
        run_dir = out(datasets, "rowwise_adagrad", ranks) / run.replace(":", "_")
        assert_ranks_equal_one(reference, run_dir, ranks, "fp32", run.split(":")[0])
