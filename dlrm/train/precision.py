"""Mixed precision: which Keras dtype policy `--amp` means on this device, and
dynamic loss scaling for float16.

bfloat16 has float32's exponent range, so on CPU (`mixed_bfloat16`) gradients
do not underflow and need no loss scale. float16 on GPU (`mixed_float16`) does:
the loss is multiplied by a scale before backprop, gradients are divided by it,
and a step whose loss or gradients overflow is skipped and the scale halved.
"""

from __future__ import annotations

import dataclasses
import os
import time

import tensorflow as tf

# The matmul `--amp` on a CPU is timed with at start: big enough for oneDNN's
# blocked kernels, small enough to cost a few tenths of a second in all.
PROBE_SIZE = 1024


PROBE_REPEATS = 3


@dataclasses.dataclass(frozen=True)
class Precision:
    """What the model computes in, and whether gradients need a loss scale."""

    dtype_policy: str  # "float32", "mixed_bfloat16" or "mixed_float16"

    @property
    def use_loss_scale(self) -> bool:
        return self.dtype_policy == "mixed_float16"

    @property
    def compute_dtype(self) -> tf.DType:
        return {
            "float32": tf.float32,
            "mixed_bfloat16": tf.bfloat16,
            "mixed_float16": tf.float16,
        }[self.dtype_policy]


def choose_precision(use_amp: bool, has_gpu: bool) -> Precision:
    """`--amp` -> mixed_float16 on the GPU code path (tensor cores), mixed_bfloat16
    on CPU. The CPU-only CI machines run the GPU branch with its loss scaling too
    (`dlrm.distributed.devices.gpu_code_path`: float16 emulated on the CPU).
    """
    if not use_amp:
        return Precision("float32")
    return Precision("mixed_float16" if has_gpu else "mixed_bfloat16")


def matmul_gflops(dtype: tf.DType, size: int = PROBE_SIZE, repeats: int = PROBE_REPEATS) -> float:
    """Best GFLOP/s of a [size, size] x [size, size] matmul in `dtype` on this
    device, after one untimed run. Its inputs are stateless random numbers: the
    seeded random state the model is initialised from stays as it was."""
    a = tf.cast(tf.random.stateless_uniform([size, size], seed=[1, 2]), dtype)
    b = tf.cast(tf.random.stateless_uniform([size, size], seed=[3, 4]), dtype)
    tf.matmul(a, b).numpy()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        tf.matmul(a, b).numpy()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-9) / 1e9


def bfloat16_note(float32_gflops: float, bfloat16_gflops: float) -> str:
    """What `--amp` on a CPU prints at start: how fast this CPU multiplies in each
    precision and, where bfloat16 is the slower, that `--amp` will likely make
    training slower here.

    Some CPUs report AVX-512 BF16 and still multiply bfloat16 at about half their
    float32 speed, others at twice it (docs/performance.md#defaults-chosen-by-measurement).
    """
    speeds = (
        f"--amp: this CPU multiplies {PROBE_SIZE}x{PROBE_SIZE} matrices at "
        f"{bfloat16_gflops:.0f} GFLOP/s in bfloat16 and {float32_gflops:.0f} in float32"
    )
    if bfloat16_gflops >= float32_gflops:
        return speeds
    return (
        f"{speeds}. WARNING: bfloat16 is the slower here, so --amp will likely make "
        f"training slower than float32; leave --amp off on this machine"
    )


# The loss scale float16 training starts from (TensorFlow's LossScaleOptimizer's).
INITIAL_LOSS_SCALE = 2.0**15
# A hidden testing switch (no flag): another initial loss scale, e.g. a huge one
# that makes the first steps overflow.
INITIAL_LOSS_SCALE_ENV = "DLRM_INITIAL_LOSS_SCALE"


def initial_loss_scale() -> float:
    """`INITIAL_LOSS_SCALE`, or `DLRM_INITIAL_LOSS_SCALE` where the environment sets
    it (for tests that force an overflow); ValueError naming it when it is not a
    positive number."""
    text = os.environ.get(INITIAL_LOSS_SCALE_ENV)
    if text is None:
        return INITIAL_LOSS_SCALE
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= tf.float32.max:  # the scale is a float32
        raise ValueError(f"{INITIAL_LOSS_SCALE_ENV}: expected a positive number, got {text!r}")
    return value


class DynamicLossScale:
    """Loss scale that halves on overflow and doubles after `growth_interval`
    finite steps in a row (the schedule TensorFlow's LossScaleOptimizer uses).

    Its state is three variables, saved in checkpoints: the scale, the finite
    steps since it last changed, and the steps skipped in a row (overflows).
    """

    def __init__(
        self,
        initial_scale: float = INITIAL_LOSS_SCALE,
        growth_interval: int = 2000,
        minimum: float = 1.0,
    ) -> None:
        self.growth_interval = growth_interval
        self.minimum = minimum
        self.scale = tf.Variable(initial_scale, dtype=tf.float32, trainable=False, name="scale")
        self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="good_steps")
        self.skipped_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped_steps")

    def update(self, finite: tf.Tensor) -> None:
        """After a step: grow the scale, or, when the step's loss or gradients
        overflowed (`finite` false: the step was skipped), halve it."""

        def on_finite() -> None:
            grow = self.good_steps + 1 >= self.growth_interval
            self.scale.assign(tf.where(grow, self.scale * 2.0, self.scale))
            self.good_steps.assign(tf.where(grow, tf.constant(0, tf.int64), self.good_steps + 1))
            self.skipped_steps.assign(0)

        def on_overflow() -> None:
            self.scale.assign(tf.maximum(self.scale / 2.0, self.minimum))
            self.good_steps.assign(0)
            self.skipped_steps.assign_add(1)

        tf.cond(finite, on_finite, on_overflow)
