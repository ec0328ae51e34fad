"""The baseline: DLRM as a user writes it by hand in plain TensorFlow 2.

    python benchmarks/plain_tf.py [--batch_size 8192] [--steps 12] [--warmup 3]
        [--amp] [--xla] [--tables 26] [--rows 100000]

No project code: one `tf.Variable` per table, `tf.gather`, Keras `Dense` layers,
the dot interaction, one `tf.function` step and `keras.optimizers.SGD`'s
`apply_gradients`, fed random in-memory batches. `--amp` sets Keras's
`mixed_bfloat16` policy (the tables stay float32); `--xla` compiles the whole
step with `jit_compile=True`. Prints one JSON line: samples/s (median over the
timed steps), the final loss and this process's peak RSS.

`benchmarks/suite.py` (`make bench`) runs it beside the project's own training
in the same invocation, so that their ratio is measured on one machine state.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf


def build_step(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The model's variables and its training step, the plain way."""
    if args.amp:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    dim = 128
    scale = (1.0 / args.rows) ** 0.5
    tables = [
        tf.Variable(tf.random.uniform([args.rows, dim], -scale, scale), name=f"table_{t}")
        for t in range(args.tables)
    ]
    bottom = keras.Sequential([keras.layers.Dense(w, activation="relu") for w in (512, 256, 128)])
    top = keras.Sequential(
        [keras.layers.Dense(w, activation="relu") for w in (1024, 1024, 512, 256)]
        + [keras.layers.Dense(1)]
    )
    n = args.tables + 1
    rows, cols = np.tril_indices(n, k=-1)
    pairs = tf.constant(rows * n + cols, tf.int32)
    optimizer = keras.optimizers.SGD(learning_rate=0.1)

    def forward(numerical: tf.Tensor, ids: tf.Tensor) -> tf.Tensor:
        dense = bottom(numerical)
        vectors = [tf.gather(table, ids[:, t]) for t, table in enumerate(tables)]
        stacked = tf.concat([dense[:, None, :], tf.cast(tf.stack(vectors, 1), dense.dtype)], 1)
        gram = tf.matmul(stacked, stacked, transpose_b=True)
        flat = tf.gather(tf.reshape(gram, [-1, n * n]), pairs, axis=1)
        return tf.cast(top(tf.concat([dense, flat], 1)), tf.float32)

    forward(tf.zeros([1, 13]), tf.zeros([1, args.tables], tf.int32))  # build the layers
    variables = [*bottom.trainable_variables, *top.trainable_variables, *tables]

    @tf.function(jit_compile=args.xla)
    def step(numerical: tf.Tensor, ids: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            logits = forward(numerical, ids)
            loss = tf.reduce_mean(
                tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
            )
        gradients = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(gradients, variables, strict=True))
        return loss

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch_size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--xla", action="store_true")
    args = parser.parse_args()
    step = build_step(args)
    generator = np.random.default_rng(0)
    batches = [
        (
            tf.constant(generator.random((args.batch_size, 13), np.float32)),
            tf.constant(generator.integers(0, args.rows, (args.batch_size, args.tables), np.int32)),
            tf.constant(generator.integers(0, 2, (args.batch_size, 1)).astype(np.float32)),
        )
        for _ in range(4)
    ]
    times = []
    loss = float("nan")
    for index in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = float(step(*batches[index % len(batches)]).numpy())
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    result = {
        "samples_per_second": args.batch_size / statistics.median(times),
        "loss": loss,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
