"""What a run tells its user: a progress line, a JSON-lines metrics log and
TensorBoard scalars. Only the reporting rank (rank 0) writes."""

from __future__ import annotations

import datetime
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import tensorflow as tf


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    return str(datetime.timedelta(seconds=round(seconds)))


class MetricsLog:
    """One JSON object per line in `path` (append mode), and TensorBoard
    scalars in `tensorboard_dir`; either may be None.

    Every record has `event` ("train", "eval", "summary", ...) and `time`
    (Unix seconds); numeric fields also go to TensorBoard as `<event>/<key>`.
    """

    def __init__(
        self,
        path: Path | None,
        tensorboard_dir: Path | None,
        enabled: bool = True,
        console: TextIO | None = None,
    ) -> None:
        self.enabled = enabled
        self.console = console or sys.stdout
        self._file: TextIO | None = None
        self._writer: Any = None
        if not enabled:
            return
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
        if tensorboard_dir is not None:
            self._writer = tf.summary.create_file_writer(str(tensorboard_dir))

    def write(self, event: str, step: int | None = None, **values: Any) -> None:
        if not self.enabled:
            return
        record = {"event": event, "time": round(time.time(), 3)}
        if step is not None:
            record["step"] = step
        record.update(values)
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=False) + "\n")
            self._file.flush()
        if self._writer is not None and step is not None:
            with self._writer.as_default(step=step):
                for key, value in values.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        tf.summary.scalar(f"{event}/{key}", value)
            self._writer.flush()

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.console, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class Throughput:
    """Samples per second between two marks, and the ETA to a step count."""

    def __init__(self, batch_size: int, start_step: int, total_steps: int) -> None:
        self.batch_size = batch_size
        self.total_steps = total_steps
        self._mark_time = time.perf_counter()
        self._mark_step = start_step

    def mark(self, step: int) -> tuple[float, float]:
        """(samples/s since the previous mark, seconds left) at `step`."""
        now = time.perf_counter()
        steps = step - self._mark_step
        elapsed = max(now - self._mark_time, 1e-9)
        self._mark_time, self._mark_step = now, step
        samples_per_second = steps * self.batch_size / elapsed
        per_step = elapsed / steps if steps else float("nan")
        return samples_per_second, per_step * (self.total_steps - step)


def peak_memory() -> dict[str, Any]:
    """This process's peak memory so far, and of what: the TensorFlow allocator's
    peak on the first visible GPU (`peak_memory_of` "gpu"; a rank sees its own
    GPU only, `dlrm.distributed.devices.pin_gpu`) when TensorFlow uses one,
    else the process's peak RSS ("process_rss", which counts the host memory
    of everything, the embedding tables included)."""
    if tf.config.get_visible_devices("GPU"):
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
        return {"peak_memory_bytes": int(peak), "peak_memory_of": "gpu"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_memory_bytes": int(rss), "peak_memory_of": "process_rss"}
