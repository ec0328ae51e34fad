"""The rows of a batch in chunks: the dense part runs over them one after another.

On CPUs the dense part of a step (MLPs, interaction and their gradients) runs
over chunks of a rank's batch (`--dense_chunk_rows`), each after the one
before, and their gradients are summed. The loss divides by the global batch
size, so the sum is the whole batch's gradient, up to the order of the
additions. What it buys is memory: only a chunk's activations (two where a
chunk starts before the previous one has finished) are alive at a time, so a
batch of 65536 in chunks of 8192 needs the activations of 8192 to 16384 rows,
not of 65536 (`docs/performance.md`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf


def chunk_bounds(rows: int | None, chunk_rows: int) -> list[tuple[int, int | None]]:
    """[(start, stop)] of consecutive chunks of `chunk_rows` rows covering `rows`
    (the last one shorter when they do not divide); one chunk of the whole batch
    when `chunk_rows` is 0, `rows` is unknown when tracing, or the batch is no
    larger than a chunk."""
    if rows is None or chunk_rows <= 0 or rows <= chunk_rows:
        return [(0, rows)]
    return [(start, min(start + chunk_rows, rows)) for start in range(0, rows, chunk_rows)]


def in_sequence(
    bounds: Sequence[tuple[int, int | None]],
    inputs: Sequence[tf.Tensor | list[tf.Tensor]],
    run: Callable[..., Any],
    wait_for: Callable[[Any], Sequence[tf.Tensor]] = tf.nest.flatten,
) -> list[Any]:
    """`run(*chunk)` on each chunk of `inputs` (rows `start:stop` of each; an
    input given as a list already holds one tensor per chunk), each chunk's
    slices made only once `wait_for` of the previous chunk's outputs exist (by
    default all of them): in a graph, TensorFlow would otherwise run the chunks
    side by side and keep all their activations at once. Returns each chunk's
    outputs; one chunk is the inputs as they are, not sliced."""
    if len(bounds) == 1:
        return [run(*[x[0] if isinstance(x, list) else x for x in inputs])]
    outputs: list[Any] = []
    previous: Sequence[tf.Tensor] = []
    for k, (start, stop) in enumerate(bounds):
        with tf.control_dependencies(previous):
            chunk = [
                tf.identity(tensor[k]) if isinstance(tensor, list) else tensor[start:stop]
                for tensor in inputs
            ]
        result = run(*chunk)
        outputs.append(result)
        previous = wait_for(result)
    return outputs


def concat_rows(chunks: Sequence[tf.Tensor]) -> tf.Tensor:
    """The chunks' rows as one tensor, in order (one chunk as it is)."""
    return chunks[0] if len(chunks) == 1 else tf.concat(list(chunks), axis=0)
