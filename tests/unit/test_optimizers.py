"""Optimizers against numpy references, dense and row-sparse."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from dlrm.optim.optimizers import Adagrad, Adam, Sgd, create_optimizer

ROWS, DIM = 11, 7


def _setup(optimizer_name: str) -> tuple[tf.Variable, object, np.ndarray]:
    rng = np.random.default_rng(5)
    initial = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    variable = tf.Variable(initial, name="w")
    optimizer = create_optimizer(optimizer_name)
    optimizer.build([variable])
    return variable, optimizer, initial


def _numpy_steps(
    name: str,
    initial: np.ndarray,
    gradients: list[np.ndarray],
    lr: float,
    lazy_rows: list[np.ndarray] | None = None,
) -> np.ndarray:
    """Reference updates; `lazy_rows[k]` restricts step k to those rows (lazy Adam)."""
    w = initial.astype(np.float64).copy()
    accumulator = np.full_like(w, 0.1)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for k, g in enumerate(gradients, start=1):
        rows = lazy_rows[k - 1] if lazy_rows is not None else np.arange(len(w))
        g = g.astype(np.float64)
        if name == "sgd":
            w -= lr * g
        elif name == "adagrad":
            accumulator[rows] += g[rows] ** 2
            w[rows] -= lr * g[rows] / (np.sqrt(accumulator[rows]) + 1e-7)
        else:
            m[rows] = 0.9 * m[rows] + 0.1 * g[rows]
            v[rows] = 0.999 * v[rows] + 0.001 * g[rows] ** 2
            step = lr * np.sqrt(1 - 0.999**k) / (1 - 0.9**k)
            w[rows] -= step * m[rows] / (np.sqrt(v[rows]) + 1e-7)
    return w


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_dense_updates_match_numpy(name: str) -> None:
    variable, optimizer, initial = _setup(name)
    rng = np.random.default_rng(1)
    gradients = [rng.normal(size=(ROWS, DIM)).astype(np.float32) for _ in range(3)]
    for g in gradients:
        optimizer.apply([tf.constant(g)], [variable], tf.constant(0.05))
    expected = _numpy_steps(name, initial, gradients, 0.05)
    np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert int(optimizer.iterations.numpy()) == 3


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_sparse_updates_sum_duplicates_and_touch_only_looked_up_rows(name: str) -> None:
    variable, optimizer, initial = _setup(name)
    rng = np.random.default_rng(2)
    steps = [np.array([3, 1, 3, 3]), np.array([0, 10, 1])]
    dense_equivalents, rows_per_step = [], []
    for indices in steps:
        values = rng.normal(size=(len(indices), DIM)).astype(np.float32)
        dense = np.zeros((ROWS, DIM), np.float32)
        np.add.at(dense, indices, values)  # the summed gradient of the lookups
        dense_equivalents.append(dense)
        rows_per_step.append(np.unique(indices))
        gradient = tf.IndexedSlices(
            tf.constant(values), tf.constant(indices, tf.int32), tf.constant([ROWS, DIM])
        )
        optimizer.apply([gradient], [variable], tf.constant(0.05))
    expected = _numpy_steps(name, initial, dense_equivalents, 0.05, lazy_rows=rows_per_step)
    np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5, atol=1e-6)
    untouched = sorted(set(range(ROWS)) - {0, 1, 3, 10})
    np.testing.assert_array_equal(variable.numpy()[untouched], initial[untouched])


def test_slot_names_and_initial_values() -> None:
    variable = tf.Variable(tf.zeros([2, 3]), name="table")
    adam = Adam()
    adam.build([variable])
    assert list(adam.slots(variable)) == ["m", "v"]
    assert adam.slots(variable)["v"].name.startswith("table.v")
    adagrad = Adagrad(initial_accumulator_value=0.3)
    adagrad.build([variable])
    np.testing.assert_allclose(adagrad.slots(variable)["accumulator"].numpy(), 0.3)
    assert Sgd().slot_names == ()


def test_unknown_optimizer_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--optimizer: expected one of sgd, adagrad, adam"):
        create_optimizer("rmsprop")
