"""A plan as text: one line per table, one per rank, the balance and the notes."""

from __future__ import annotations

from dlrm.embedding.planner.types import TableSpec


def format_bytes(count: float) -> str:
    """`1536` -> `'1.5 KiB'` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} B" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def describe_table(index: int, spec: TableSpec, slots: int) -> str:
    """`table 3 (40,000,000 x 128, 38.1 GiB with 1 optimizer slot(s))`."""
    with_slots = f" with {slots} optimizer slot(s)" if slots else ""
    size = format_bytes(spec.memory_bytes(slots))
    return f"table {index} ({spec.rows:,} x {spec.dim:,}, {size}{with_slots})"
