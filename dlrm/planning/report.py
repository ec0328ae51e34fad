"""A dry run as a console table, printed from the figures of its JSON form."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dlrm.embedding.planner.report import format_plan
from dlrm.embedding.planner.types import format_bytes
from dlrm.planning.dry_run import DryRun
from dlrm.planning.memory import RankMemory
from dlrm.planning.timing import StepTime
from feature_spec.staged import write_file_atomically

# Ranks listed one per line up to this many; beyond, the most and least loaded.
MAX_LISTED_RANKS = 16

_MEMORY_HEADINGS = ("tables", "slots", "dense", "activ.", "lookups", "exchange", "runtime")
_TIME_LABELS = {
    "dense_compute": "dense compute",
    "lookups_update": "lookups and update",
    "alltoall_ids": "alltoall of ids",
    "alltoall_vectors": "alltoall of vectors",
    "alltoall_gradients": "alltoall of gradients",
    "dense_allreduce": "dense allreduce",
    "replicated_gradients": "replicated tables' gradients",
}


def format_dry_run(result: DryRun) -> str:
    """The plan, memory per rank, the fit, the step time and the scaling."""
    data = result.to_dict()
    world = data["world"]
    lines = [
        f"Dry run: {result.world.describe()}, global batch {data['global_batch_size']:,}",
        "",
        format_plan(result.placement.plan),
        "",
        *_memory_lines(data),
        "",
        *_fit_lines(data),
        "",
        *_time_lines(data),
    ]
    if world["device"]["source"]:
        lines.append(f"device figures: {world['device']['source']}")
    return "\n".join(lines)


def _memory_lines(data: dict[str, Any]) -> list[str]:
    memory = data["memory_per_rank"]
    device = data["device_memory_bytes"]
    lines = [
        f"Memory per rank (device: {format_bytes(device)}):",
        f"{'rank':>5}  " + "  ".join(f"{h:>10}" for h in _MEMORY_HEADINGS) + f"  {'peak':>10}",
    ]
    listed = memory
    if len(memory) > MAX_LISTED_RANKS:
        chosen = {data["most_loaded_rank"], data["least_loaded_rank"]}
        listed = [m for m in memory if m["rank"] in chosen]
    for m in listed:
        cells = "  ".join(f"{format_bytes(m[t]):>10}" for t in RankMemory.TERMS)
        over = "  over" if m["peak"] > device else ""
        lines.append(f"{m['rank']:>5}  {cells}  {format_bytes(m['peak']):>10}{over}")
    if len(listed) < len(memory):
        lines.append(f"({len(memory) - len(listed)} more ranks in --json)")
    most, least = memory[data["most_loaded_rank"]], memory[data["least_loaded_rank"]]
    lines.append(
        f"most loaded: rank {most['rank']} ({format_bytes(most['peak'])}); least loaded: "
        f"rank {least['rank']} ({format_bytes(least['peak'])})"
    )
    return lines


def _fit_lines(data: dict[str, Any]) -> list[str]:
    budget = data["embedding_memory_budget_gib"]
    if data["fits"]:
        line = "Fits: every rank's peak is within its device's memory"
        if budget:
            line += f" (with --embedding_memory_budget_gib {budget:g})"
        return [line]
    misfit = data["misfit"]
    table = misfit["table"]
    lines = [
        f"Does not fit: {misfit['reason']}",
        f"first table that does not fit: {'none alone' if table is None else f'table {table}'}",
    ]
    hosts = misfit["smallest_hosts"]
    ranks = data["world"]["ranks_per_host"]
    lines.append(
        f"smallest world that fits: {hosts} hosts ({hosts * ranks} ranks)"
        if hosts
        else f"smallest world that fits: none up to {misfit['max_hosts']} hosts"
    )
    return lines


def _time_lines(data: dict[str, Any]) -> list[str]:
    rank = data["slowest_rank"]
    step = data["step_time_per_rank"][rank]
    total = step["total_s"]
    lines = [f"Step time (slowest rank: {rank}):"]
    for term in StepTime.TERMS:
        seconds = step[f"{term}_s"]
        share = seconds / total if total else 0.0
        lines.append(f"  {_TIME_LABELS[term]:<30} {seconds * 1e3:>10.3f} ms  {share:>6.1%}")
    lines.append(f"  {'total':<30} {total * 1e3:>10.3f} ms")
    if step["alltoall_ids_hidden_s"]:
        lines.append(
            f"  (and {step['alltoall_ids_hidden_s'] * 1e3:.3f} ms of the ids' alltoall behind "
            "the dense part of the step before: --exchange_ids_ahead)"
        )
    lines.append(
        f"alltoall bytes within a host {step['alltoall_intra_host_share']:.1%}, between "
        f"hosts {step['alltoall_inter_host_share']:.1%}"
    )
    scaling = data["scaling"]
    lines.append(
        f"samples/s: {data['samples_per_second']:,.0f}; scaling efficiency against one host: "
        f"{scaling['efficiency_same_rank_batch']:.1%} at the same per-rank batch, "
        f"{scaling['efficiency_same_global_batch']:.1%} at the same global batch"
    )
    return lines


def write_json(result: DryRun, path: str | os.PathLike[str]) -> Path:
    """Writes `result.to_dict()` to `path` (atomically)."""
    return write_file_atomically(path, json.dumps(result.to_dict(), indent=1) + "\n")
