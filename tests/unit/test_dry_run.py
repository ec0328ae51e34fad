"""The dry run (`dlrm-plan`): from flags alone and from a FeatureSpec, its figures'
structure and scale, where a model stops fitting, its JSON against its console
table, and its errors."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from dlrm.app.assembly import model_config_for
from dlrm.app.config import RunConfig
from dlrm.embedding.planner.types import format_bytes
from dlrm.planning.cli import TABLES_FROM_FLAGS
from dlrm.planning.devices import BUILTIN_DEVICES, DeviceSpec, device_named, device_table
from dlrm.planning.dry_run import Model, dry_run
from dlrm.planning.errors import DryRunError
from dlrm.planning.memory import ID_BYTES
from dlrm.planning.report import format_dry_run
from dlrm.planning.world import World
from feature_spec.criteo import (
    CRITEO_1TB_MLPERF_CARDINALITIES,
    MLPERF_DCNV2_MULTI_HOT_SIZES,
    build_split_binary_spec,
)
from harness.processes import run

H100 = BUILTIN_DEVICES["H100-80GB-SXM"]


def model_of(cardinalities, hotness=None, num_numerical=13, **flags) -> Model:  # type: ignore[no-untyped-def]
    """The dry run's model of tables given as flags, and `flags` as dlrm-train's."""
    config = RunConfig(mode="train", dataset_path=TABLES_FROM_FLAGS, **flags)
    spec = build_split_binary_spec(cardinalities, num_numerical, hotness)
    return Model(config, model_config_for(spec, config), spec)


def dcnv2(**flags) -> Model:  # type: ignore[no-untyped-def]
    """MLPerf's DLRM-DCNv2 (dlrm/flagfiles/mlperf_dcnv2.flags) on Criteo 1TB multi-hot."""
    values = {
        "interaction": "cross",
        "num_cross_layers": 3,
        "cross_layer_projection_dim": 512,
        "optimizer": "adagrad",
        "batch_size": 65536,
        **flags,
    }
    return model_of(CRITEO_1TB_MLPERF_CARDINALITIES, MLPERF_DCNV2_MULTI_HOT_SIZES, **values)


def test_criteo_from_flags_alone_counts_every_table_and_its_slots() -> None:
    result = dry_run(dcnv2(), World(1, 8, H100))
    memory = result.placement.memory
    values = sum(rows * 128 * 4 for rows in CRITEO_1TB_MLPERF_CARDINALITIES)
    replicated = sum(
        t.spec.rows * 128 * 4 * 7
        for t in result.placement.plan.tables
        if t.kind.value == "data_parallel"
    )  # seven more copies on 8 ranks
    assert sum(m.tables for m in memory) == values + replicated
    assert sum(m.optimizer_slots for m in memory) == values + replicated  # Adagrad: one slot
    assert result.placement.fits and result.misfit is None
    for m in memory:
        assert m.peak == sum(getattr(m, term) for term in m.TERMS)
        assert 20 * 2**30 < m.peak < 40 * 2**30  # 179 GiB of tables and slots over 8
    step = result.step
    assert step.total > 0 and step.dense_compute > 0 and step.lookups_update > 0
    assert step.alltoall_ids == 0  # model-parallel input: each rank reads its tables' ids
    assert step.inter_host_share == 0  # one host
    assert result.samples_per_second == pytest.approx(65536 / step.total)
    assert result.scaling.efficiency_same_rank_batch == pytest.approx(1.0)


def test_sgd_has_no_slots_and_the_dense_part_grows_with_the_batch() -> None:
    tables = (23, 70_001, 130, 9_999)
    small = dry_run(model_of(tables, batch_size=512), World(1, 2, H100))
    large = dry_run(model_of(tables, batch_size=4096), World(1, 2, H100))
    assert all(m.optimizer_slots == 0 for m in small.placement.memory)
    for a, b in zip(small.placement.memory, large.placement.memory, strict=True):
        assert b.activations == 8 * a.activations and b.tables == a.tables
    assert large.step.dense_compute == pytest.approx(8 * small.step.dense_compute)


def test_the_alltoall_slows_down_with_the_link_between_hosts() -> None:
    model = dcnv2()
    bytes_only = dataclasses.replace(H100, collective_overhead_us=0.0)
    fast = dry_run(model, World(4, 8, bytes_only), max_hosts=4)
    slow = dry_run(
        model, World(4, 8, dataclasses.replace(bytes_only, inter_host_gbit_s=100)), max_hosts=4
    )
    assert fast.step.inter_host_share == pytest.approx(24 / 31)
    assert slow.step.alltoall_vectors > 3 * fast.step.alltoall_vectors
    assert slow.step.alltoall_gradients > 3 * fast.step.alltoall_gradients
    assert slow.step.dense_compute == fast.step.dense_compute
    assert slow.samples_per_second < fast.samples_per_second
    one_host = dry_run(model, World(1, 8, bytes_only))
    assert fast.step.alltoall_vectors > one_host.step.alltoall_vectors  # NVLink within a host


def test_each_round_of_collectives_pays_the_overhead_once() -> None:
    model = dcnv2(input_mode="data_parallel", exchange_ids_ahead=False)
    overhead = 2500.0
    without = dry_run(model, World(2, 8, dataclasses.replace(H100, collective_overhead_us=0)))
    with_it = dry_run(
        model, World(2, 8, dataclasses.replace(H100, collective_overhead_us=overhead))
    )
    rounds = {  # on a GPU a step is one chunk: one round each, replicated fused
        "alltoall_ids": 1,
        "alltoall_vectors": 1,
        "alltoall_gradients": 1,
        "dense_allreduce": 1,
        "replicated_gradients": 0,
        "dense_compute": 0,
        "lookups_update": 0,
    }
    for term, count in rounds.items():
        added = getattr(with_it.step, term) - getattr(without.step, term)
        assert added == pytest.approx(count * overhead * 1e-6), term
    alone = dry_run(model, World(1, 1, dataclasses.replace(H100, collective_overhead_us=1e6)))
    assert alone.step.total == pytest.approx(alone.step.dense_compute + alone.step.lookups_update)


def test_data_parallel_input_exchanges_ids() -> None:
    result = dry_run(
        dcnv2(input_mode="data_parallel", exchange_ids_ahead=False), World(2, 8, H100), max_hosts=2
    )
    assert result.step.alltoall_ids > 0


@pytest.mark.parametrize(
    ("hosts", "overhead_us", "outlasts"),
    [(1, 0.0, False), (8, 5000.0, True)],  # NVLink alone; 8 hosts and slow rounds
)
def test_ids_exchanged_ahead_leave_the_step_only_what_outlasts_the_dense_part(
    hosts: int, overhead_us: float, outlasts: bool
) -> None:
    """Under --exchange_ids_ahead the ids' alltoall runs beside the step before's
    dense compute: hidden up to its length, the rest still on the step."""
    world = World(hosts, 8, dataclasses.replace(H100, collective_overhead_us=overhead_us))
    own_run = dry_run(dcnv2(input_mode="data_parallel", exchange_ids_ahead=False), world)
    ahead_run = dry_run(dcnv2(input_mode="data_parallel"), world)
    own, ahead = own_run.step, ahead_run.step
    # A rank holds the next batch's ids of its model-parallel shards a step longer.
    plan = ahead_run.placement.plan
    assert plan == own_run.placement.plan
    batch = ahead_run.model.config.batch_size
    held = [0] * world.size
    for table in plan.tables:
        if table.kind != "data_parallel":
            for shard in table.shards:
                held[shard.rank] += batch * table.spec.hotness * ID_BYTES
    assert sum(held) > 0
    for ours, theirs in zip(ahead_run.placement.memory, own_run.placement.memory, strict=True):
        assert ours.exchange - theirs.exchange == held[ours.rank]
    assert own.alltoall_ids > 0 and own.alltoall_ids_hidden == 0
    hidden = min(own.alltoall_ids, own.dense_compute)
    assert ahead.alltoall_ids_hidden == pytest.approx(hidden)
    assert ahead.alltoall_ids == pytest.approx(own.alltoall_ids - hidden)
    assert ahead.total == pytest.approx(own.total - hidden)
    assert (own.alltoall_ids > own.dense_compute) == outlasts
    assert (ahead.alltoall_ids > 0) == outlasts
    assert ahead.to_dict()["alltoall_ids_hidden_s"] == ahead.alltoall_ids_hidden


# A device of 24 MiB and no runtime, for a table of 30.5 MiB that fits 2 ranks only.
TINY = DeviceSpec(
    name="tiny",
    memory_gib=24 / 1024,
    fp32_tflops=1.0,
    fp16_tflops=1.0,
    memory_bandwidth_gb_s=10.0,
    intra_host_gbit_s=10.0,
    inter_host_gbit_s=10.0,
)


def test_the_first_table_that_does_not_fit_and_the_smallest_world() -> None:
    model = model_of(
        (1000, 500_000, 1000),
        num_numerical=3,
        batch_size=64,
        embedding_dim=(16,),
        bottom_mlp_dims=(8, 16),
        top_mlp_dims=(8, 1),
    )
    result = dry_run(model, World(1, 1, TINY), max_hosts=8)
    assert not result.placement.fits
    assert result.misfit is not None
    assert result.misfit.table == 1
    assert result.misfit.smallest_hosts == 2
    two = dry_run(model, World(2, 1, TINY), max_hosts=8)
    assert two.placement.fits and two.misfit is None
    assert two.placement.plan.tables[1].kind.value in ("column_wise", "row_wise")  # split
    assert all(m.peak <= TINY.memory_bytes for m in two.placement.memory)
    never = dry_run(model, World(1, 1, dataclasses.replace(TINY, memory_gib=0.001)), max_hosts=4)
    assert never.misfit is not None and never.misfit.smallest_hosts is None


def test_the_console_shows_the_figures_of_the_json() -> None:
    result = dry_run(dcnv2(), World(1, 4, BUILTIN_DEVICES["A100-80GB-SXM"]), max_hosts=8)
    text, data = format_dry_run(result), result.to_dict()
    assert json.loads(json.dumps(data)) == data
    for m in data["memory_per_rank"]:
        cells = [format_bytes(m[t]) for t in (*result.placement.memory[0].TERMS, "peak")]
        assert re.search(rf"^\s+{m['rank']}\s+" + r"\s+".join(map(re.escape, cells)), text, re.M)
    step = data["step_time_per_rank"][data["slowest_rank"]]
    assert f"{step['total_s'] * 1e3:.3f} ms" in text
    assert f"{data['samples_per_second']:,.0f}" in text
    assert f"{data['misfit']['smallest_hosts']} hosts" in text if data["misfit"] else "Fits" in text


def test_a_users_device_table_merges_over_the_built_ins(tmp_path: Path) -> None:
    path = tmp_path / "devices.yaml"
    path.write_text(
        "H100-80GB-SXM: {inter_host_gbit_s: 200}\n"
        "mine: {memory_gib: 16, fp32_tflops: 1, fp16_tflops: 2, memory_bandwidth_gb_s: 100,"
        " intra_host_gbit_s: 50, inter_host_gbit_s: 25}\n"
    )
    table = device_table(path)
    assert table["H100-80GB-SXM"].inter_host_gbit_s == 200
    assert table["H100-80GB-SXM"].memory_gib == H100.memory_gib
    assert device_named("mine", table).memory_bytes == 16 * 2**30
    path.write_text("mine: {memory_gib: 16, speed: 3}\n")
    with pytest.raises(DryRunError, match="device 'mine': unknown fields \\['speed'\\]"):
        device_table(path)
    with pytest.raises(DryRunError, match="unknown device 'B200'; expected one of A100-80GB-SXM"):
        device_named("B200", table)


def test_a_cpu_server_is_shared_by_its_ranks() -> None:
    server = BUILTIN_DEVICES["cpu-64core"]
    quarter = World(1, 4, server).rank_device
    assert quarter.memory_gib == server.memory_gib / 4
    assert quarter.inter_host_gbit_s == server.inter_host_gbit_s / 4
    assert quarter.runtime_baseline_gib == server.runtime_baseline_gib  # one per process


def plan_command(*flags: str) -> list[str]:
    return [".venv/bin/python", "-m", "dlrm.planning", *flags]


def test_the_command_from_a_feature_spec_writes_what_it_prints(tmp_path: Path) -> None:
    spec = build_split_binary_spec((23, 200_000, 7, 50_000), 5, (1, 3, 1, 2))
    spec.dump(tmp_path / "feature_spec.yaml")  # no data files: the dry run needs none
    out = tmp_path / "plan.json"
    result = run(
        plan_command(
            f"--dataset_path={tmp_path}",
            "--embedding_dim=16",
            "--bottom_mlp_dims=32,16",
            "--batch_size=4096",
            "--optimizer=adagrad",
            "--hosts=2",
            "--ranks_per_host=2",
            "--device=cpu-64core",
            f"--json={out}",
        ),
        timeout=120,
        check=True,
    )
    data = json.loads(out.read_text())
    assert data["world"]["world_size"] == 4
    assert [t["spec"]["hotness"] for t in data["plan"]["tables"]] == [1, 3, 1, 2]
    most = data["memory_per_rank"][data["most_loaded_rank"]]
    assert f"rank {most['rank']} ({format_bytes(most['peak'])})" in result.stdout
    assert f"{data['samples_per_second']:,.0f}" in result.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--cardinalities=10,20", "--device=B200"],
            "--device: unknown device 'B200'; expected one of A100-80GB-SXM, H100-80GB-SXM",
        ),
        (["--cardinalities=10,20"], "--device: required; expected one of A100-80GB-SXM"),
        (
            ["--cardinalities=10,20", "--hotness=1", "--device=H100-80GB-SXM"],
            "--hotness: expected one value per table of --cardinalities (2), got 1",
        ),
        (["--device=H100-80GB-SXM"], "--dataset_path or --cardinalities: expected one of them"),
        (
            ["--cardinalities=10,x", "--device=H100-80GB-SXM"],
            "--cardinalities: expected comma-separated integers >= 1, got '10,x'",
        ),
        (["--cardinalities=10", "--hosts=0", "--device=H100-80GB-SXM"], "--hosts: expected >= 1"),
    ],
)
def test_a_wrong_flag_is_named_with_the_valid_choices(flags: list[str], message: str) -> None:
    result = run(plan_command(*flags), timeout=120)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
