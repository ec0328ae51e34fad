"""The learning-rate schedule of NVIDIA's DLRM: linear warmup, constant, polynomial
decay to a floor, and the floor forever after (it never rises again)."""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf

from dlrm.train.config import ScheduleConfig

__all__ = ["DlrmSchedule", "ScheduleConfig"]


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
