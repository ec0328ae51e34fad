"""A plan as text: one line per table, one per rank, the balance and the notes."""

from __future__ import annotations

from dlrm.embedding.planner.cost import imbalance
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import DATA_PARALLEL, ROW_WISE, TABLE_WISE, format_bytes


def format_plan(plan: ShardingPlan) -> str:
    """One line per table (its kind, bytes and placement), then one per rank
    (memory, lookup and traffic), then the balance and the planner's notes."""
    slots, row_slots = plan.optimizer_slots, plan.row_slots
    per_row = f" and {row_slots} per row" if row_slots else ""
    lines = [
        f"Sharding plan ({plan.strategy}): {len(plan.tables)} tables on "
        f"{plan.world_size} ranks, {slots} optimizer slot(s) per element{per_row}, "
        f"costed at a global batch of {plan.global_batch_size:,}",
        f"{'table':>5}  {'rows':>13}  {'dim':>4}  {'kind':<13}  {'bytes':>10}  placement",
    ]
    for t in plan.tables:
        if t.kind == DATA_PARALLEL:
            exchange = plan.gradient_exchange(t.table)
            placement = (
                f"every rank ({plan.world_size}); gradient: {exchange.method} "
                f"{format_bytes(exchange.bytes)}/step"
            )
        elif t.kind == TABLE_WISE:
            placement = f"rank {t.shards[0].rank}"
        else:
            placement = " ".join(
                f"r{s.rank}[{s.rows[0]}:{s.rows[1]}, :]"
                if t.kind == ROW_WISE
                else f"r{s.rank}[:, {s.columns[0]}:{s.columns[1]}]"
                for s in sorted(t.shards, key=lambda s: (s.rows, s.columns))
            )
        size = format_bytes(t.spec.memory_bytes(slots, row_slots))
        shape = f"{t.spec.rows:>13,}  {t.spec.dim:>4}"
        lines.append(f"{t.table:>5}  {shape}  {t.kind.value:<13}  {size:>10}  {placement}")
    memory, lookup = plan.memory_per_rank(), plan.lookup_bytes_per_rank()
    traffic = plan.traffic_bytes_per_rank()
    lines.append(f"{'rank':>5}  {'memory':>10}  {'lookup/sample':>13}  {'sent/step':>10}  tables")
    for rank in range(plan.world_size):
        tables = ",".join(str(t) for t in plan.tables_on(rank)) or "-"
        lines.append(
            f"{rank:>5}  {format_bytes(memory[rank]):>10}  "
            f"{format_bytes(lookup[rank]):>13}  {format_bytes(traffic[rank]):>10}  {tables}"
        )
    lines.append(f"max/mean: memory {imbalance(memory):.3f}, lookup {imbalance(lookup):.3f}")
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)
