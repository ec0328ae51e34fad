"""--amp policy choice and the float16 dynamic loss scale (run on CPU)."""

from __future__ import annotations

import pytest
import tensorflow as tf

from dlrm.train.precision import (
    INITIAL_LOSS_SCALE,
    INITIAL_LOSS_SCALE_ENV,
    DynamicLossScale,
    bfloat16_note,
    choose_precision,
    initial_loss_scale,
    matmul_gflops,
)


def test_policy_per_device() -> None:
    assert choose_precision(False, has_gpu=True).dtype_policy == "float32"
    cpu = choose_precision(True, has_gpu=False)
    assert cpu.dtype_policy == "mixed_bfloat16" and not cpu.use_loss_scale
    gpu = choose_precision(True, has_gpu=True)
    assert gpu.dtype_policy == "mixed_float16" and gpu.use_loss_scale
    assert gpu.compute_dtype == tf.float16


def test_loss_scale_halves_on_overflow_and_grows_after_interval() -> None:
    scale = DynamicLossScale(initial_scale=1024.0, growth_interval=3)
    scale.update(tf.constant(False))
    assert float(scale.scale.numpy()) == 512.0
    for _ in range(2):
        scale.update(tf.constant(True))
    assert float(scale.scale.numpy()) == 512.0
    scale.update(tf.constant(True))
    assert float(scale.scale.numpy()) == 1024.0
    assert int(scale.good_steps.numpy()) == 0


def test_loss_scale_counts_the_steps_skipped_in_a_row() -> None:
    scale = DynamicLossScale(initial_scale=8.0)
    for finite, skipped in [(False, 1), (False, 2), (True, 0), (False, 1)]:
        scale.update(tf.constant(finite))
        assert int(scale.skipped_steps.numpy()) == skipped
    assert float(scale.scale.numpy()) == 1.0


def test_the_initial_loss_scale_is_2_to_the_15_unless_the_environment_sets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(INITIAL_LOSS_SCALE_ENV, raising=False)
    assert initial_loss_scale() == INITIAL_LOSS_SCALE == 2.0**15
    monkeypatch.setenv(INITIAL_LOSS_SCALE_ENV, "1e30")
    assert initial_loss_scale() == 1e30
    for bad in ("0", "-4", "1e39", "inf", "nan", "huge"):
        monkeypatch.setenv(INITIAL_LOSS_SCALE_ENV, bad)
        with pytest.raises(ValueError, match=f"DLRM_INITIAL_LOSS_SCALE: .* got '{bad}'"):
            initial_loss_scale()


def test_loss_scale_never_below_minimum_inside_tf_function() -> None:
    scale = DynamicLossScale(initial_scale=2.0, minimum=1.0)

    @tf.function
    def overflow() -> None:
        scale.update(tf.constant(False))

    for _ in range(3):
        overflow()
    assert float(scale.scale.numpy()) == 1.0


def test_the_amp_note_warns_only_where_bfloat16_multiplies_slower() -> None:
    fast = bfloat16_note(float32_gflops=205.0, bfloat16_gflops=400.4)
    assert fast == (
        "--amp: this CPU multiplies 1024x1024 matrices at 400 GFLOP/s in bfloat16 and 205 in "
        "float32"
    )
    slow = bfloat16_note(float32_gflops=289.0, bfloat16_gflops=163.0)
    assert slow.startswith("--amp: this CPU multiplies 1024x1024 matrices at 163 GFLOP/s")
    assert "WARNING: bfloat16 is the slower here" in slow
    assert "leave --amp off on this machine" in slow


def test_matmul_speed_is_measured_in_each_precision_without_drawing_seeded_numbers() -> None:
    tf.random.set_seed(7)
    expected = tf.random.uniform([4]).numpy()
    tf.random.set_seed(7)
    for dtype in (tf.float32, tf.bfloat16):
        assert matmul_gflops(dtype, size=128, repeats=2) > 0
    # The model's initialisers draw the numbers they would have without the timing.
    assert (tf.random.uniform([4]).numpy() == expected).all()
