"""The embedding sharding planner: coverage, budgets, balance, serialisation, errors."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from typing import Any

import pytest

from dlrm.embedding.planner.cost import replicated_gradient_exchange
from dlrm.embedding.planner.placement import PlannerConfig, plan_sharding
from dlrm.embedding.planner.plan import ShardingPlan, TablePlan
from dlrm.embedding.planner.report import format_plan
from dlrm.embedding.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    ROW_WISE,
    STRATEGIES,
    TABLE_WISE,
    PlanError,
    TableSpec,
)
from dlrm.embedding.shard import (
    ShardError,
    ShardingKind,
    TableShard,
    check_covers,
    check_disjoint,
    check_tiling,
)
from feature_spec.criteo import CRITEO_1TB_MLPERF_CARDINALITIES

GiB = 1 << 30

# One table of each kind on 3 ranks, with odd sizes so off-by-one slices show.
TINY = [
    TableSpec(23, 7),  # 161 elements: table_wise
    TableSpec(23, 11, hotness=3),  # 253: table_wise
    TableSpec(230, 11),  # 2530 > 300: column_wise
    TableSpec(2300, 7),  # 16100 > 10000: row_wise
    TableSpec(4, 7),  # 28 <= 30: data_parallel
]
TINY_CONFIG = PlannerConfig(
    3, data_parallel_threshold=30, column_slice_threshold=300, row_slice_threshold=10_000
)


@pytest.fixture(scope="module")
def plan() -> ShardingPlan:
    """TINY's plan, one for the module: a plan is frozen."""
    return plan_sharding(TINY, TINY_CONFIG)


def checked_plan(tables: list[TableSpec], config: PlannerConfig) -> ShardingPlan:
    """Plans the tables, then checks the plan cell by cell, apart from its own validation."""
    plan = plan_sharding(tables, config)
    n, slots = config.world_size, config.optimizer_slots
    assert plan.world_size == n
    assert [t.table for t in plan.tables] == list(range(len(tables)))
    memory = [0] * n
    for entry, spec in zip(plan.tables, tables, strict=True):
        assert entry.spec == spec
        ranks = [s.rank for s in entry.shards]
        assert len(set(ranks)) == len(ranks) and all(0 <= r < n for r in ranks)
        areas = [(s.rows[1] - s.rows[0]) * (s.columns[1] - s.columns[0]) for s in entry.shards]
        for s, area in zip(entry.shards, areas, strict=True):
            # Slots are float32 whatever the table's dtype.
            memory[s.rank] += area * (spec.dtype_bytes + 4 * slots)
        if entry.kind == DATA_PARALLEL:
            assert sorted(ranks) == list(range(n))
            assert all(
                s.rows == (0, spec.rows) and s.columns == (0, spec.dim) for s in entry.shards
            )
            continue
        cells = [0] * (spec.rows * spec.dim) if spec.rows * spec.dim <= 100_000 else None
        for s in entry.shards:
            assert 0 <= s.rows[0] < s.rows[1] <= spec.rows
            assert 0 <= s.columns[0] < s.columns[1] <= spec.dim
            if cells is not None:
                for row in range(*s.rows):
                    for column in range(*s.columns):
                        cells[row * spec.dim + column] += 1
        assert sum(areas) == spec.rows * spec.dim
        assert cells is None or set(cells) == {1}
        if entry.kind == ROW_WISE:
            assert all(s.columns == (0, spec.dim) for s in entry.shards)
        if entry.kind == COLUMN_WISE:
            assert all(s.rows == (0, spec.rows) for s in entry.shards)
            assert len(entry.shards) <= min(n, spec.dim)
    assert memory == plan.memory_per_rank()
    if config.memory_budget_bytes is not None:
        assert max(memory) <= config.memory_budget_bytes
    return plan


def test_tiny_odd_sizes_get_every_kind() -> None:
    plan = checked_plan(TINY, TINY_CONFIG)
    kinds = [t.kind for t in plan.tables]
    assert kinds == [TABLE_WISE, TABLE_WISE, COLUMN_WISE, ROW_WISE, DATA_PARALLEL]
    assert sorted(s.columns for s in plan.tables[2].shards) == [(0, 4), (4, 8), (8, 11)]
    assert sorted(s.rows for s in plan.tables[3].shards) == [(0, 1150), (1150, 2300)]


def test_local_shards_and_tables_on(plan: ShardingPlan) -> None:
    for rank in range(3):
        local = plan.local_shards(rank)
        replica = TableShard(4, ShardingKind.DATA_PARALLEL, rank, (0, 4), (0, 7))
        assert replica in local  # every rank's replica
        assert plan.tables_on(rank) == sorted({s.table for s in local if s.table != 4})
    assert plan.data_parallel_tables() == [4]
    assert sorted(t for r in range(3) for t in plan.tables_on(r)) == [0, 1, 2, 2, 2, 3, 3]


def test_one_rank_holds_every_table_whole() -> None:
    plan = plan_sharding(TINY, dataclasses.replace(TINY_CONFIG, world_size=1))
    assert {t.kind for t in plan.tables} == {TABLE_WISE}
    assert plan.tables_on(0) == [0, 1, 2, 3, 4]


def test_column_slices_are_multiples_of_four_when_the_width_allows() -> None:
    config = PlannerConfig(8, data_parallel_threshold=0, column_slice_threshold=1000)
    plan = plan_sharding([TableSpec(100, 128)], config)  # 12,800 elements: 8 slices
    assert sorted(s.columns for s in plan.tables[0].shards) == [
        (c, c + 16) for c in range(0, 128, 16)
    ]
    config = PlannerConfig(5, data_parallel_threshold=0, column_slice_threshold=30_000)
    plan = plan_sharding([TableSpec(1000, 128)], config)
    widths = sorted(s.columns[1] - s.columns[0] for s in plan.tables[0].shards)
    assert widths == [24, 24, 24, 28, 28]


def test_a_one_row_table_above_the_row_threshold_stays_whole() -> None:
    config = PlannerConfig(2, data_parallel_threshold=0, row_slice_threshold=1000)
    plan = checked_plan([TableSpec(1, 5000, hotness=2), TableSpec(3, 5000)], config)
    assert [t.kind for t in plan.tables] == [TABLE_WISE, ROW_WISE]


def test_cost_balances_a_skewed_set_better_than_round_robin() -> None:
    huge = TableSpec(200_000, 16, hotness=4)
    tables = [huge] + [TableSpec(1_000 + 37 * i, 16) for i in range(20)]
    loads = {}
    for strategy in STRATEGIES:
        config = PlannerConfig(4, data_parallel_threshold=0, strategy=strategy)
        plan = checked_plan(tables, config)
        loads[strategy] = (max(plan.memory_per_rank()), max(plan.lookup_bytes_per_rank()))
    # The huge table sets the floor; round robin stacks small tables on top of it.
    assert loads["cost"][0] < loads["basic"][0]
    assert loads["cost"][1] < loads["basic"][1]
    assert loads["memory_balanced"][0] < loads["basic"][0]
    assert loads["cost"][0] == 200_000 * 16 * 4


@pytest.mark.parametrize("seed", range(12))
def test_random_table_sets_are_valid_and_within_budget(seed: int) -> None:
    rng = random.Random(seed)
    tables = [
        TableSpec(rng.choice([1, 2, 5, 23, 97, 1000, 20_000]), rng.choice([1, 3, 7, 11, 16]),
                  hotness=rng.randint(1, 4), dtype_bytes=rng.choice([2, 4]))
        for _ in range(rng.randint(1, 12))
    ]  # fmt: skip
    for world_size in range(1, 6):
        for strategy in STRATEGIES:
            slots = rng.randint(0, 2)
            total = sum(t.memory_bytes(slots) for t in tables)
            budget = rng.choice([None, int(total * rng.uniform(0.3, 1.5))])
            config = PlannerConfig(
                world_size,
                budget,
                data_parallel_threshold=rng.choice([0, 20, 200]),
                column_slice_threshold=rng.choice([50, 5_000]),
                row_slice_threshold=rng.choice([1_000, 100_000]),
                strategy=strategy,
                optimizer_slots=slots,
            )
            try:
                plan = checked_plan(tables, config)
            except PlanError as error:
                assert budget is not None, error  # only a budget can refuse a plan
                assert any(c.isdigit() for c in str(error))
                continue
            assert ShardingPlan.from_json(plan.to_json()) == plan


def test_random_sets_without_budget_always_plan() -> None:
    rng = random.Random(7)
    for _ in range(50):
        tables = [TableSpec(rng.randint(1, 5_000), rng.randint(1, 40)) for _ in range(8)]
        config = PlannerConfig(rng.randint(1, 5), column_slice_threshold=20_000,
                               row_slice_threshold=100_000)  # fmt: skip
        checked_plan(tables, config)


def test_criteo_1tb_on_8_ranks_is_valid_and_balanced() -> None:
    tables = [TableSpec(rows, 128) for rows in CRITEO_1TB_MLPERF_CARDINALITIES]
    config = PlannerConfig(8, 16 * GiB)
    plan = checked_plan(tables, config)
    kinds = [t.kind for t in plan.tables]
    assert kinds.count(COLUMN_WISE) == 5  # the tables of 25 M rows and more
    assert kinds.count(DATA_PARALLEL) == 13  # up to 8192 rows
    memory, lookup = plan.memory_per_rank(), plan.lookup_bytes_per_rank()
    assert max(memory) / (sum(memory) / 8) < 1.1
    assert max(lookup) / (sum(lookup) / 8) < 1.05
    # Balancing memory alone leaves the lookups badly skewed.
    by_memory = plan_sharding(tables, dataclasses.replace(config, strategy="memory_balanced"))
    assert max(by_memory.lookup_bytes_per_rank()) > 2 * max(lookup)
    # Adagrad's slot doubles the bytes: 16 GiB per rank is then too little.
    with pytest.raises(PlanError, match=r"the model needs 179.2 GiB .* 128.0 GiB in total"):
        plan_sharding(tables, dataclasses.replace(config, optimizer_slots=1))


def test_json_round_trip() -> None:
    plan = plan_sharding(TINY, dataclasses.replace(TINY_CONFIG, optimizer_slots=2))
    data = json.loads(plan.to_json())
    assert data["tables"][3]["kind"] == ROW_WISE
    again = ShardingPlan.from_dict(data)
    assert again == plan
    assert again.memory_per_rank() == plan.memory_per_rank()


def test_format_table_lists_every_table_and_rank(plan: ShardingPlan) -> None:
    text = format_plan(plan)
    lines = text.splitlines()
    for entry in plan.tables:
        line = next(x for x in lines if x.split()[:1] == [str(entry.table)] and entry.kind in x)
        assert f"{entry.spec.rows:,}" in line
    assert "every rank (3)" in text and "[:, 0:4]" in text and "[0:1150, :]" in text
    assert lines[-1].startswith("max/mean: memory")


def corrupt(plan: ShardingPlan, table: int, shards: list[dict[str, object]]) -> dict[str, object]:
    data = plan.to_dict()
    data["tables"][table]["shards"] = shards
    return data


@pytest.mark.parametrize(
    ("table", "shards", "message"),
    [
        (3, [{"rank": 0, "rows": [0, 1200], "columns": [0, 7]},
             {"rank": 1, "rows": [1100, 2300], "columns": [0, 7]}], "do not cover"),
        (3, [{"rank": 0, "rows": [0, 1000], "columns": [0, 7]},
             {"rank": 1, "rows": [1100, 2300], "columns": [0, 7]}], "do not cover"),
        (2, [{"rank": 0, "rows": [0, 230], "columns": [0, 5]},
             {"rank": 0, "rows": [0, 230], "columns": [5, 11]}], "two shards on one rank"),
        (0, [{"rank": 3, "rows": [0, 23], "columns": [0, 7]}], "rank 3 is outside a world of 3"),
        (0, [{"rank": 0, "rows": [0, 24], "columns": [0, 7]}], "outside the table's shape"),
        (4, [{"rank": 0, "rows": [0, 4], "columns": [0, 7]}], r"expected all 3 ranks"),
        (1, [{"rank": 0, "rows": [0, 23], "columns": [3, 3]}], "invalid shard"),
        (1, [{"rank": 0}], "not a sharding plan"),
    ],
)  # fmt: skip
def test_invalid_plans_are_refused(
    table: int, shards: list[dict[str, object]], message: str, plan: ShardingPlan
) -> None:
    with pytest.raises(PlanError, match=message):
        ShardingPlan.from_dict(corrupt(plan, table, shards))


def test_the_planner_names_what_breaks_the_tiling(plan: ShardingPlan) -> None:
    overlap = [
        {"rank": 0, "rows": [0, 1200], "columns": [0, 7]},
        {"rank": 1, "rows": [1100, 2300], "columns": [0, 7]},
    ]
    gap = [{**overlap[0], "rows": [0, 1000]}, overlap[1]]
    with pytest.raises(PlanError, match=r"row_wise table must: table 3 has overlapping shards"):
        ShardingPlan.from_dict(corrupt(plan, 3, overlap))
    with pytest.raises(PlanError, match=r"must: .* they hold 15400 of its 16100 elements"):
        ShardingPlan.from_dict(corrupt(plan, 3, gap))


def shard(rows: tuple[int, int], columns: tuple[int, int], table: int = 0) -> TableShard:
    return TableShard(table, ShardingKind.ROW_WISE, 0, rows, columns)


def test_tiling_is_exact_cover_without_overlap() -> None:
    # Any rectangles, not only slices along one axis: a checkpoint may hold those.
    mixed = [shard((0, 10), (0, 7)), shard((10, 23), (0, 3)), shard((10, 23), (3, 7))]
    check_tiling(0, (23, 7), mixed)
    check_tiling(0, (23, 7), mixed[::-1])
    outside, foreign = shard((10, 23), (3, 8)), shard((10, 23), (3, 7), table=1)
    faults = [
        ([*mixed[:2], outside], r"has a shard rows \[10, 23\] x columns \[3, 8\] outside it"),
        ([*mixed, shard((9, 11), (6, 7))], r"overlapping shards rows \[9, 11\] x columns \[6, 7\]"),
        (mixed[:2], r"do not cover rows \[0, 23\] x columns \[0, 7\]: they hold 109 of its 161"),
        ([*mixed[:2], foreign], r"table 0 lists table_1.rows_10_23.cols_3_7, a shard of table 1"),
        ([], r"they hold 0 of its 161 elements"),
    ]  # fmt: skip
    for shards, message in faults:
        with pytest.raises(ShardError, match=message):
            check_tiling(0, (23, 7), shards)


def test_coverage_of_a_slice_needs_only_the_shards_that_meet_it() -> None:
    shards = [shard((0, 10), (0, 7)), shard((10, 23), (0, 3))]
    check_disjoint(0, (23, 7), shards)
    check_covers(0, (2, 20), (0, 3), shards)
    check_covers(0, (2, 8), (3, 7), shards)
    with pytest.raises(ShardError, match=r"rows \[8, 12\] x columns \[2, 5\]: they hold 8 of"):
        check_covers(0, (8, 12), (2, 5), shards)
    assert shards[1].clip((0, 12), (2, 9)) == shard((10, 12), (2, 3))
    assert shards[1].clip((0, 10), (0, 7)) is None


def test_a_plan_stored_without_its_shards_takes_them_back(plan: ShardingPlan) -> None:
    data = plan.to_dict(with_shards=False)
    assert all("shards" not in table for table in data["tables"])
    assert {k: v for k, v in data.items() if k != "tables"} == {
        k: v for k, v in plan.to_dict().items() if k != "tables"
    }
    # A checkpoint holds the model-parallel shards and one copy of a replicated table.
    written = [s for s in plan.shards if s.kind.is_model_parallel or s.rank == 0]
    assert ShardingPlan.from_dict(data, shards=written) == plan
    assert ShardingPlan.from_dict(json.loads(json.dumps(data)), shards=written) == plan
    with pytest.raises(PlanError, match="table 0: no shards, and none given"):
        ShardingPlan.from_dict(data)
    with pytest.raises(PlanError, match=r"table 2 \(column_wise\): .* do not cover"):
        ShardingPlan.from_dict(data, shards=[s for s in written if s != plan.tables[2].shards[0]])


def test_tables_out_of_order_or_missing_are_refused(plan: ShardingPlan) -> None:
    with pytest.raises(PlanError, match="plan entry 1 is for table 2"):
        ShardingPlan(3, "cost", (plan.tables[0], *plan.tables[2:]))
    with pytest.raises(PlanError, match="'diagonal' is not one of"):
        TablePlan(0, "diagonal", TINY[0], plan.tables[0].shards)


def test_plan_for_another_run_is_refused(plan: ShardingPlan) -> None:
    plan.validate(TINY, 3)
    with pytest.raises(PlanError, match="the sharding plan is for 3 ranks, this run has 4"):
        plan.validate(TINY, 4)
    with pytest.raises(PlanError, match="has 5 tables, the model 4"):
        plan.validate(TINY[:4], 3)
    other = [*TINY[:2], TableSpec(231, 11), *TINY[3:]]
    with pytest.raises(PlanError, match=r"table 2: .* \[230, 11\], the model \[231, 11\]"):
        plan.validate(other, 3)


def test_error_when_the_whole_model_exceeds_the_budget() -> None:
    tables = [TableSpec(1_000_000, 64)] * 3  # 3 x 244.1 MiB
    with pytest.raises(
        PlanError,
        match=r"the model needs 732.4 MiB .* the budget of 2 ranks is 400.0 MiB in total "
        r"\(200.0 MiB per rank\)",
    ):
        plan_sharding(tables, PlannerConfig(2, 200 << 20))


def test_error_when_one_table_cannot_be_split_enough() -> None:
    # Two rows make at most two row shards, of 1,000,000 x 4 x 2 bytes each.
    with pytest.raises(
        PlanError,
        match=r"table 0 \(2 x 1,000,000, 15.3 MiB with 1 optimizer slot\(s\)\) does not fit "
        r"4 ranks x 5.0 MiB: split by rows over 2 ranks, a shard needs 7.6 MiB, and a rank "
        r"has 5.0 MiB left",
    ):
        plan_sharding([TableSpec(2, 1_000_000)], PlannerConfig(4, 5 << 20, optimizer_slots=1))


def test_error_names_the_rank_that_would_overflow() -> None:
    tables = [TableSpec(1024, 256)] * 3  # 1 MiB each; 2 ranks of 1.5 MiB hold only two
    with pytest.raises(PlanError, match=r"rank 0 would hold 2.0 MiB, 512.0 KiB over the 1.5 MiB"):
        plan_sharding(tables, PlannerConfig(2, 3 << 19, data_parallel_threshold=0))


def test_round_robin_overflows_where_the_greedy_fits() -> None:
    tables = [TableSpec(1024, 256), TableSpec(64, 256), TableSpec(1024, 256), TableSpec(64, 256)]
    config = PlannerConfig(2, (1 << 20) + (1 << 17), data_parallel_threshold=0)
    checked_plan(tables, config)
    with pytest.raises(PlanError, match=r"table 2 .*\(basic strategy\): rank 0 would hold 2.0 MiB"):
        plan_sharding(tables, dataclasses.replace(config, strategy="basic"))


def test_error_when_replicated_tables_exceed_the_budget() -> None:
    with pytest.raises(PlanError, match=r"data-parallel tables need 31\.2 KiB on every rank"):
        plan_sharding([TableSpec(1000, 8)], PlannerConfig(2, 20_000, data_parallel_threshold=8000))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"world_size": 0}, "world size: expected >= 1, got 0"),
        ({"memory_budget_bytes": 0}, "memory budget: expected >= 1 byte, got 0"),
        ({"column_slice_threshold": -1}, "--column_slice_threshold: expected >= 0, got -1"),
        ({"strategy": "random"}, "--sharding_strategy: expected one of"),
        ({"optimizer_slots": -1}, "optimizer slots: expected >= 0, got -1"),
    ],
)
def test_config_errors_name_the_setting(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        dataclasses.replace(PlannerConfig(2), **changes)


def test_table_spec_rejects_empty_tables() -> None:
    with pytest.raises(PlanError, match="table rows: expected >= 1, got 0"):
        TableSpec(0, 8)


def test_importing_the_planner_loads_neither_tensorflow_nor_horovod() -> None:
    probe = (
        "import sys, dlrm.embedding.planner; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'horovod')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_save_and_load_a_plan_file(tmp_path: Any, plan: ShardingPlan) -> None:
    path = plan.save(tmp_path / "plan.json")
    assert ShardingPlan.load(path) == plan
    assert not list(tmp_path.glob(".*.partial"))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read the sharding plan: No such file or directory"),
        ("{not json", "Expecting property name"),
        ('{"tables": []}', "not a sharding plan: KeyError\\('world_size'\\)"),
    ],
)
def test_a_bad_plan_file_names_the_file(tmp_path: Any, content: str | None, message: str) -> None:
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(PlanError, match=f"^{path}: .*{message}"):
        ShardingPlan.load(path)


def test_fewer_large_tables_than_ranks_are_sliced_so_every_rank_works() -> None:
    # One large table and two small ones on 2 ranks: whole, the large one would be on
    # one rank, leaving the other with no lookups (a job that hangs).
    tables = [TableSpec(3_000_000, 16), TableSpec(4, 16), TableSpec(10, 16)]
    config = PlannerConfig(2)
    plan = checked_plan(tables, config)
    assert plan.tables[0].kind == COLUMN_WISE
    assert sorted(s.columns for s in plan.tables[0].shards) == [(0, 8), (8, 16)]
    assert [plan.tables_on(r) for r in range(2)] == [[0], [0]]
    assert len(plan.notes) == 1 and "table 0" in plan.notes[0] and "idle" in plan.notes[0]
    assert format_plan(plan).splitlines()[-1] == f"note: {plan.notes[0]}"
    # Balance reported is the balance that runs: both halves gather as much.
    assert plan.lookup_bytes_per_rank() == [8 * 4, 8 * 4]


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 7, 8])
def test_a_single_table_is_spread_over_every_rank(world_size: int) -> None:
    for spec in (TableSpec(5000, 16), TableSpec(5000, 2), TableSpec(3, 1)):
        config = PlannerConfig(world_size, data_parallel_threshold=0)
        plan = checked_plan([spec], config)
        used = {s.rank for s in plan.tables[0].shards}
        # As far as the table goes: a 3-row, 1-column table has 3 pieces at most.
        assert len(used) == min(world_size, max(spec.rows, spec.dim))
        if spec.dim < world_size:
            assert plan.tables[0].kind == ROW_WISE


def test_no_model_parallel_table_leaves_the_plan_alone() -> None:
    plan = plan_sharding([TableSpec(4, 8), TableSpec(9, 8)], PlannerConfig(4))
    assert {t.kind for t in plan.tables} == {DATA_PARALLEL} and plan.notes == ()


def test_replicated_gradients_take_the_cheaper_exchange() -> None:
    small, large = TableSpec(100, 8), TableSpec(100_000, 8, hotness=2)
    # Dense: 2 (W - 1) / W of rows x (dim + 1) x 4 bytes; sparse: (W - 1) / W of
    # batch x hotness rows of (dim + 1) x 4 bytes.
    assert replicated_gradient_exchange(small, 2, 1024).method == "dense"
    assert replicated_gradient_exchange(small, 2, 1024).bytes == 100 * 9 * 4
    assert replicated_gradient_exchange(large, 4, 1024).method == "sparse"
    assert replicated_gradient_exchange(large, 4, 1024).bytes == 3 * 1024 * 2 * 9 * 4 // 4
    assert replicated_gradient_exchange(large, 1, 1024).bytes == 0
    config = PlannerConfig(2, data_parallel_threshold=10**6, global_batch_size=1024)
    plan = plan_sharding([small, large, TableSpec(10**6, 8)], config)
    assert plan.gradient_exchange(0).method == "dense"
    assert plan.gradient_exchange(1).method == "sparse"
    assert "gradient: dense" in format_plan(plan)
    # Every rank sends its alltoall share plus every replicated table's exchange.
    exchange = plan.gradient_exchange(0).bytes + plan.gradient_exchange(1).bytes
    alltoall = [2 * 0.5 * 1024 * s.width * 4 for s in plan.tables[2].shards]
    assert sorted(plan.traffic_bytes_per_rank()) == sorted(int(a) + exchange for a in alltoall)
    with pytest.raises(PlanError, match="table 2 is column_wise, not data_parallel"):
        plan.gradient_exchange(2)


def test_plans_written_before_notes_and_batch_still_load(plan: ShardingPlan) -> None:
    data = plan.to_dict()
    del data["notes"], data["global_batch_size"]
    assert ShardingPlan.from_dict(data) == plan
