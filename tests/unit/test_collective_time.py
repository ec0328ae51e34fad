"""The benchmark's measures of what collectives cost a step: the time a rank runs no
op, read from a real profiler trace of a step that waits on an asynchronous op (as
Horovod's collectives are) and of one that computes, and the execution and
in-flight time of collectives read from a Horovod timeline."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from benchmarks.collective_time import exposed, idle_seconds, timeline_seconds

WAIT_S = 0.15


def _traced_steps(trace: Path, step: object, before_each: object = None) -> None:
    tf.profiler.experimental.start(str(trace))
    for _ in range(2):
        if before_each is not None:
            before_each()  # type: ignore[operator]
        step()  # type: ignore[operator]
    tf.profiler.experimental.stop()


def test_a_step_waiting_on_an_asynchronous_op_is_idle(tmp_path: Path) -> None:
    """A dequeue, like a Horovod collective, waits without holding a thread: the
    trace shows no op running meanwhile. A step busy for as long is not idle."""
    queue = tf.queue.FIFOQueue(4, tf.float32, shapes=[])

    def _train_step_eager() -> tf.Tensor:
        return queue.dequeue() + 1.0

    waiting = tf.function(_train_step_eager)

    def enqueue_later() -> None:
        def put() -> None:
            time.sleep(WAIT_S)
            queue.enqueue(2.0)

        threading.Thread(target=put, daemon=True).start()

    _traced_steps(tmp_path / "waiting", lambda: waiting().numpy(), enqueue_later)
    idle, total, steps = idle_seconds(tmp_path / "waiting")
    assert steps == 2
    assert 2 * WAIT_S * 0.8 <= idle <= total, (idle, total)

    def sleep(x: np.ndarray) -> np.ndarray:
        time.sleep(WAIT_S)  # an op that runs (holds its thread) the whole time
        return x

    def _train_step_eager_busy(x: tf.Tensor) -> tf.Tensor:
        return tf.numpy_function(sleep, [x], tf.float32) + 1.0

    busy = tf.function(_train_step_eager_busy)
    _traced_steps(tmp_path / "busy", lambda: busy(tf.constant(1.0)).numpy())
    idle, total, steps = idle_seconds(tmp_path / "busy", step_function="_train_step_eager_busy")
    assert steps == 2 and total >= 2 * WAIT_S
    # Calling the op and taking the GIL around it count as idle; on a loaded machine
    # (another test worker beside this one) that reached 28 % of the step, against
    # 80 % and more for the waiting step above.
    assert idle < 0.5 * total, (idle, total)


def test_a_trace_without_the_step_says_so(tmp_path: Path) -> None:
    other = tf.function(lambda: tf.constant(1.0) + 1.0)
    _traced_steps(tmp_path / "other", lambda: other().numpy())
    with pytest.raises(RuntimeError, match="no run of '_train_step_eager'"):
        idle_seconds(tmp_path / "other")
    with pytest.raises(RuntimeError, match="wrote no trace"):
        idle_seconds(tmp_path / "missing")


def _timeline(steps: list[dict[str, tuple[float, float, float]]]) -> str:
    """A Horovod timeline as rank 0 writes it (no closing bracket while the job
    runs): per step, per tensor, (negotiation start, execution start, end) in ms."""
    pids = {name: pid for pid, name in enumerate(sorted({n for step in steps for n in step}), 1)}
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
        for name, pid in pids.items()
    ]
    for step in steps:
        for name, (negotiate, execute, end) in step.items():
            pid = pids[name]
            events += [
                {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": negotiate * 1000, "pid": pid},
                {"ph": "E", "ts": execute * 1000, "pid": pid},
                {"ph": "B", "name": "ALLREDUCE", "ts": execute * 1000, "pid": pid},
                {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": execute * 1000 + 1, "pid": pid},
                {"ph": "E", "ts": end * 1000 - 1, "pid": pid},
                {"ph": "E", "ts": end * 1000, "pid": pid},
            ]
    return "[\n" + ",\n".join(json.dumps(e) for e in events) + ","


def test_timeline_seconds_count_transfers_and_time_in_flight(tmp_path: Path) -> None:
    """Executing leaves negotiation (waiting for the other ranks) out, in flight
    counts it; overlapping intervals (one fused allreduce, collectives in flight
    together) count once, and only the last steps count."""
    steps = [
        # warmup step: long, not counted
        {"first": (0, 50, 60), "a": (60, 200, 300), "b": (60, 210, 290)},
        {"first": (1000, 1100, 1110), "a": (1200, 1300, 1340), "b": (1200, 1320, 1350)},
        {"first": (2000, 2005, 2015), "a": (2100, 2150, 2160), "b": (2140, 2150, 2170)},
    ]
    timeline = tmp_path / "timeline.json"
    timeline.write_text(_timeline(steps))
    executing, in_flight = timeline_seconds(timeline, 2, "first")
    # step 1: 10 + (1300..1350) 50; step 2: 10 + (2150..2170) 20
    assert executing == pytest.approx((10 + 50 + 10 + 20) / 1000)
    # step 1: (1000..1110) 110 + (1200..1350) 150; step 2: 15 + (2100..2170) 70
    assert in_flight == pytest.approx((110 + 150 + 15 + 70) / 1000)
    with pytest.raises(ValueError, match="expected at least 4 steps"):
        timeline_seconds(timeline, 4, "first")


def test_exposed_is_the_ranks_mean_and_each_rank_share() -> None:
    ranks = [
        {"idle_seconds": 0.3, "traced_seconds": 3.0, "traced_steps": 6},
        {"idle_seconds": 0.6, "traced_seconds": 2.0, "traced_steps": 6},
    ]
    waiting = exposed(ranks)
    assert waiting["seconds"] == pytest.approx((0.05 + 0.1) / 2)
    assert waiting["per_rank_share"] == pytest.approx([0.1, 0.3])
    assert waiting["share"] == pytest.approx(0.2)
