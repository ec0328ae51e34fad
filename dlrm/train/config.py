"""The trainer's settings that need no TensorFlow: the learning-rate schedule's,
and how many rows of a batch the dense part runs at a time."""

from __future__ import annotations

import dataclasses

# The dense part's chunk on CPUs (`dense_chunk_rows`): as fast as the whole batch, with
# the activations of a chunk alive instead of the batch's. GPUs run the whole batch:
# they want large matrices. Measured: docs/performance.md#defaults-chosen-by-measurement.
DEFAULT_CPU_DENSE_CHUNK_ROWS = 8192
# On several ranks each chunk's vectors cross between the ranks on their own, so a
# rank's batch is cut into at least this many chunks (of at least the minimum rows)
# for one chunk's alltoalls to overlap another's compute (same page).
PIPELINED_CHUNKS = 4
MIN_PIPELINED_CHUNK_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    learning_rate: float
    warmup_steps: int = 0
    decay_start_step: int = 0  # 0: no decay
    decay_steps: int = 0
    decay_power: float = 2.0
    end_learning_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.learning_rate <= 0:
            raise ValueError(f"--learning_rate: expected > 0, got {self.learning_rate}")
        for name in ("warmup_steps", "decay_start_step", "decay_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name}: expected >= 0, got {getattr(self, name)}")
        if self.decay_start_step and self.decay_start_step < self.warmup_steps:
            raise ValueError(
                f"--decay_start_step: expected >= --warmup_steps ({self.warmup_steps}), "
                f"got {self.decay_start_step}"
            )
        if self.decay_start_step and not self.decay_steps:
            raise ValueError("--decay_steps: expected > 0 when --decay_start_step is set, got 0")
        if not 0 <= self.end_learning_rate <= self.learning_rate:
            raise ValueError(
                f"--decay_end_lr: expected in [0, --learning_rate ({self.learning_rate})], "
                f"got {self.end_learning_rate}"
            )
