"""One training step of DLRM.

A step is one `tf.function` in four parts, so that `--xla` compiles only what
XLA handles well and the collectives of sharded embeddings run outside both the
compiled function and autodiff:

1. embedding lookup: input distribution and local lookup, recorded on a tape,
   then the output distribution (alltoall when sharded) to [L, T, D] vectors;
   with several chunks (below) on several ranks, each chunk's rows are looked
   up and cross between the ranks on their own, so that a chunk's exchange,
   forward and backward, overlaps another chunk's dense part;
2. the dense part: bottom MLP, interaction, top MLP, loss and the gradients of
   the loss with respect to the dense weights *and the vectors*, in one
   function that `--xla` compiles with `jit_compile=True`, run over chunks of
   `dense_chunk_rows` rows one after another (`dlrm.row_chunks`), their
   gradients summed;
3. the embedding backward: the vectors' gradient through the output
   distribution (the reverse alltoall, on every rank), then through the local
   lookup (`tape.gradient(..., output_gradients=...)`), giving row-sparse
   `tf.IndexedSlices` that the optimizer applies to the rows looked up only
   (SGD on one process with the CPU kernels' fused lookup skips this: the
   tables are updated from the vectors' gradient as it is, `apply_fused_sgd`);
4. the data-parallel gradients (dense weights, replicated tables) summed over
   ranks, and the update, applied only when every rank's loss and gradients
   are finite: each rank's verdict on its own loss and vectors' gradient is
   summed with the gradients (no collective of its own), and every rank checks
   the sums alike.

The loss is the weighted sum of binary cross-entropies divided by the *global*
batch size, so that per-rank gradients add up to the 1-rank gradient.

A step whose loss or gradients are not finite is not applied. Under float16
loss scaling that is the normal overflow handling (the scale halves); otherwise
the first such step is remembered in `first_non_finite_step`, and the caller
stops training with `NonFiniteLossError` at its next check, with the weights
still those of the last good step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import tensorflow as tf

from dataloading.split_binary import Batch
from dlrm import kernels
from dlrm.dist import Collectives
from dlrm.model import Dlrm
from dlrm.optimizers import Optimizer, Sgd
from dlrm.precision import DynamicLossScale, Precision
from dlrm.row_chunks import chunk_bounds, concat_rows, in_sequence

DENSE_EXCHANGE = "dense"


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss or gradient."""

    def __init__(self, step: int, loss: float, precision: Precision, learning_rate: float) -> None:
        hints = [f"lower --learning_rate (now {learning_rate:g}) or add --warmup_steps"]
        if precision.use_loss_scale:
            hints.append("check the float16 loss scale (try without --amp)")
        elif precision.dtype_policy != "float32":
            hints.append("try without --amp")
        hints.append("check the numerical features for huge values (preprocessing applies log)")
        super().__init__(
            f"training diverged: the loss or a gradient was not finite at step {step} "
            f"(loss {loss}); the step was not applied and no checkpoint was written after it. "
            f"Likely causes: {'; '.join(hints)}."
        )
        self.step = step


def all_finite(gradients: Sequence[Any], use_kernel: bool = False) -> tf.Tensor:
    """Whether no value of `gradients` (tensors or IndexedSlices) is NaN or
    infinite: a bool scalar. `use_kernel`: one pass of the project's CPU kernel
    (`dlrm.kernels`), where TensorFlow's ops write a bool tensor as large as
    each gradient and reduce it (a tenth of the default model's step)."""
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in gradients]
    if use_kernel:
        return kernels.require().dlrm_all_finite(values)
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]))


def _scale(gradient: Any, factor: tf.Tensor) -> Any:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return gradient * factor


class Trainer:
    """Trains a `Dlrm` one global batch at a time.

    Args:
        model: the model (its variables are created here if needed).
        optimizer: applied to dense and embedding variables alike.
        learning_rate: lr as a function of the 0-based step (a `DlrmSchedule`).
        precision: the dtype policy the model was built with.
        global_batch_size: the loss divides by it (the same on every rank).
        use_xla: compile the dense part with XLA.
        dense_chunk_rows: run the dense part over chunks of this many of the
            rank's rows, one after another, and sum their gradients (0: the
            whole batch at once). Bounds the activations' memory.
        collectives: the ranks. Dense gradients and those of replicated
            (data-parallel) tables are summed over ranks; model-parallel shards'
            gradients already are the global loss's. One process by default.
    """

    def __init__(
        self,
        model: Dlrm,
        optimizer: Optimizer,
        learning_rate: Callable[[tf.Tensor], tf.Tensor],
        precision: Precision,
        global_batch_size: int,
        use_xla: bool = False,
        collectives: Collectives | None = None,
        dense_chunk_rows: int = 0,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.precision = precision
        self.global_batch_size = global_batch_size
        self.use_xla = use_xla
        self.dense_chunk_rows = dense_chunk_rows
        self.collectives = collectives or Collectives()
        model.build_all()
        self.dense_variables = list(model.dense_variables)
        self.embedding_variables = [variable for _, variable in model.embeddings.local_shards()]
        self._exchange = [model.embeddings.gradient_exchange(v) for v in self.embedding_variables]
        self._names = [shard.name for shard, _ in model.embeddings.local_shards()]
        optimizer.build(self.dense_variables + self.embedding_variables)
        # Batches consumed: drives the schedule and the data position on resume.
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self.first_non_finite_step = tf.Variable(
            -1, dtype=tf.int64, trainable=False, name="first_non_finite_step"
        )
        self.first_non_finite_loss = tf.Variable(
            0.0, dtype=tf.float32, trainable=False, name="first_non_finite_loss"
        )
        self.loss_scale = DynamicLossScale() if precision.use_loss_scale else None
        self._fused_sgd = isinstance(optimizer, Sgd) and self.collectives.world_size == 1
        self._dense_step = tf.function(self._dense_step_eager, jit_compile=use_xla)
        self._train_step = tf.function(self._train_step_eager)

    # -------------------------------------------------------------- training

    def _dense_step_eager(
        self,
        numerical: tf.Tensor,
        vectors: tf.Tensor,
        label: tf.Tensor,
        weight: tf.Tensor,
        loss_scale: tf.Tensor,
    ) -> tuple[tf.Tensor, list[tf.Tensor], tf.Tensor]:
        with tf.GradientTape() as tape:
            tape.watch(vectors)
            logits = self.model.dense_forward(numerical, vectors)
            losses = tf.nn.sigmoid_cross_entropy_with_logits(labels=label, logits=logits)
            loss = tf.reduce_sum(losses * weight) / self.global_batch_size
            scaled_loss = loss * loss_scale
        gradients = tape.gradient(scaled_loss, [*self.dense_variables, vectors])
        return loss, gradients[:-1], gradients[-1]

    def _dense_gradients(
        self,
        bounds: list[tuple[int, int | None]],
        numerical: tf.Tensor,
        vectors: tf.Tensor,
        label: tf.Tensor,
        weight: tf.Tensor,
        loss_scale: tf.Tensor,
    ) -> tuple[tf.Tensor, list[tf.Tensor], list[tf.Tensor]]:
        """The dense step over the batch's rows in chunks (`bounds`, from
        `chunk_bounds`): the losses and the weights' gradients summed (each
        chunk's loss already divides by the global batch size), and the
        vectors' gradient of each chunk."""
        # The next chunk starts once this one's vectors' gradient exists, so its
        # forward can run beside the rest of this one's backward (the bottom
        # MLP's, the first top layer's weight gradient) instead of after it; at
        # most two chunks' activations are alive.
        chunks = in_sequence(
            bounds,
            [numerical, vectors, label, weight],
            lambda *chunk: self._dense_step(*chunk, loss_scale),
            wait_for=lambda outputs: [outputs[2]],
        )
        loss, dense_gradients, _ = chunks[0]
        for chunk_loss, gradients, _ in chunks[1:]:
            loss = loss + chunk_loss
            dense_gradients = [a + b for a, b in zip(dense_gradients, gradients, strict=True)]
        return loss, dense_gradients, [chunk[2] for chunk in chunks]

    def _train_step_eager(self, batch: Batch) -> tf.Tensor:
        learning_rate = self.learning_rate(self.step)
        embeddings = self.model.embeddings
        local_rows = tf.shape(batch.numerical)[0]
        # SGD on one process with the fused lookup kernel: the tables are updated
        # from the vectors' gradient as it is (`apply_fused_sgd`): no gradient
        # through the tape, no split of it into per-table gradients.
        fused_ids = embeddings.fused_ids(batch.categorical) if self._fused_sgd else None
        scale = self.loss_scale.scale if self.loss_scale else tf.constant(1.0)
        rows = batch.numerical.shape[0]
        bounds = chunk_bounds(rows, self.dense_chunk_rows)
        routed = embeddings.input_distribution(batch.categorical, local_rows)
        # Each chunk's vectors cross between ranks on their own, so that the next
        # chunk's exchange overlaps this chunk's dense part, forward and backward.
        spans = [(start, rows if stop is None else stop) for start, stop in bounds]
        chunk_ids = (
            [embeddings.chunk_ids(routed, rows, start, stop) for start, stop in spans]
            if rows is not None and len(spans) > 1 and fused_ids is None
            else [None]
        )
        chunked = chunk_ids[0] is not None
        if chunked:
            with tf.GradientTape() as tape:
                looked_up = [
                    embeddings.local_lookup(ids, stop - start)
                    for ids, (start, stop) in zip(chunk_ids, spans, strict=True)
                ]
            # Typed by cast, not by an annotation: AutoGraph cannot convert a
            # function whose annotated names are assigned in both branches.
            vectors = cast(
                Any,
                [
                    embeddings.output_distribution(chunk, stop - start, k)
                    for k, (chunk, (start, stop)) in enumerate(zip(looked_up, spans, strict=True))
                ],
            )
        else:
            with tf.GradientTape() as tape:
                looked_up = embeddings.local_lookup(routed, local_rows)
            vectors = embeddings.output_distribution(looked_up, local_rows)
        loss, dense_gradients, vector_gradients = self._dense_gradients(
            bounds, batch.numerical, vectors, batch.label, batch.weight, scale
        )
        if chunked:
            lookup_gradients = [
                embeddings.output_distribution_gradient(gradient, stop - start, k)
                for k, (gradient, (start, stop)) in enumerate(
                    zip(vector_gradients, spans, strict=True)
                )
            ]
            embedding_variables, exchange = self.embedding_variables, self._exchange
        elif fused_ids is None:
            lookup_gradients = embeddings.output_distribution_gradient(
                concat_rows(vector_gradients), local_rows
            )
            embedding_variables, exchange = self.embedding_variables, self._exchange
        else:
            # The fused SGD updates the tables from each chunk's gradient as it
            # is (one process: the vectors are what was looked up), so the
            # chunks' gradients are never copied into one tensor.
            lookup_gradients = vector_gradients
            embedding_variables, exchange = [], []
        embedding_gradients = (
            tape.gradient(looked_up, embedding_variables, output_gradients=lookup_gradients)
            if embedding_variables
            else []
        )
        loss_finite = tf.math.is_finite(loss)
        if self.collectives.world_size > 1:
            # Every rank takes the same decision without a collective of its own:
            # each rank's verdict on what only it holds (its loss, the vectors'
            # gradient it sends and keeps) is summed with the gradients, whose sums
            # every rank then checks alike.
            verdict = tf.cast(
                tf.stack(
                    [
                        tf.logical_not(all_finite(vector_gradients, self.model.use_kernels)),
                        tf.logical_not(loss_finite),
                    ]
                ),
                tf.float32,
            )
            dense_gradients, embedding_gradients, verdicts = self._allreduce(
                dense_gradients, embedding_gradients, verdict
            )
        gradients = [*dense_gradients, *embedding_gradients]
        if self.loss_scale is not None:
            gradients = [_scale(g, 1.0 / scale) for g in gradients]
        # The lookup gradients are checked, not the tables' gradients made of
        # them: the local lookup's backward only copies (or divides by a row's id
        # count) them, so one check covers both, and checking the tables'
        # gradients again cost a pass over the step's largest gradient. On several
        # ranks the verdicts covered what arrived (every rank checked what it
        # sent); it is checked only where nothing else uses it, a rank holding no
        # model-parallel shard, so that TensorFlow does not prune the reverse
        # alltoall there while the other ranks wait in it. Replicated tables'
        # gradients were summed over ranks and are checked as they are.
        summed = [
            g
            for g, method in zip(gradients[len(dense_gradients) :], exchange, strict=True)
            if method is not None
        ]
        checked = [*gradients[: len(dense_gradients)], *summed]
        if self.collectives.world_size == 1 or not embeddings.holds_model_parallel_shards:
            checked += tf.nest.flatten(lookup_gradients)
        gradients_finite = all_finite(checked, self.model.use_kernels)
        if self.collectives.world_size > 1:
            gradients_finite = tf.logical_and(gradients_finite, verdicts[0] == 0)
            loss_finite = verdicts[1] == 0
        apply = tf.logical_and(gradients_finite, loss_finite)
        variables = [*self.dense_variables, *embedding_variables]

        def update() -> None:
            self.optimizer.apply(gradients, variables, learning_rate, self.model.use_kernels)
            if fused_ids is not None:
                # In turn: the ops update the same tables (tf.function orders them).
                for (start, stop), gradient in zip(bounds, lookup_gradients, strict=True):
                    ids = fused_ids if len(bounds) == 1 else fused_ids[start:stop]
                    embeddings.apply_fused_sgd(ids, gradient, learning_rate / scale)

        tf.cond(apply, update, lambda: None)
        if self.loss_scale is not None:
            self.loss_scale.update(gradients_finite)
            # Overflowing scaled gradients are expected with float16; a bad loss is not.
            failed = tf.logical_not(loss_finite)
        else:
            failed = tf.logical_not(apply)
        record = tf.logical_and(failed, self.first_non_finite_step < 0)
        self.first_non_finite_step.assign(tf.where(record, self.step, self.first_non_finite_step))
        self.first_non_finite_loss.assign(tf.where(record, loss, self.first_non_finite_loss))
        self.step.assign_add(1)
        return loss

    def _allreduce(
        self, dense: Sequence[Any], embedding: Sequence[Any], verdict: tf.Tensor
    ) -> tuple[list[Any], list[Any], tf.Tensor]:
        """Sums the data-parallel gradients and `verdict` over ranks;
        model-parallel gradients pass.

        Every collective is named, so that ranks whose graphs differ (they hold
        different shards) still pair them up."""
        names = ["non_finite", *(f"gradient_dense_{i}" for i in range(len(dense)))]
        tensors = [verdict, *dense]
        dense_tables = []
        for position, (gradient, exchange) in enumerate(
            zip(embedding, self._exchange, strict=True)
        ):
            if exchange is None:
                continue
            if exchange == DENSE_EXCHANGE:
                variable = self.embedding_variables[position]
                gradient = _with_counts(gradient, tf.shape(variable, out_type=tf.int64)[0])
                dense_tables.append(position)
            tensors.append(gradient)
            names.append(f"gradient_{self._names[position]}")
        reduced = iter(self.collectives.allreduce_sum(tensors, names))
        verdicts = next(reduced)
        dense_out = [next(reduced) for _ in dense]
        embedding_out = []
        for position, (gradient, exchange) in enumerate(
            zip(embedding, self._exchange, strict=True)
        ):
            if exchange is None:
                embedding_out.append(gradient)
            elif position in dense_tables:
                embedding_out.append(_looked_up_rows(next(reduced)))
            else:
                embedding_out.append(next(reduced))
        return dense_out, embedding_out, verdicts

    def train_step(self, batch: Batch) -> tf.Tensor:
        """One optimizer step on one global batch; returns the (unscaled) loss."""
        return self._train_step(batch)

    def check_finite(self) -> None:
        """Raises `NonFiniteLossError` if any step so far had a NaN/inf loss."""
        step = int(self.first_non_finite_step.numpy())
        if step >= 0:
            raise NonFiniteLossError(
                step,
                float(self.first_non_finite_loss.numpy()),
                self.precision,
                float(self.learning_rate(tf.constant(step, tf.int64))),
            )


def _with_counts(gradient: Any, rows: tf.Tensor) -> tf.Tensor:
    """A replicated table's sparse gradient as a dense [rows, D + 1] array: the
    summed gradient of each row, and how often the row was looked up."""
    if not isinstance(gradient, tf.IndexedSlices):
        raise TypeError("a replicated table's gradient must be tf.IndexedSlices")
    values = tf.math.unsorted_segment_sum(gradient.values, gradient.indices, rows)
    ones = tf.ones_like(gradient.indices, dtype=values.dtype)[:, None]
    counts = tf.math.unsorted_segment_sum(ones, gradient.indices, rows)
    return tf.concat([values, counts], axis=1)


def _looked_up_rows(summed: tf.Tensor) -> tf.IndexedSlices:
    """The rows of an allreduced `_with_counts` array that some rank looked up, as
    the sparse gradient one process computes (same rows, so lazy optimizers
    leave the same rows alone)."""
    rows = tf.cast(tf.where(summed[:, -1] > 0)[:, 0], tf.int32)
    values = tf.gather(summed[:, :-1], rows)
    return tf.IndexedSlices(values, rows, tf.shape(summed[:, :-1], out_type=tf.int32))
