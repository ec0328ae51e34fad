"""A dry run: the plan `dlrm-train` would make for a world, each rank's memory and
step time, whether it fits, and if not where it would; as data, a table and JSON."""

from __future__ import annotations

import dataclasses
from typing import Any

from dlrm.app.config import RunConfig
from dlrm.app.sharding import plan_for
from dlrm.embedding.planner.placement import PlannerConfig, plan_sharding
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import PlanError, TableSpec
from dlrm.model.config import ModelConfig
from dlrm.planning.devices import GIB
from dlrm.planning.memory import RankMemory, rank_memory
from dlrm.planning.timing import StepTime, step_times
from dlrm.planning.world import World
from feature_spec import FeatureSpec

# The most hosts the search for a world that fits tries.
DEFAULT_MAX_HOSTS = 1024


@dataclasses.dataclass(frozen=True)
class Model:
    """What is planned: the run's flags, its architecture and its dataset."""

    config: RunConfig
    architecture: ModelConfig
    spec: FeatureSpec


@dataclasses.dataclass(frozen=True)
class Placement:
    """A plan for a world and each rank's memory under it. `budget_gib` is the
    `--embedding_memory_budget_gib` the plan was made with (0: none); `error` the
    planner's refusal, when it refused (the plan is then the unbudgeted one)."""

    plan: ShardingPlan
    memory: tuple[RankMemory, ...]
    device_memory: int
    budget_gib: float
    error: str | None = None

    @property
    def fits(self) -> bool:
        return self.error is None and all(m.peak <= self.device_memory for m in self.memory)


@dataclasses.dataclass(frozen=True)
class Misfit:
    """Where the model does not fit: the first table that does not (None when each
    fits alone and only their sum does not), and the fewest hosts that fit (None
    when none up to the search's limit does)."""

    table: int | None
    reason: str
    smallest_hosts: int | None
    max_hosts: int


@dataclasses.dataclass(frozen=True)
class Scaling:
    """Samples/s on one host of the same ranks, and this world's efficiency against
    it at the same per-rank batch (global batch / hosts on one host) and at the
    same global batch."""

    one_host_same_rank_batch: float
    one_host_same_global_batch: float
    efficiency_same_rank_batch: float
    efficiency_same_global_batch: float


@dataclasses.dataclass(frozen=True)
class DryRun:
    model: Model
    world: World
    placement: Placement
    times: tuple[StepTime, ...]
    misfit: Misfit | None
    scaling: Scaling

    @property
    def step(self) -> StepTime:
        """The slowest rank's step."""
        return max(self.times, key=lambda t: t.total)

    @property
    def samples_per_second(self) -> float:
        return self.model.config.batch_size / self.step.total

    def to_dict(self) -> dict[str, Any]:
        """Every figure the console table shows, and every rank's."""
        memory = self.placement.memory
        most = max(memory, key=lambda m: m.peak)
        least = min(memory, key=lambda m: m.peak)
        return {
            "world": {
                "hosts": self.world.hosts,
                "ranks_per_host": self.world.ranks_per_host,
                "world_size": self.world.size,
                "device": dataclasses.asdict(self.world.device),
            },
            "global_batch_size": self.model.config.batch_size,
            "model": self.model.architecture.to_dict(),
            "plan": self.placement.plan.to_dict(with_shards=True),
            "embedding_memory_budget_gib": self.placement.budget_gib,
            "planner_error": self.placement.error,
            "device_memory_bytes": self.placement.device_memory,
            "memory_per_rank": [m.to_dict() for m in memory],
            "most_loaded_rank": most.rank,
            "least_loaded_rank": least.rank,
            "fits": self.placement.fits,
            "misfit": dataclasses.asdict(self.misfit) if self.misfit else None,
            "step_time_per_rank": [t.to_dict() for t in self.times],
            "slowest_rank": self.step.rank,
            "step_time_s": self.step.total,
            "samples_per_second": self.samples_per_second,
            "scaling": dataclasses.asdict(self.scaling),
        }


def place(model: Model, world: World) -> Placement:
    """The plan `dlrm-train` makes with these flags and each rank's memory; where
    that does not fit the device, the plan with the budget the device leaves the
    tables (`--embedding_memory_budget_gib`), if that one fits."""
    device_memory = world.rank_device.memory_bytes
    config = model.config
    try:
        plan = plan_for(config, model.architecture, model.spec, world.size)
    except PlanError as error:  # the user's own budget
        unbudgeted = dataclasses.replace(config, embedding_memory_budget_gib=0.0)
        plan = plan_for(unbudgeted, model.architecture, model.spec, world.size)
        memory = tuple(rank_memory(plan, model.architecture, config, world))
        return Placement(plan, memory, device_memory, 0.0, str(error))
    memory = tuple(rank_memory(plan, model.architecture, config, world))
    given = config.embedding_memory_budget_gib
    first = Placement(plan, memory, device_memory, given)
    if first.fits:
        return first
    budget = (device_memory - max(m.beyond_tables for m in memory)) / GIB
    if given:
        budget = min(budget, given)
    if budget <= 0:
        beyond = max(m.beyond_tables for m in memory) / GIB
        reason = f"without its tables, a rank needs {beyond:.1f} GiB, more than its device's"
        return dataclasses.replace(first, error=reason)
    budgeted = dataclasses.replace(config, embedding_memory_budget_gib=round(budget, 3))
    try:
        plan = plan_for(budgeted, model.architecture, model.spec, world.size)
    except PlanError as error:
        return dataclasses.replace(first, budget_gib=round(budget, 3), error=str(error))
    memory = tuple(rank_memory(plan, model.architecture, config, world))
    return Placement(plan, memory, device_memory, round(budget, 3))


def first_table_that_does_not_fit(model: Model, placement: Placement) -> int | None:
    """The first table whose addition (tables in order) the planner refuses at the
    placement's budget; None when every prefix fits the planner (only the ranks'
    other memory does not)."""
    plan, config = placement.plan, model.config
    if not placement.budget_gib:
        return None
    planner = PlannerConfig(
        world_size=plan.world_size,
        memory_budget_bytes=max(1, int(placement.budget_gib * GIB)),
        data_parallel_threshold=config.data_parallel_threshold,
        column_slice_threshold=config.column_slice_threshold,
        row_slice_threshold=config.row_slice_threshold,
        strategy=config.sharding_strategy,
        optimizer_slots=plan.optimizer_slots,
        row_slots=plan.row_slots,
        global_batch_size=config.batch_size,
    )
    tables: list[TableSpec] = []
    for entry in plan.tables:
        tables.append(entry.spec)
        try:
            plan_sharding(tables, planner)
        except PlanError:
            return entry.table
    return None


def smallest_hosts(model: Model, world: World, max_hosts: int) -> int | None:
    """The fewest hosts (more than `world`'s) on which the model fits, or None up
    to `max_hosts`: doubling, then halving the gap (fitting is taken to be
    monotonic in the hosts)."""
    low, high = world.hosts, world.hosts
    while True:
        high = min(max(high * 2, high + 1), max_hosts)
        if place(model, world.with_hosts(high)).fits:
            break
        if high >= max_hosts:
            return None
        low = high
    while high - low > 1:
        middle = (low + high) // 2
        if place(model, world.with_hosts(middle)).fits:
            high = middle
        else:
            low = middle
    return high


def _one_host_samples(model: Model, world: World, batch_size: int) -> float:
    """Samples/s of `world`'s ranks of one host at `batch_size`, memory aside."""
    config = dataclasses.replace(
        model.config, batch_size=batch_size, embedding_memory_budget_gib=0.0
    )
    one = world.with_hosts(1)
    plan = plan_for(config, model.architecture, model.spec, one.size)
    slowest = max(t.total for t in step_times(plan, model.architecture, config, one))
    return batch_size / slowest


def dry_run(model: Model, world: World, max_hosts: int = DEFAULT_MAX_HOSTS) -> DryRun:
    """Plans `model` on `world` and predicts its memory and step time."""
    placement = place(model, world)
    misfit = None
    if not placement.fits:
        table = first_table_that_does_not_fit(model, placement)
        reason = placement.error or "a rank's peak exceeds its device's memory"
        hosts = smallest_hosts(model, world, max_hosts) if world.hosts < max_hosts else None
        misfit = Misfit(table, reason, hosts, max_hosts)
    times = tuple(step_times(placement.plan, model.architecture, model.config, world))
    samples = model.config.batch_size / max(t.total for t in times)
    batch = model.config.batch_size
    same_rank = _one_host_samples(model, world, max(1, batch // world.hosts))
    same_global = _one_host_samples(model, world, batch)
    scaling = Scaling(
        one_host_same_rank_batch=same_rank,
        one_host_same_global_batch=same_global,
        efficiency_same_rank_batch=samples / (world.hosts * same_rank),
        efficiency_same_global_batch=samples / (world.hosts * same_global),
    )
    return DryRun(model, world, placement, times, misfit, scaling)
