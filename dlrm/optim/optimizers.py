"""SGD, Adagrad, Adam and row-wise Adagrad: dense updates for the MLPs, row
updates for embeddings.

Each optimizer is a rule with per-variable slots. The dense weights are updated
by TensorFlow's fused training kernels (`tf.raw_ops.ResourceApply*`, the same
kernels TensorFlow's own optimizers used before Keras 3). Embedding tables are
updated on the rows a step looked up only, so a step costs O(batch) for a table
of any size: by the project's `DlrmEmbeddingApply` kernel
(`dlrm.embedding.update`, with `kernel_rule` and `bias_correction_powers`), or
by `apply_rows` on row-sparse `tf.IndexedSlices` with TensorFlow's ops, the
same computation. Sparse Adam is "lazy" (moments of untouched rows do not
decay), as NVIDIA's reference uses for embeddings.

Why not Keras 3 optimizers: they keep slots in their own structure keyed by
variable order, which the sharded checkpoints (one file per table shard, with
its slots beside it, resharded on restore) cannot address, and their Adam and
Adagrad turn `IndexedSlices` into dense [rows, D] updates.

A 16-bit table (bfloat16 or float16) keeps float32 slots: Adagrad's and Adam's
accumulators grow by increments far below a 16-bit value's spacing, which
would be lost, and a row-wise slot is [rows, 1] anyway; so its own bytes halve
and its slots' do not. Its rows are widened to float32, updated by the same
rule, and stored back with stochastic rounding (`dlrm.optim.rounding`).

Slots are named after the variable's path, so checkpoints can store and
restore them per variable. A slot the spec calls row-wise (`row_wise_slots`)
is [rows, 1] on an embedding table (`build(..., tables=...)`), the variable's
shape on a dense weight.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import tensorflow as tf

from dlrm.optim.config import (
    ADAGRAD,
    ADAM,
    ROWWISE_ADAGRAD,
    SGD,
    OptimizerSpec,
    optimizer_spec,
)
from dlrm.optim.rounding import SIXTEEN_BIT_DTYPES, RowRounding, round_rows
from dlrm.variables import resource_variable, variable_name


def _deduplicate(gradient: tf.IndexedSlices) -> tuple[tf.Tensor, tf.Tensor]:
    """Unique row indices and their summed gradient rows.

    Adagrad's and Adam's fused sparse kernels apply duplicate indices one after
    the other, which is not the update of the summed gradient.
    """
    unique, positions = tf.unique(gradient.indices)
    summed = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(unique)[0])
    return unique, summed


class Optimizer(abc.ABC):
    """Applies gradients to variables, with per-variable slots.

    Call `build(variables, tables)` eagerly once; then, every step (inside tf.function),
    the embedding rows' update (`apply_rows`, or the kernel with `kernel_rule`)
    before `apply` of the dense gradients, which ends the step: `iterations`
    counts applied steps (Adam's bias correction) and `apply` adds one.
    """

    spec: ClassVar[OptimizerSpec]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def slot_names(self) -> tuple[str, ...]:
        return self.spec.slot_names

    def __init__(self) -> None:
        self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name="iterations")
        self._slots: dict[str, dict[str, tf.Variable]] = {}

    def build(self, variables: Sequence[Any], tables: Sequence[Any] = ()) -> None:
        """Creates the slots of `variables` (dense weights) and of `tables`
        (embedding tables or their shards, [rows, D]: a row-wise slot of theirs is
        [rows, 1]); a variable that has slots keeps them."""
        for variable, is_table in [(v, False) for v in variables] + [(t, True) for t in tables]:
            name = variable_name(variable)
            if name in self._slots:
                continue
            self._slots[name] = {
                slot: tf.Variable(
                    tf.fill(
                        self._slot_shape(variable, slot, is_table), self._slot_initial_value(slot)
                    ),
                    trainable=False,
                    name=f"{name.replace('/', '.')}.{slot}",
                )
                for slot in self.slot_names
            }

    def _slot_shape(self, variable: Any, slot: str, is_table: bool) -> list[int]:
        shape = list(variable.shape)
        if is_table and slot in self.spec.row_wise_slots:
            return [shape[0], 1]
        return shape

    def _slot_initial_value(self, slot: str) -> float:
        return 0.0

    def slots(self, variable: Any) -> dict[str, tf.Variable]:
        """Slot name -> slot variable of `variable` (empty for SGD)."""
        return self._slots[variable_name(variable)]

    def apply(
        self, gradients: Sequence[Any], variables: Sequence[Any], learning_rate: tf.Tensor
    ) -> None:
        """One update of every variable from its gradient (dense, or
        `tf.IndexedSlices`: `apply_rows`), and the end of the step."""
        learning_rate = tf.cast(learning_rate, tf.float32)
        for gradient, variable in zip(gradients, variables, strict=True):
            if gradient is None:
                continue
            if isinstance(gradient, tf.IndexedSlices):
                self.apply_rows(variable, gradient, learning_rate)
            else:
                resource = resource_variable(variable)
                slots = self.slots(variable)
                self._apply_dense(resource, tf.convert_to_tensor(gradient), learning_rate, slots)
        self.iterations.assign_add(1)

    def apply_rows(
        self,
        variable: Any,
        gradient: tf.IndexedSlices,
        learning_rate: Any,
        rounding: RowRounding | None = None,
    ) -> None:
        """The rule on the rows of `variable` that `gradient` names, with
        TensorFlow's ops: duplicate rows are summed first, and each row is updated
        once. A 16-bit variable's rows are updated in float32 and rounded back
        stochastically, with the random bits of `rounding` (where its rows lie;
        table 0 of seed 0 by default). Does not end the step (`apply` does)."""
        resource = resource_variable(variable)
        lr = tf.cast(learning_rate, tf.float32)
        if resource.dtype in SIXTEEN_BIT_DTYPES:
            indices, values = _deduplicate(gradient)
            rows = tf.cast(tf.gather(resource, indices), tf.float32)
            updated = self._updated_rows(rows, values, indices, lr, self.slots(variable))
            stored = round_rows(
                updated, resource.dtype, rounding or RowRounding(), self.iterations, indices
            )
            resource.scatter_update(tf.IndexedSlices(stored, indices))
            return
        self._apply_sparse(resource, gradient, lr, self.slots(variable))

    @abc.abstractmethod
    def _updated_rows(
        self,
        rows: tf.Tensor,
        gradient: tf.Tensor,
        indices: tf.Tensor,
        lr: tf.Tensor,
        slots: dict[str, Any],
    ) -> tf.Tensor:
        """The rule on float32 `rows` [n, D] of a 16-bit table, with their
        summed `gradient` [n, D] (unique `indices`): their slots updated, the
        new rows returned (the kernel's arithmetic)."""

    def kernel_rule(self) -> dict[str, Any]:
        """The rule as `DlrmEmbeddingApply`'s attributes (dlrm.embedding.update)."""
        return {"optimizer": self.name}

    def bias_correction_powers(self) -> tuple[tf.Tensor, tf.Tensor]:
        """(beta_1^t, beta_2^t) of this step (Adam's; ones for the others)."""
        return tf.constant(1.0), tf.constant(1.0)

    @abc.abstractmethod
    def _apply_dense(
        self, variable: tf.Variable, gradient: tf.Tensor, lr: tf.Tensor, slots: dict[str, Any]
    ) -> None: ...

    @abc.abstractmethod
    def _apply_sparse(
        self,
        variable: tf.Variable,
        gradient: tf.IndexedSlices,
        lr: tf.Tensor,
        slots: dict[str, Any],
    ) -> None: ...

    # ------------------------------------------------------------ checkpoints

    def hyperparameters(self) -> dict[str, Any]:
        return {"name": self.name}


class Sgd(Optimizer):
    """Plain SGD: w -= lr * g (no momentum, as the reference DLRM)."""

    spec = SGD

    def _apply_dense(self, variable, gradient, lr, slots):  # type: ignore[no-untyped-def]
        tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=lr, delta=gradient)

    def _apply_sparse(self, variable, gradient, lr, slots):  # type: ignore[no-untyped-def]
        # Scatter-sub adds up duplicate indices, which is the summed gradient's update.
        variable.scatter_sub(tf.IndexedSlices(gradient.values * lr, gradient.indices))

    def _updated_rows(self, rows, gradient, indices, lr, slots):  # type: ignore[no-untyped-def]
        return rows - lr * gradient


class Adagrad(Optimizer):
    """Adagrad: accumulator += g^2; w -= lr * g / (sqrt(accumulator) + epsilon)."""

    spec = ADAGRAD

    def __init__(self, initial_accumulator_value: float = 0.1, epsilon: float = 1e-7) -> None:
        super().__init__()
        self.initial_accumulator_value = initial_accumulator_value
        self.epsilon = epsilon

    def _slot_initial_value(self, slot: str) -> float:
        return self.initial_accumulator_value

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "initial_accumulator_value": self.initial_accumulator_value,
            "epsilon": self.epsilon,
        }

    def kernel_rule(self) -> dict[str, Any]:
        return {"optimizer": self.name, "epsilon": self.epsilon}

    def _apply_dense(self, variable, gradient, lr, slots):  # type: ignore[no-untyped-def]
        tf.raw_ops.ResourceApplyAdagradV2(
            var=variable.handle,
            accum=slots["accumulator"].handle,
            lr=lr,
            epsilon=self.epsilon,
            grad=gradient,
        )

    def _apply_sparse(self, variable, gradient, lr, slots):  # type: ignore[no-untyped-def]
        indices, values = _deduplicate(gradient)
        tf.raw_ops.ResourceSparseApplyAdagradV2(
            var=variable.handle,
            accum=slots["accumulator"].handle,
            lr=lr,
            epsilon=self.epsilon,
            grad=values,
            indices=indices,
        )

    def _updated_rows(self, rows, gradient, indices, lr, slots):  # type: ignore[no-untyped-def]
        accumulator = tf.gather(slots["accumulator"], indices) + gradient * gradient
        slots["accumulator"].scatter_update(tf.IndexedSlices(accumulator, indices))
        return rows - lr * gradient / (tf.sqrt(accumulator) + self.epsilon)


class Adam(Optimizer):
    """Adam; rows of sparse gradients are updated lazily (untouched rows keep
    their moments), dense gradients as usual."""

    spec = ADAM

    def __init__(self, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7) -> None:
        super().__init__()
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
        }

    def kernel_rule(self) -> dict[str, Any]:
        return {
            "optimizer": self.name,
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
        }

    def bias_correction_powers(self) -> tuple[tf.Tensor, tf.Tensor]:
        return self._powers()

    def _powers(self) -> tuple[tf.Tensor, tf.Tensor]:
        step = tf.cast(self.iterations + 1, tf.float32)
        return tf.pow(self.beta_1, step), tf.pow(self.beta_2, step)

    def _apply_dense(self, variable, gradient, lr, slots):  # type: ignore[no-untyped-def]
        beta_1_power, beta_2_power = self._powers()
        tf.raw_ops.ResourceApplyAdam(
            var=variable.handle,
            m=slots["m"].handle,
            v=slots["v"].handle,
            beta1_power=beta_1_power,
            beta2_power=beta_2_power,
            lr=lr,
            beta1=self.beta_1,
            beta2=self.beta_2,
            epsilon=self.epsilon,
            grad=gradient,
        )

    def _apply_sparse(self, variable, gradient, lr, slots):  # type: ignore[no-untyped-def]
        indices, values = _deduplicate(gradient)
        beta_1_power, beta_2_power = self._powers()
        m = self.beta_1 * tf.gather(slots["m"], indices) + (1.0 - self.beta_1) * values
        v = self.beta_2 * tf.gather(slots["v"], indices) + (1.0 - self.beta_2) * values * values
        step_size = lr * tf.sqrt(1.0 - beta_2_power) / (1.0 - beta_1_power)
        # The same update as ResourceApplyAdam, restricted to the rows in `indices`.
        update = step_size * m / (tf.sqrt(v) + self.epsilon)
        slots["m"].scatter_update(tf.IndexedSlices(m, indices))
        slots["v"].scatter_update(tf.IndexedSlices(v, indices))
        variable.scatter_sub(tf.IndexedSlices(update, indices))

    def _updated_rows(self, rows, gradient, indices, lr, slots):  # type: ignore[no-untyped-def]
        beta_1_power, beta_2_power = self._powers()
        m = self.beta_1 * tf.gather(slots["m"], indices) + (1.0 - self.beta_1) * gradient
        v = self.beta_2 * tf.gather(slots["v"], indices) + (1.0 - self.beta_2) * gradient * gradient
        step_size = lr * tf.sqrt(1.0 - beta_2_power) / (1.0 - beta_1_power)
        slots["m"].scatter_update(tf.IndexedSlices(m, indices))
        slots["v"].scatter_update(tf.IndexedSlices(v, indices))
        return rows - step_size * m / (tf.sqrt(v) + self.epsilon)


class RowwiseAdagrad(Adagrad):
    """Row-wise Adagrad on embedding tables, element-wise Adagrad on dense weights.

    A table row u keeps one accumulator (slot [rows, 1]) instead of one per
    element, so the state costs 1/D of the table: with G[u] the row's gradient
    summed over the step's occurrences of u, acc[u] += mean over the row's D
    values of G[u]^2; w[u] -= lr * G[u] / (sqrt(acc[u]) + epsilon). FBGEMM's
    and TorchRec's (exact) row-wise Adagrad, which their users pair with a dense
    Adagrad for the MLPs, as here: a dense weight's accumulator is its shape.

    A column-wise shard averages over its own columns only (its accumulator is
    the shard's, as each column shard is its own table in TorchRec), so a table
    split by columns trains differently from the whole table.
    """

    spec = ROWWISE_ADAGRAD

    def _apply_dense(self, variable, gradient, lr, slots):  # type: ignore[no-untyped-def]
        accumulator = slots["accumulator"]
        if accumulator.shape == variable.shape:  # a dense weight
            super()._apply_dense(variable, gradient, lr, slots)
            return
        # A whole table given a dense gradient: every row is a looked-up row.
        _check_row_wise(variable, accumulator)
        total = accumulator + tf.reduce_mean(tf.square(gradient), axis=1, keepdims=True)
        accumulator.assign(total)
        variable.assign_sub(gradient * (lr / (tf.sqrt(total) + self.epsilon)))

    def _apply_sparse(self, variable, gradient, lr, slots):  # type: ignore[no-untyped-def]
        accumulator = slots["accumulator"]
        _check_row_wise(variable, accumulator)
        indices, values = _deduplicate(gradient)
        # The kernel's arithmetic: the row's mean square, then one step size a row.
        total = tf.gather(accumulator, indices) + tf.reduce_mean(
            tf.square(values), axis=1, keepdims=True
        )
        accumulator.scatter_update(tf.IndexedSlices(total, indices))
        step = values * (lr / (tf.sqrt(total) + self.epsilon))
        variable.scatter_sub(tf.IndexedSlices(step, indices))

    def _updated_rows(self, rows, gradient, indices, lr, slots):  # type: ignore[no-untyped-def]
        accumulator = slots["accumulator"]
        total = tf.gather(accumulator, indices) + tf.reduce_mean(
            tf.square(gradient), axis=1, keepdims=True
        )
        accumulator.scatter_update(tf.IndexedSlices(total, indices))
        return rows - gradient * (lr / (tf.sqrt(total) + self.epsilon))


def _check_row_wise(variable: Any, accumulator: Any) -> None:
    """ValueError unless `accumulator` is the [rows, 1] slot of table `variable`."""
    expected = [variable.shape[0], 1]
    if variable.shape.rank != 2 or accumulator.shape.as_list() != expected:
        raise ValueError(
            f"rowwise_adagrad: {variable_name(variable)} {variable.shape.as_list()} has an "
            f"accumulator of shape {accumulator.shape.as_list()}, expected {expected}; "
            "a table's slots are row-wise when it is built as one (`build(..., tables=...)`)"
        )


OPTIMIZER_CLASSES: tuple[type[Optimizer], ...] = (Sgd, Adagrad, Adam, RowwiseAdagrad)


def optimizer_class(name: str) -> type[Optimizer]:
    """The optimizer an `--optimizer` value names; ValueError naming the flag."""
    spec = optimizer_spec(name)
    return next(cls for cls in OPTIMIZER_CLASSES if cls.spec == spec)


def create_optimizer(name: str) -> Optimizer:
    """`--optimizer` value -> a fresh optimizer with the default hyperparameters."""
    return optimizer_class(name)()
