"""How much of a rank's step its collectives cost, measured without changing the step.

Three figures per step, from two records that the step writes anyway:

- **exposed** (`idle_seconds`, a TensorFlow profiler trace of the rank): the time
  within the step in which the rank runs no op at all. A hybrid-parallel step
  only ever waits on its collectives (the batch is in memory and every op's
  inputs are local), so this is what the collectives cost the rank: their
  transfers and the wait for a peer that is behind, less whatever compute ran
  beside them.
- **executing** (`timeline_seconds`, Horovod's timeline, written by rank 0): the
  time in which some collective was transferring data, negotiation (waiting for
  the other ranks to submit) excluded.
- **in flight** (same): the time in which some collective was submitted by a rank
  and not yet done, negotiation included, whether or not the rank computed
  meanwhile. With the vectors' exchange in chunks most of it runs beside
  compute, so it is much larger than the exposed time.

No `tf.timestamp()` ops around each collective in the compiled step time it:
they would wait for all of the collective's inputs, making every gradient's
allreduce wait for the last gradient, and would count time the rank spends
computing while a collective is in flight.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The trainer's compiled step: the profiler names each call of it after the function.
STEP_FUNCTION = "_train_step_eager"


def newest_trace(trace_dir: Path) -> tuple[Path, Any]:
    """The newest TensorFlow profiler trace under `trace_dir`: its file, and its
    `XSpace` (planes of lines of timed events)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = sorted(trace_dir.rglob("*.xplane.pb"))
    if not files:
        raise RuntimeError(f"{trace_dir}: the profiler wrote no trace")
    space = xplane_pb2.XSpace()
    space.ParseFromString(files[-1].read_bytes())
    return files[-1], space


def idle_seconds(trace_dir: Path, step_function: str = STEP_FUNCTION) -> tuple[float, float, int]:
    """(seconds without any op running, seconds, steps) summed over the runs of
    `step_function` in the newest profiler trace under `trace_dir`.

    Ops are what TensorFlow's executor threads ran (the trace's `tf_Compute`
    lines; executor bookkeeping, named with "::", is not an op)."""
    path, space = newest_trace(trace_dir)
    steps: list[tuple[float, float]] = []
    ops: list[tuple[float, float]] = []
    for plane in space.planes:
        for line in plane.lines:
            compute = line.name.startswith("tf_Compute")
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                start = line.timestamp_ns * 1e-9 + event.offset_ps * 1e-12
                span = (start, start + event.duration_ps * 1e-12)
                if compute and ":" in name and "::" not in name:
                    ops.append(span)
                elif not compute and name == step_function:  # tf.function's call, traced
                    steps.append(span)
    if not steps:
        raise RuntimeError(f"{path}: no run of {step_function!r} in the trace")
    ops.sort()
    idle = total = 0.0
    for step_start, step_end in steps:
        reach = step_start
        for op_start, op_end in ops:
            if op_end <= reach or op_start >= step_end:
                continue
            idle += max(0.0, op_start - reach)
            reach = max(reach, op_end)
        idle += max(0.0, step_end - reach)
        total += step_end - step_start
    return idle, total, len(steps)


def exposed(ranks: list[dict[str, float]]) -> dict[str, Any]:
    """From each rank's `idle_seconds` figures (`idle_seconds`, `traced_seconds`,
    `traced_steps`): the ranks' mean seconds per step without any op running, its
    mean share of the step, and each rank's share."""
    shares = [r["idle_seconds"] / r["traced_seconds"] for r in ranks]
    return {
        "seconds": sum(r["idle_seconds"] / r["traced_steps"] for r in ranks) / len(ranks),
        "share": sum(shares) / len(shares),
        "per_rank_share": shares,
    }


def timeline_seconds(timeline: Path, steps: int, first: str) -> tuple[float, float]:
    """(executing, in flight) seconds of the collectives of the last `steps` steps,
    from a Horovod timeline (written by rank 0, the coordinator, as the job runs).

    A step starts with the negotiation of collective `first` (a tensor name);
    the window ends with the last collective. Intervals that overlap (the
    tensors of one fused allreduce, collectives in flight together) count once."""
    text = timeline.read_text().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e["args"]
    }
    open_: dict[int, list[tuple[str, float]]] = {}
    starts: list[float] = []  # each step's first negotiation
    executions: list[tuple[float, float]] = []
    pending: dict[int, float] = {}  # a tensor's negotiation start, until it is done
    flights: list[tuple[float, float]] = []
    for event in events:
        pid = event.get("pid", -1)
        stack = open_.setdefault(pid, [])
        if event.get("ph") == "B":
            stack.append((event["name"], event["ts"] / 1e6))
        elif event.get("ph") == "E" and stack:
            activity, start = stack.pop()
            if stack:  # a phase inside an activity
                continue
            end = event["ts"] / 1e6
            if activity.startswith("NEGOTIATE"):
                pending[pid] = start
                if names.get(pid) == first:
                    starts.append(start)
                continue
            executions.append((start, end))
            flights.append((pending.pop(pid, start), end))
    if len(starts) < steps:
        raise ValueError(
            f"{timeline}: expected at least {steps} steps of collectives starting with "
            f"{first!r}, found {len(starts)}"
        )
    window = starts[-steps]
    return _union(executions, window), _union(flights, window)


def _union(intervals: list[tuple[float, float]], after: float) -> float:
    """Seconds covered by `intervals` from `after` on, overlaps counted once."""
    total, reach = 0.0, after
    for start, end in sorted(intervals):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total
