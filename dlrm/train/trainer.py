"""One training step of DLRM.

A step is one `tf.function`, one path for every plan, precision and chunk size,
in four parts, so that `--xla` compiles only what XLA handles well and the
collectives of sharded embeddings run outside both the compiled function and
autodiff:

1. the embeddings' forward pass (`Embeddings.forward`): the vectors of each
   chunk of the rank's rows (`dense_chunk_rows`; one chunk of the whole batch by
   default), which cross between the ranks chunk by chunk when tables are
   sharded, so that one chunk's exchange overlaps another chunk's dense part
   (where ids cross between the ranks, the next batch's cross during this
   step's dense part: `train_step_agreeing`);
2. the dense part: bottom MLP, interaction, top MLP, loss and the gradients of
   the loss with respect to the dense weights *and the vectors*, in one
   function that `--xla` compiles with `jit_compile=True`, run over the chunks
   one after another (`dlrm.model.row_chunks`), their gradients summed;
3. the embeddings' backward pass (`Embeddings.backward`): the tables' gradients
   from the vectors', with whatever crosses between the ranks done by the layer;
4. the dense gradients summed over ranks, and the update (the embedding rows by
   the layer, `Embeddings.apply_gradients`, then the dense weights), applied
   only when every rank's loss and gradients are finite: each rank's verdict on
   its own loss and vectors' gradient is summed with the dense gradients (no
   collective of its own), and every rank checks the sums alike.

The same sum carries each rank's *requests* (`train_step_agreeing`): to stop
(a preemption signal seen by that rank) and to write a checkpoint (a timer that
only rank 0 keeps). Every rank gets the sums after the same step, so ranks that
saw different things still stop, or checkpoint, at the same step, at no cost of
a collective of their own.

The trainer does not know which ranks hold which tables, nor how their
exchanges are kept in step: that is the embeddings layer's.

The loss is the weighted sum of binary cross-entropies divided by the *global*
batch size, so that per-rank gradients add up to the 1-rank gradient.

A step whose loss or gradients are not finite is not applied. Under float16
loss scaling that is the normal overflow handling: float16 overflows in the
forward pass (an inf logit, a NaN loss) as well as in the scaled gradients, and
either way the step is skipped and the scale halved, on every rank alike (the
verdict is summed over the ranks). Only `MAX_CONSECUTIVE_SKIPS` skipped steps
in a row count as a failure. Without loss scaling the first non-finite step is
one. The step where training failed is remembered in `first_non_finite_step`,
and the caller stops training at its next check (`check_finite`:
`NonFiniteLossError`, or `LossScaleError` under loss scaling), with the weights
still those of the last good step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from dataloading.split_binary import Batch
from dlrm.distributed.collectives import Collectives
from dlrm.kernels.finite import all_finite
from dlrm.model.dlrm import Dlrm
from dlrm.model.row_chunks import chunk_bounds, in_sequence
from dlrm.optim.optimizers import Optimizer
from dlrm.train.precision import INITIAL_LOSS_SCALE, DynamicLossScale, Precision

# Steps skipped in a row under float16 loss scaling after which training stops
# (`LossScaleError`). The scale starts at 2^15, so about 15 halvings in a row take
# it to its minimum of 1: a run of overflows that a smaller scale can cure ends
# well within 20. 50 leaves room for a few more transient overflows around it,
# and once the scale is 1 the rest overflow unscaled, which no scale cures: at
# most a few dozen steps of a long run are spent finding that out, instead of
# every step skipped silently forever.
MAX_CONSECUTIVE_SKIPS = 50


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss or gradient."""

    def __init__(self, step: int, loss: float, precision: Precision, learning_rate: float) -> None:
        hints = [f"lower --learning_rate (now {learning_rate:g}) or add --warmup_steps"]
        if precision.dtype_policy != "float32":
            hints.append("try without --amp")
        hints.append("check the numerical features for huge values (preprocessing applies log)")
        super().__init__(
            f"training diverged: the loss or a gradient was not finite at step {step} "
            f"(loss {loss}); the step was not applied and no checkpoint was written after it. "
            f"Likely causes: {'; '.join(hints)}."
        )
        self.step = step


class LossScaleError(NonFiniteLossError):
    """Under float16 loss scaling, `MAX_CONSECUTIVE_SKIPS` steps in a row had a
    NaN/inf loss or gradient, whatever the scale."""

    def __init__(
        self, step: int, skipped: int, loss_scale: float, loss: float, learning_rate: float
    ) -> None:
        RuntimeError.__init__(  # a message of its own, not NonFiniteLossError's
            self,
            f"training diverged under float16 loss scaling: {skipped} steps in a row, up to "
            f"step {step}, had a loss or gradient that was not finite (the last loss {loss}) "
            f"and were skipped, each halving the loss scale (now {loss_scale:g}); the "
            f"weights are those of the last step applied. Likely causes: lower --learning_rate "
            f"(now {learning_rate:g}) or add --warmup_steps; try without --amp; check the "
            f"numerical features for huge values (preprocessing applies log).",
        )
        self.step = step
        self.skipped = skipped
        self.loss_scale = loss_scale


# What a rank may ask of every rank after a step (`Trainer.train_step_agreeing`).
REQUESTS = ("stop", "checkpoint")


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
        collectives: the ranks, over which the dense gradients are summed (the
            embeddings layer exchanges its own). One process by default.
        initial_loss_scale: where float16's dynamic loss scale starts (None:
            `INITIAL_LOSS_SCALE`; unused without loss scaling).
        exchange_ids_ahead: where the embeddings exchange ids between the ranks
            (`Embeddings.exchanges_ids`), run the next batch's exchange during
            this step when the caller names the next batch (`train_step_agreeing`).
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
        initial_loss_scale: float | None = None,
        exchange_ids_ahead: bool = True,
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
        self.exchanges_ids_ahead = exchange_ids_ahead and model.embeddings.exchanges_ids
        # The next batch and its ids, exchanged during the step before it; and how
        # many steps of this process took their ids so.
        self._ahead: tuple[Batch, Any] | None = None
        self.ids_exchanged_ahead = 0
        self.dense_variables = list(model.dense_variables)
        self.embedding_variables = [variable for _, variable in model.embeddings.local_shards()]
        optimizer.build(self.dense_variables, tables=self.embedding_variables)
        # Batches consumed: drives the schedule and the data position on resume.
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        # Where the learning-rate schedule stood at step 0: a warm start's checkpoint's
        # own position when the schedule continues across runs (--schedule_from), else 0.
        self.schedule_offset = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="schedule_offset"
        )
        self.first_non_finite_step = tf.Variable(
            -1, dtype=tf.int64, trainable=False, name="first_non_finite_step"
        )
        self.first_non_finite_loss = tf.Variable(
            0.0, dtype=tf.float32, trainable=False, name="first_non_finite_loss"
        )
        self.loss_scale = None
        if precision.use_loss_scale:
            self.loss_scale = DynamicLossScale(initial_loss_scale or INITIAL_LOSS_SCALE)
        # autograph=False: the steps branch on tensors only through tf.cond and
        # tf.where, so AutoGraph's rewrite of their source (about 1.8 s of CPU at every
        # process's first step, the same graph) is skipped; so is the predictor's.
        self._dense_step = tf.function(self._dense_step_eager, jit_compile=use_xla, autograph=False)
        self._train_step = tf.function(self._train_step_eager, autograph=False)
        self._exchange_ids = tf.function(model.embeddings.exchange_ids, autograph=False)

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
        spans: list[tuple[int, int | None]],
        numerical: tf.Tensor,
        vectors: list[tf.Tensor],
        label: tf.Tensor,
        weight: tf.Tensor,
        loss_scale: tf.Tensor,
    ) -> tuple[tf.Tensor, list[tf.Tensor], list[tf.Tensor]]:
        """The dense step over the batch's rows in chunks (`spans`, from
        `chunk_bounds`; `vectors` one tensor per chunk): the losses and the
        weights' gradients summed (each chunk's loss already divides by the
        global batch size), and the vectors' gradient of each chunk."""
        # The next chunk starts once this one's vectors' gradient exists, so its
        # forward can run beside the rest of this one's backward (the bottom
        # MLP's, the first top layer's weight gradient) instead of after it; at
        # most two chunks' activations are alive.
        chunks = in_sequence(
            spans,
            [numerical, vectors, label, weight],
            lambda *chunk: self._dense_step(*chunk, loss_scale),
            wait_for=lambda outputs: [outputs[2]],
        )
        loss, dense_gradients, _ = chunks[0]
        for chunk_loss, gradients, _ in chunks[1:]:
            loss = loss + chunk_loss
            dense_gradients = [a + b for a, b in zip(dense_gradients, gradients, strict=True)]
        return loss, dense_gradients, [chunk[2] for chunk in chunks]

    def _train_step_eager(
        self,
        batch: Batch,
        requests: tf.Tensor,
        exchanged: Any = None,
        following: Batch | None = None,
    ) -> tuple[Any, ...]:
        """The step; with `exchanged`, the batch's ids as they crossed a step ahead,
        and with `following`, the next batch, whose ids cross during this step's
        dense part and are returned third."""
        learning_rate = self.learning_rate_at(self.step)
        embeddings = self.model.embeddings
        scale = self.loss_scale.scale if self.loss_scale else tf.constant(1.0)
        spans = chunk_bounds(batch.numerical.shape[0], self.dense_chunk_rows)
        lookup = embeddings.forward(
            batch.categorical, tf.shape(batch.numerical)[0], spans, exchanged
        )
        ahead = None
        if following is not None:
            # Once this step's vectors have crossed: the exchange then runs beside the
            # dense part, when the ranks have nothing else to send.
            with tf.control_dependencies([lookup.step.receipt]):
                ahead = embeddings.exchange_ids(
                    following.categorical, tf.shape(following.numerical)[0]
                )
        loss, dense_gradients, vector_gradients = self._dense_gradients(
            spans,
            batch.numerical,
            [chunk.vectors for chunk in lookup.chunks],
            batch.label,
            batch.weight,
            scale,
        )
        verdict = self._verdict(loss, vector_gradients, requests)
        embedding_gradients = embeddings.backward(lookup, vector_gradients)
        verdict, dense_gradients = self._sum_over_ranks(
            verdict, dense_gradients, embedding_gradients.receipt
        )
        gradient_scale = None
        if self.loss_scale is not None:
            gradient_scale = 1.0 / scale
            dense_gradients = [g * gradient_scale for g in dense_gradients]
        gradients_finite = tf.logical_and(
            tf.logical_and(
                all_finite(dense_gradients, self.model.use_kernels), embedding_gradients.finite
            ),
            verdict[0] == 0,
        )
        loss_finite = verdict[1] == 0

        def update() -> None:
            # The embedding rows first: the dense update ends the optimizer's step.
            embeddings.apply_gradients(
                embedding_gradients, self.optimizer, learning_rate, gradient_scale
            )
            self.optimizer.apply(dense_gradients, self.dense_variables, learning_rate)

        tf.cond(tf.logical_and(gradients_finite, loss_finite), update, lambda: None)
        self._record_outcome(loss, gradients_finite, loss_finite)
        self.step.assign_add(1)
        if ahead is None:
            return loss, verdict[2:] > 0
        return loss, verdict[2:] > 0, ahead

    def _verdict(
        self, loss: tf.Tensor, vector_gradients: list[tf.Tensor], requests: tf.Tensor
    ) -> tf.Tensor:
        """This rank's verdict on what only it computed: whether its vectors' gradient
        (from which the tables' gradients are made, wherever they live) and its loss
        are not finite, then its requests; as float32, to be summed over ranks."""
        bad = tf.stack(
            [
                tf.logical_not(all_finite(vector_gradients, self.model.use_kernels)),
                tf.logical_not(tf.math.is_finite(loss)),
            ]
        )
        return tf.concat([tf.cast(bad, tf.float32), requests], axis=0)

    def _sum_over_ranks(
        self, verdict: tf.Tensor, dense_gradients: list[tf.Tensor], receipt: tf.Tensor | None
    ) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """The verdicts and the dense gradients summed over the ranks, in one
        allreduce, so that every rank decides alike from the sums."""
        if self.collectives.world_size == 1:
            return verdict, dense_gradients
        names = ["non_finite", *(f"gradient_dense_{i}" for i in range(len(dense_gradients)))]
        # Once the layer's exchanges are done (`receipt`): an allreduce of its own in
        # flight beside this one could be fused with it, either way round, and the
        # sums would not repeat from run to run (`dlrm.distributed.collectives.packed`).
        with tf.control_dependencies([] if receipt is None else [receipt]):
            verdict, *summed = self.collectives.allreduce_sum([verdict, *dense_gradients], names)
        return verdict, summed

    def _record_outcome(
        self, loss: tf.Tensor, gradients_finite: tf.Tensor, loss_finite: tf.Tensor
    ) -> None:
        """The loss scale follows the step; the step where training failed is kept
        for `check_finite`. Under loss scaling a non-finite loss or gradient is a
        float16 overflow, expected now and then: the step was skipped and the scale
        halves, and only `MAX_CONSECUTIVE_SKIPS` of them in a row fail. Without it,
        any non-finite step fails."""
        finite = tf.logical_and(gradients_finite, loss_finite)
        if self.loss_scale is not None:
            self.loss_scale.update(finite)
            failed = self.loss_scale.skipped_steps >= MAX_CONSECUTIVE_SKIPS
        else:
            failed = tf.logical_not(finite)
        record = tf.logical_and(failed, self.first_non_finite_step < 0)
        self.first_non_finite_step.assign(tf.where(record, self.step, self.first_non_finite_step))
        self.first_non_finite_loss.assign(tf.where(record, loss, self.first_non_finite_loss))

    def train_step(self, batch: Batch) -> tf.Tensor:
        """One optimizer step on one global batch; returns the (unscaled) loss."""
        return self.train_step_agreeing(batch, [False] * len(REQUESTS))[0]

    def train_step_agreeing(
        self, batch: Batch, requests: Sequence[bool], following: Batch | None = None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """`train_step`, with this rank's `requests` (one bool per `REQUESTS`
        name): returns the loss and, per request, whether any rank made it; every
        rank gets the same answer after the same step.

        `following`, when given, is the batch the next call trains on. Where ids
        cross between the ranks (data-parallel input) and `exchange_ids_ahead`,
        its ids then cross during this step's dense part instead of at the start
        of its own step, off the step's critical path; the next call uses them
        if its batch is that very object, and otherwise (a new epoch's reader,
        a reset) exchanges its own. The ids, and so the results, are the same.
        Every rank must name a following batch at the same steps (the ranks'
        loops run alike), as every rank runs the same collectives."""
        requested = tf.constant(requests, tf.float32)
        carried, self._ahead = self._ahead, None
        if not self.exchanges_ids_ahead or (carried is None and following is None):
            return self._train_step(batch, requested)
        if carried is not None and carried[0] is batch:
            exchanged = carried[1]
            self.ids_exchanged_ahead += 1
        else:  # the first step of a run of them: its own ids cross alone, before it
            exchanged = self._exchange_ids(batch.categorical, tf.shape(batch.numerical)[0])
        if following is None:
            return self._train_step(batch, requested, exchanged)
        loss, agreed, ahead = self._train_step(batch, requested, exchanged, following)
        self._ahead = (following, ahead)
        return loss, agreed

    def learning_rate_at(self, step: tf.Tensor) -> tf.Tensor:
        """The learning rate of this run's 0-based `step`: the schedule's at
        `schedule_offset + step`."""
        return self.learning_rate(self.schedule_offset + step)

    def check_finite(self) -> None:
        """Raises `NonFiniteLossError` if training failed at a step so far: one with
        a NaN/inf loss or gradient, or under loss scaling (`LossScaleError`)
        `MAX_CONSECUTIVE_SKIPS` skipped steps in a row."""
        step = int(self.first_non_finite_step.numpy())
        if step < 0:
            return
        loss = float(self.first_non_finite_loss.numpy())
        learning_rate = float(self.learning_rate_at(tf.constant(step, tf.int64)))
        if self.loss_scale is not None:
            scale = float(self.loss_scale.scale.numpy())
            raise LossScaleError(step, MAX_CONSECUTIVE_SKIPS, scale, loss, learning_rate)
        raise NonFiniteLossError(step, loss, self.precision, learning_rate)
