"""One training step of DLRM, and batched prediction.

A step is three parts, so that `--xla` compiles only what XLA handles well and
the sharded embeddings can run collectives outside the compiled function:

1. embedding lookup, recorded on a tape (sparse gather; alltoall when sharded);
2. the dense part: bottom MLP, interaction, top MLP, loss and the gradients of
   the loss with respect to the dense weights *and the looked-up vectors*, in
   one function that `--xla` compiles with `jit_compile=True`;
3. the embedding backward: the vectors' gradient pushed through the lookup
   (`tape.gradient(..., output_gradients=...)`), giving row-sparse
   `tf.IndexedSlices` that the optimizer applies to the rows looked up only.

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
from typing import Any

import tensorflow as tf

from dataloading.split_binary import Batch
from dlrm.dist import Collectives
from dlrm.model import Dlrm
from dlrm.optimizers import Optimizer
from dlrm.precision import DynamicLossScale, Precision


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


def _is_finite(gradient: Any) -> tf.Tensor:
    values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    return tf.reduce_all(tf.math.is_finite(values))


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
        collectives: the ranks. Dense gradients and those of replicated
            (data-parallel) tables are allreduce-summed; model-parallel shards'
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
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.precision = precision
        self.global_batch_size = global_batch_size
        self.use_xla = use_xla
        self.collectives = collectives or Collectives()
        model.build_all()
        self.dense_variables = list(model.dense_variables)
        self.embedding_variables = list(model.embeddings.trainable_variables)
        replicated = {id(v) for v in model.embeddings.replicated_variables}
        self._replicated = [id(v) in replicated for v in self.embedding_variables]
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
        self._dense_step = tf.function(self._dense_step_eager, jit_compile=use_xla)
        self._predict_dense = tf.function(self._predict_dense_eager, jit_compile=use_xla)
        self._train_step = tf.function(self._train_step_eager)
        self._predict = tf.function(self._predict_eager)

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

    def _train_step_eager(self, batch: Batch) -> tf.Tensor:
        learning_rate = self.learning_rate(self.step)
        with tf.GradientTape() as tape:
            vectors = self.model.embeddings(batch.categorical)
        scale = self.loss_scale.scale if self.loss_scale else tf.constant(1.0)
        loss, dense_gradients, vector_gradients = self._dense_step(
            batch.numerical, vectors, batch.label, batch.weight, scale
        )
        embedding_gradients = tape.gradient(
            vectors, self.embedding_variables, output_gradients=vector_gradients
        )
        if self.collectives.world_size > 1:
            dense_gradients, embedding_gradients = self._allreduce(
                dense_gradients, embedding_gradients
            )
        gradients = [*dense_gradients, *embedding_gradients]
        if self.loss_scale is not None:
            gradients = [_scale(g, 1.0 / scale) for g in gradients]
        gradients_finite = tf.reduce_all(tf.stack([_is_finite(g) for g in gradients]))
        loss_finite = tf.math.is_finite(loss)
        if self.collectives.world_size > 1:  # every rank takes the same decision
            gradients_finite = tf.logical_not(
                self.collectives.any_true(tf.logical_not(gradients_finite))
            )
            loss_finite = tf.logical_not(self.collectives.any_true(tf.logical_not(loss_finite)))
        apply = tf.logical_and(gradients_finite, loss_finite)
        variables = [*self.dense_variables, *self.embedding_variables]

        def update() -> None:
            self.optimizer.apply(gradients, variables, learning_rate)

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
        self, dense: Sequence[Any], embedding: Sequence[Any]
    ) -> tuple[list[Any], list[Any]]:
        """Sums the data-parallel gradients over ranks; model-parallel ones pass."""
        replicated = [g for g, r in zip(embedding, self._replicated, strict=True) if r]
        reduced = self.collectives.allreduce_sum([*dense, *replicated])
        dense_out = reduced[: len(dense)]
        rest = iter(reduced[len(dense) :])
        embedding_out = [
            next(rest) if r else g for g, r in zip(embedding, self._replicated, strict=True)
        ]
        return dense_out, embedding_out

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

    # ------------------------------------------------------------ prediction

    def _predict_dense_eager(self, numerical: tf.Tensor, vectors: tf.Tensor) -> tf.Tensor:
        return tf.sigmoid(self.model.dense_forward(numerical, vectors))

    def _predict_eager(self, numerical: tf.Tensor, categorical: Any) -> tf.Tensor:
        return self._predict_dense(numerical, self.model.embeddings(categorical))

    def predict(self, numerical: tf.Tensor, categorical: Any) -> tf.Tensor:
        """Click probabilities [B, 1] float32."""
        return self._predict(numerical, categorical)
