"""Learning-rate schedule values."""

from __future__ import annotations

import numpy as np
import pytest

from dlrm.train.schedule import DlrmSchedule, ScheduleConfig


def values(config: ScheduleConfig, steps: range) -> np.ndarray:
    schedule = DlrmSchedule(config)
    return np.array([float(schedule(s)) for s in steps])


def test_warmup_constant_decay_floor() -> None:
    config = ScheduleConfig(24.0, warmup_steps=4, decay_start_step=10, decay_steps=4,
                            end_learning_rate=1.0)  # fmt: skip
    lr = values(config, range(20))
    np.testing.assert_allclose(lr[:4], [6.0, 12.0, 18.0, 24.0])
    np.testing.assert_allclose(lr[4:11], 24.0)
    # (1 - progress)^2 from 24 down to 1 over 4 steps.
    np.testing.assert_allclose(lr[11:14], [1 + 23 * 0.75**2, 1 + 23 * 0.5**2, 1 + 23 * 0.25**2])
    np.testing.assert_allclose(lr[14:], 1.0)
    assert np.all(np.diff(lr[4:]) <= 0)  # never rises after warmup


def test_no_warmup_no_decay_is_constant() -> None:
    np.testing.assert_allclose(values(ScheduleConfig(0.5), range(5)), 0.5)


def test_serialisation_round_trip() -> None:
    config = ScheduleConfig(2.0, 3, 5, 7, 1.5, 0.1)
    again = DlrmSchedule.from_config(DlrmSchedule(config).get_config())
    assert again.config == config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"learning_rate": 0.0}, "--learning_rate: expected > 0"),
        ({"learning_rate": 1.0, "warmup_steps": -1}, "--warmup_steps: expected >= 0"),
        ({"learning_rate": 1.0, "warmup_steps": 9, "decay_start_step": 5, "decay_steps": 2},
         "--decay_start_step: expected >= --warmup_steps \\(9\\), got 5"),
        ({"learning_rate": 1.0, "decay_start_step": 5}, "--decay_steps: expected > 0"),
        ({"learning_rate": 1.0, "end_learning_rate": 2.0}, "--decay_end_lr: expected in"),
    ],
)  # fmt: skip
def test_invalid_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScheduleConfig(**kwargs)
