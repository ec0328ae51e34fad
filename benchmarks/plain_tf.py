"""The baseline: DLRM as a user writes it by hand in plain TensorFlow 2.

    python benchmarks/plain_tf.py [--batch_size 8192] [--steps 12] [--warmup 3]
        [--amp] [--xla] [--tables 26] [--rows 100000]
        [--cardinalities 2000,...] [--hotness 3,2,...] [--embedding_dim 128]
        [--bottom 512,256,128] [--top 1024,1024,512,256,1]
        [--interaction dot|cross] [--cross_layers 3] [--projection 512]
        [--optimizer sgd|adagrad|adam] [--learning_rate 0.1]

No project code: one `tf.Variable` per table, `tf.gather` (and a sum over a
row's ids for multi-hot tables), Keras `Dense` layers, the dot interaction or
DCNv2's cross layers written out, one `tf.function` step and a Keras
optimizer's `apply_gradients`, fed random in-memory batches. The defaults are
the project's default model with SGD; `benchmarks/suite.py` also runs it as the
scaled-down MLPerf DLRM-DCNv2 (`--interaction cross`, multi-hot, Adam). `--amp` sets Keras's
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
    dim = args.embedding_dim
    tables = [
        tf.Variable(
            tf.random.uniform([rows, dim], -((1.0 / rows) ** 0.5), (1.0 / rows) ** 0.5),
            name=f"table_{t}",
        )
        for t, rows in enumerate(args.cardinalities)
    ]
    bottom = keras.Sequential([keras.layers.Dense(w, activation="relu") for w in args.bottom])
    *hidden, last = args.top
    top = keras.Sequential(
        [keras.layers.Dense(w, activation="relu") for w in hidden] + [keras.layers.Dense(last)]
    )
    interact, interaction_layers = build_interaction(args, len(tables))
    optimizer = {
        "sgd": keras.optimizers.SGD,
        "adagrad": keras.optimizers.Adagrad,
        "adam": keras.optimizers.Adam,
    }[args.optimizer](learning_rate=args.learning_rate)

    def forward(numerical: tf.Tensor, ids: list[tf.Tensor]) -> tf.Tensor:
        dense = bottom(numerical)
        vectors = [
            tf.gather(table, table_ids[:, 0])
            if table_ids.shape[1] == 1
            else tf.reduce_sum(tf.gather(table, table_ids), axis=1)
            for table, table_ids in zip(tables, ids, strict=True)
        ]
        return tf.cast(top(interact(dense, vectors)), tf.float32)

    # Build the layers.
    forward(tf.zeros([1, 13]), [tf.zeros([1, hot], tf.int32) for hot in args.hotness])
    variables = [*bottom.trainable_variables, *top.trainable_variables, *tables]
    for layer in interaction_layers:
        variables += layer.trainable_variables

    @tf.function(jit_compile=args.xla)
    def step(numerical: tf.Tensor, ids: list[tf.Tensor], labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            logits = forward(numerical, ids)
            loss = tf.reduce_mean(
                tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
            )
        gradients = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(gradients, variables, strict=True))
        return loss

    return step


def build_interaction(args: argparse.Namespace, tables: int):  # type: ignore[no-untyped-def]
    """The interaction of the bottom MLP's output with the vectors (the top
    MLP's input), and its layers."""
    if args.interaction == "cross":
        width = args.bottom[-1] + tables * args.embedding_dim
        # DCNv2: x_{l+1} = x0 * (U_l V_l x_l + b_l) + x_l.
        downs = [
            keras.layers.Dense(args.projection, use_bias=False) for _ in range(args.cross_layers)
        ]
        ups = [keras.layers.Dense(width) for _ in range(args.cross_layers)]

        def cross(dense: tf.Tensor, vectors: list[tf.Tensor]) -> tf.Tensor:
            x0 = tf.concat([dense, *(tf.cast(v, dense.dtype) for v in vectors)], 1)
            x = x0
            for down, up in zip(downs, ups, strict=True):
                x = x0 * up(down(x)) + x
            return x

        return cross, [*downs, *ups]
    n = tables + 1
    rows, cols = np.tril_indices(n, k=-1)
    pairs = tf.constant(rows * n + cols, tf.int32)

    def dot(dense: tf.Tensor, vectors: list[tf.Tensor]) -> tf.Tensor:
        stacked = tf.concat([dense[:, None, :], tf.cast(tf.stack(vectors, 1), dense.dtype)], 1)
        gram = tf.matmul(stacked, stacked, transpose_b=True)
        return tf.concat([dense, tf.gather(tf.reshape(gram, [-1, n * n]), pairs, axis=1)], 1)

    return dot, []


def integers(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch_size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--xla", action="store_true")
    parser.add_argument(
        "--cardinalities", type=integers, help="rows per table (default: --tables x --rows)"
    )
    parser.add_argument("--hotness", type=integers, help="ids per row per table (default 1 each)")
    parser.add_argument("--embedding_dim", type=int, default=128)
    parser.add_argument("--bottom", type=integers, default=[512, 256, 128])
    parser.add_argument("--top", type=integers, default=[1024, 1024, 512, 256, 1])
    parser.add_argument("--interaction", choices=("dot", "cross"), default="dot")
    parser.add_argument("--cross_layers", type=int, default=3)
    parser.add_argument("--projection", type=int, default=512)
    parser.add_argument("--optimizer", choices=("sgd", "adagrad", "adam"), default="sgd")
    parser.add_argument("--learning_rate", type=float, default=0.1)
    args = parser.parse_args()
    args.cardinalities = args.cardinalities or [args.rows] * args.tables
    args.hotness = args.hotness or [1] * len(args.cardinalities)
    if len(args.hotness) != len(args.cardinalities) or min(args.hotness) < 1:
        parser.error(
            f"--hotness: expected one count >= 1 per table ({len(args.cardinalities)}), "
            f"got {args.hotness}"
        )
    if args.embedding_dim != args.bottom[-1] and args.interaction == "dot":
        parser.error("--bottom: the dot interaction needs its last width equal --embedding_dim")
    step = build_step(args)
    generator = np.random.default_rng(0)
    batches = [
        (
            tf.constant(generator.random((args.batch_size, 13), np.float32)),
            [
                tf.constant(generator.integers(0, rows, (args.batch_size, hot), np.int32))
                for rows, hot in zip(args.cardinalities, args.hotness, strict=True)
            ],
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
