"""The learning-rate schedule of NVIDIA's DLRM: linear warmup, constant, polynomial
decay to a floor, and the floor forever after (it never rises again)."""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf


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
                f"end learning rate: expected in [0, {self.learning_rate}], "
                f"got {self.end_learning_rate}"
            )


class DlrmSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """lr(step) for a 0-based optimizer step (the step being taken)."""

    def __init__(self, config: ScheduleConfig) -> None:
        self.config = config

    def __call__(self, step: Any) -> tf.Tensor:
        c = self.config
        step = tf.cast(step, tf.float32)
        base = tf.constant(c.learning_rate, tf.float32)
        # Warmup: from base/warmup at step 0 up to base at step warmup-1.
        warmup = base * tf.minimum(1.0, (step + 1.0) / max(c.warmup_steps, 1))
        if not c.decay_start_step:
            return warmup
        progress = tf.clip_by_value((step - c.decay_start_step) / c.decay_steps, 0.0, 1.0)
        decayed = (
            c.end_learning_rate + (base - c.end_learning_rate) * (1.0 - progress) ** c.decay_power
        )
        return tf.where(step < c.decay_start_step, warmup, decayed)

    def get_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self.config)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DlrmSchedule:
        return cls(ScheduleConfig(**config))
