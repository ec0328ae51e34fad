"""The trainer on a small synthetic dataset: learning, AMP/XLA, resume, NaN stop."""

from __future__ import annotations

import io
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from dataloading.split_binary import Batch
from dlrm import kernels
from dlrm.app.assembly import AssembledRun
from dlrm.checkpoint.format import CheckpointError
from dlrm.checkpoint.model_state import check_model_matches
from dlrm.checkpoint.reader import Checkpoint
from dlrm.train.state import restore_training_state, save_training_state
from dlrm.train.trainer import REQUESTS, NonFiniteLossError
from harness.assembly import BATCH, assembled_run, batches, weights
from harness.datasets import SMALL_TABLES, dataset_fixture, synthetic_dataset
from harness.non_finite import NAN, DenseForward, nan_in_one_logit, nan_in_one_vector_gradient

# bfloat16 keeps 8 significant bits; round to nearest errs by at most half the last one.
BFLOAT16_UNIT_ROUNDOFF = 2.0**-8


dataset = dataset_fixture(SMALL_TABLES, 3, {"train": 20 * BATCH, "test": 500}, seed=4)


def flat(arrays: list[np.ndarray]) -> np.ndarray:
    """All weights as one float64 vector, for norms over the whole model."""
    return np.concatenate([a.ravel() for a in arrays]).astype(np.float64)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_loss_decreases(dataset: Path, optimizer: str) -> None:
    lr = {"sgd": 2.0, "adagrad": 0.1, "adam": 0.01}[optimizer]
    s = assembled_run(dataset, optimizer=optimizer, learning_rate=lr)
    assert s.trainer is not None
    data = batches(dataset, 8)
    epoch_losses = [np.mean([float(s.trainer.train_step(b)) for b in data]) for _ in range(6)]
    assert epoch_losses[-1] < 0.95 * epoch_losses[0], epoch_losses


@pytest.mark.parametrize(
    ("optimizer", "interaction", "xla"),
    [
        ("sgd", "dot", False),
        ("adagrad", "dot", False),
        ("adam", "dot", False),
        ("sgd", "cross", False),
        ("adam", "dot", True),
    ],
)
def test_kernels_train_as_tensorflow_ops_do(
    dataset: Path, optimizer: str, interaction: str, xla: bool
) -> None:
    """The CPU kernels (interaction, finite check, lookups, the embedding update of
    every optimizer) against TensorFlow's ops, step by step from the same start.
    The cross model (tables of different widths) has no interaction kernel and
    uses the others; so does `--xla`, whose compiled dense part runs
    TensorFlow's interaction."""
    model = {**(CROSS if interaction == "cross" else {}), "xla": xla, "optimizer": optimizer}
    ours = assembled_run(dataset, learning_rate=0.2, **model)
    reference = assembled_run(dataset, learning_rate=0.2, use_kernels=False, **model)
    assert ours.trainer is not None and reference.trainer is not None
    assert ours.model.use_kernels and not reference.model.use_kernels
    if interaction == "dot":
        assert ours.model.interaction.use_kernel == (not xla)
        assert not reference.model.interaction.use_kernel
    data = batches(dataset, 4)
    assert_train_alike(ours, reference, data)
    # One lookup op for every table, and one update op, from the vectors'
    # undivided gradient, whatever the optimizer: no per-table gradient.
    ops = step_op_types(ours, data[0])
    assert "DlrmEmbeddingLookup" in ops and "ResourceGather" not in ops
    assert step_op_count(ours, data[0], "DlrmEmbeddingApply") == 1
    assert "SplitV" not in ops and "ResourceSparseApplyAdagradV2" not in ops
    assert ("DlrmDotInteraction" in ops) == (interaction == "dot" and not xla)
    reference_ops = step_op_types(reference, data[0])
    assert "DlrmEmbeddingLookup" not in reference_ops
    assert "DlrmEmbeddingApply" not in reference_ops


@pytest.mark.parametrize(
    ("optimizer", "interaction", "xla"),
    [("sgd", "dot", False), ("adagrad", "cross", False), ("sgd", "dot", True)],
)
def test_dense_chunks_train_and_predict_as_the_whole_batch_does(
    dataset: Path, optimizer: str, interaction: str, xla: bool
) -> None:
    """`--dense_chunk_rows`: the dense part over chunks of 24, 24 and 16 of the
    64 rows, their gradients summed, trains as the whole batch does (float32:
    only the order of the additions differs), and predicts the same."""
    model = {**(CROSS if interaction == "cross" else {}), "xla": xla, "optimizer": optimizer}
    chunked = assembled_run(dataset, learning_rate=0.2, dense_chunk_rows=24, **model)
    whole = assembled_run(dataset, learning_rate=0.2, dense_chunk_rows=0, **model)
    assert chunked.trainer is not None and whole.trainer is not None
    data = batches(dataset, 4)
    assert_train_alike(chunked, whole, data)
    assert dense_step_calls(chunked, data[0]) == 3
    assert dense_step_calls(whole, data[0]) == 1
    # One update for the step, from each chunk's gradient as it is.
    assert step_op_count(chunked, data[0], "DlrmEmbeddingApply") == 1
    assert step_op_count(whole, data[0], "DlrmEmbeddingApply") == 1
    b = data[0]
    np.testing.assert_allclose(
        chunked.predictor.predict(b.numerical, b.categorical).numpy(),
        whole.predictor.predict(b.numerical, b.categorical).numpy(),
        rtol=1e-6,
        atol=1e-7,
    )
    predict = chunked.predictor._predict.get_concrete_function(b.numerical, b.categorical)
    calls = [node.attr["f"].func.name for node in predict.graph.as_graph_def().node]
    assert sum("_dense_eager" in name for name in calls) == 3


NO_REQUESTS = tf.zeros([len(REQUESTS)])


def dense_step_calls(s: AssembledRun, batch: Any) -> int:
    """How many times the traced training step calls the dense part's function."""
    assert s.trainer is not None
    graph = s.trainer._train_step.get_concrete_function(batch, NO_REQUESTS).graph.as_graph_def()
    return sum("_dense_step_eager" in node.attr["f"].func.name for node in graph.node)


def assert_train_alike(ours: AssembledRun, reference: AssembledRun, data: list[Batch]) -> None:
    """Step by step the same losses, and at the end the same weights, to float32
    rounding of differently ordered sums. Adam divides each gradient element by
    its own running magnitude, which makes a rounding difference of a nearly
    cancelled element a visible share of its update: 1e-4 of the learning rate
    per step (kernel against TensorFlow's ops differed by 5e-6 at lr 0.2 after 4
    steps on an AVX2-only CPU)."""
    assert ours.trainer is not None and reference.trainer is not None
    for b in data:
        a, r = float(ours.trainer.train_step(b)), float(reference.trainer.train_step(b))
        assert a == pytest.approx(r, rel=1e-5)
    atol = 1e-6
    if ours.config.optimizer == "adam":
        atol = max(atol, 1e-4 * ours.config.learning_rate * len(data))
    for a, r in zip(weights(ours), weights(reference), strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=atol)


def step_nodes(s: AssembledRun, batch: Any) -> list[Any]:
    """The ops of the traced training step, its nested functions included."""
    assert s.trainer is not None
    graph = s.trainer._train_step.get_concrete_function(batch, NO_REQUESTS).graph.as_graph_def()
    nodes = list(graph.node)
    for function in graph.library.function:
        nodes += function.node_def
    return nodes


def step_op_types(s: AssembledRun, batch: Any) -> set[str]:
    return {node.op for node in step_nodes(s, batch)}


def step_op_count(s: AssembledRun, batch: Any, op: str) -> int:
    return sum(node.op == op for node in step_nodes(s, batch))


def test_without_built_kernels_training_says_so_and_runs_tensorflow_ops(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A machine without a compiler: the library is missing and cannot be built.
    missing = tmp_path / "dlrm_kernels-missing.so"
    monkeypatch.setattr(kernels, "library_path", lambda: missing)
    monkeypatch.setattr(kernels, "_current", None)  # forget the library loaded before

    def no_compiler(output: Path | None = None) -> Path:
        raise kernels.KernelBuildError("no C++ compiler: 'g++' ($CXX or g++) not found")

    monkeypatch.setattr(kernels, "build", no_compiler)
    console = io.StringIO()
    s = assembled_run(dataset, console=console)
    printed = console.getvalue()
    assert "the CPU kernels are not in use (their build failed: no C++ compiler" in printed
    assert printed.count("CPU kernels") == 1, printed  # one line
    assert (tmp_path / "dlrm_kernels-missing.so.failed").exists()  # not compiled again
    assert not s.model.use_kernels
    assert s.trainer is not None
    assert np.isfinite(float(s.trainer.train_step(batches(dataset, 1)[0])))


@pytest.mark.parametrize(("amp", "xla"), [(True, False), (False, True), (True, True)])
def test_amp_and_xla_train_and_match_fp32(dataset: Path, amp: bool, xla: bool) -> None:
    reference = assembled_run(dataset, learning_rate=0.2)
    variant = assembled_run(dataset, learning_rate=0.2, amp=amp, xla=xla)
    assert reference.trainer is not None and variant.trainer is not None
    assert variant.precision.dtype_policy == ("mixed_bfloat16" if amp else "float32")
    for a, b in zip(weights(reference), weights(variant), strict=True):
        np.testing.assert_array_equal(a, b)  # same seed, same start
    data = batches(dataset, 8)
    first = []
    float32_path = [flat(weights(reference))]  # the float32 weights before and after each step
    for b in data[:3]:
        first.append((float(reference.trainer.train_step(b)), float(variant.trainer.train_step(b))))
        float32_path.append(flat(weights(reference)))
    # bfloat16 keeps ~3 significant digits; XLA alone only reorders float32 sums.
    tolerance = 2e-2 if amp else 1e-5
    for expected, actual in first:
        assert actual == pytest.approx(expected, rel=tolerance)
    if not amp:
        for a, b in zip(weights(reference), weights(variant), strict=True):
            np.testing.assert_allclose(b, a, atol=1e-5)
        return
    # bfloat16 must stay within bfloat16 rounding of float32, whether the CPU
    # emulates bfloat16 matmuls or runs them natively (oneDNN on AVX-512 BF16).
    # A step rounds about 30 tensors to bfloat16 (per Dense layer: kernel,
    # matmul and bias-add outputs forward, the 3 products backward; the
    # interaction's operands and products), each a relative error <= u = 2**-8.
    # If all of them add up, to first order, the step's gradient is off by ~30u
    # in norm, and so is its Adagrad update lr * g / sqrt(accumulator): the
    # normalisation only damps a relative error in g. The steps' errors add, so
    #   ||w_bf16 - w_fp32|| <= 32u * sum_k ||w_fp32[k+1] - w_fp32[k]||
    # (norms over all weights; plus float32 rounding of the weights). There is
    # no such bound weight by weight: one whose updates nearly cancel can have
    # any relative error. Measured on an AVX2 CPU: 3u here (1u with XLA), at
    # most 19u over 8 seeds x 2 batch windows; a bfloat16 run with learning
    # rate 0.3 or 0.1 instead of 0.2 gives 58u and 74u.
    float32_steps = sum(np.linalg.norm(after - before) for before, after in pairwise(float32_path))
    distance = np.linalg.norm(flat(weights(variant)) - float32_path[-1])
    float32_rounding = np.finfo(np.float32).eps * np.linalg.norm(float32_path[-1])
    allowed = 32 * BFLOAT16_UNIT_ROUNDOFF * float32_steps + float32_rounding
    assert distance <= allowed, (
        f"bfloat16 weights are {distance / (BFLOAT16_UNIT_ROUNDOFF * float32_steps):.1f}u "
        "times the float32 steps' length from the float32 ones; allowed 32u"
    )
    losses = [np.mean([float(variant.trainer.train_step(b)) for b in data]) for _ in range(6)]
    assert losses[-1] < 0.95 * losses[0], losses


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_resume_gives_the_same_weights_as_an_uninterrupted_run(
    dataset: Path, tmp_path: Path, optimizer: str
) -> None:
    data = batches(dataset, 10)
    straight = assembled_run(dataset, optimizer=optimizer)
    assert straight.trainer is not None
    for b in data:
        straight.trainer.train_step(b)

    first = assembled_run(dataset, optimizer=optimizer)
    assert first.trainer is not None
    for b in data[:5]:
        first.trainer.train_step(b)
    path = save_training_state(first.trainer, tmp_path, {"model": first.model_config.to_dict()})

    # Another initialization: everything must be restored.
    resumed = assembled_run(dataset, optimizer=optimizer, seed=99)
    assert resumed.trainer is not None
    checkpoint = Checkpoint(path)
    check_model_matches(checkpoint, resumed.model_config.to_dict())
    assert restore_training_state(resumed.trainer, checkpoint) == 5
    for b in data[5:]:
        resumed.trainer.train_step(b)
    # The same process and sums: equal bit for bit (docs/testing.md).
    for a, b in zip(weights(straight), weights(resumed), strict=True):
        np.testing.assert_array_equal(b, a)
    straight_state = optimizer_state(straight)
    resumed_state = optimizer_state(resumed)
    assert set(straight_state) == set(resumed_state)
    for name, value in straight_state.items():
        np.testing.assert_array_equal(resumed_state[name], value, err_msg=name)


def optimizer_state(s: AssembledRun) -> dict[str, np.ndarray]:
    """The optimizer's step count and every slot of every variable, by name."""
    assert s.trainer is not None
    optimizer = s.trainer.optimizer
    state = {"iterations": optimizer.iterations.numpy()}
    for variable in [*s.trainer.dense_variables, *s.trainer.embedding_variables]:
        for slot, value in optimizer.slots(variable).items():
            state[f"{variable.name}/{slot}"] = value.numpy()
    return state


def test_checkpoint_of_another_model_is_refused(dataset: Path, tmp_path: Path) -> None:
    s = assembled_run(dataset)
    assert s.trainer is not None
    path = save_training_state(s.trainer, tmp_path, {"model": s.model_config.to_dict()})
    other = assembled_run(dataset, embedding_dim=4, bottom_mlp_dims=(9, 4))
    with pytest.raises(CheckpointError, match=r"embedding_dim: checkpoint 6, this run 4"):
        check_model_matches(Checkpoint(path), other.model_config.to_dict())
    adam = assembled_run(dataset, optimizer="adam")
    assert adam.trainer is not None
    with pytest.raises(
        CheckpointError, match=r"--optimizer adagrad, this run uses --optimizer adam"
    ):
        restore_training_state(adam.trainer, Checkpoint(path))


def assert_step_3_was_skipped_and_stops_training(
    s: AssembledRun, good: list[np.ndarray], tmp_path: Path
) -> None:
    """The weights are those of the last good step, training stops naming step 3
    (0-based) and no checkpoint can be written after it."""
    assert s.trainer is not None
    for a, b in zip(good, weights(s), strict=True):
        np.testing.assert_array_equal(b, a)
    with pytest.raises(NonFiniteLossError, match=r"not finite at step 3 .*--learning_rate"):
        s.trainer.check_finite()
    with pytest.raises(NonFiniteLossError):
        save_training_state(s.trainer, tmp_path, {})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("poison", "loss_is_finite"),
    [
        pytest.param(nan_in_one_logit, False, id="nan_loss"),
        pytest.param(nan_in_one_vector_gradient, True, id="nan_gradient_finite_loss"),
    ],
)
def test_a_non_finite_step_is_not_applied_and_stops_training(
    dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    poison: Callable[[DenseForward, tf.Variable], DenseForward],
    loss_is_finite: bool,
) -> None:
    s = assembled_run(dataset)
    assert s.trainer is not None
    # The trainer traces dense_forward on its first step, so patch it before
    # that; the switch is a variable, read by the trace at every step.
    poisoned = tf.Variable(False)
    monkeypatch.setattr(s.model, "dense_forward", poison(s.model.dense_forward, poisoned))
    data = batches(dataset, 4)
    for b in data[:3]:
        s.trainer.train_step(b)
    s.trainer.check_finite()  # the patch changes nothing while off
    good = weights(s)
    poisoned.assign(True)
    loss = float(s.trainer.train_step(data[3]))
    assert bool(np.isfinite(loss)) == loss_is_finite, loss
    assert_step_3_was_skipped_and_stops_training(s, good, tmp_path)


def test_nan_in_a_numerical_input_is_not_applied_and_stops_training(
    dataset: Path, tmp_path: Path
) -> None:
    s = assembled_run(dataset)
    assert s.trainer is not None
    data = batches(dataset, 4)
    for b in data[:3]:
        s.trainer.train_step(b)
    good = weights(s)
    poisoned = data[3]._replace(
        numerical=tf.tensor_scatter_nd_update(data[3].numerical, [[0, 0]], [NAN])
    )
    # No assertion on the loss: where oneDNN's ReLU maps NaN to 0 (x86 with
    # AVX-512) it is finite, elsewhere NaN. The first layer's kernel gradient
    # (input^T @ upstream) is NaN on every CPU, so the step is never applied.
    s.trainer.train_step(poisoned)
    assert_step_3_was_skipped_and_stops_training(s, good, tmp_path)


CROSS = {
    "interaction": "cross",
    "embedding_dim": (4, 6, 3, 5, 8),  # one width per table
    "bottom_mlp_dims": (9, 7),  # any width: the cross network concatenates
    "num_cross_layers": 2,
    "cross_layer_projection_dim": 5,
}


@pytest.mark.parametrize(("amp", "xla"), [(False, False), (True, False), (False, True)])
def test_cross_with_per_table_widths_trains(dataset: Path, amp: bool, xla: bool) -> None:
    s = assembled_run(dataset, learning_rate=0.1, amp=amp, xla=xla, **CROSS)
    assert s.trainer is not None
    assert [v.shape[1] for v in s.trainer.embedding_variables] == [4, 6, 3, 5, 8]
    # Top MLP input: 7 (bottom) + 26 (embeddings), the cross network's width.
    assert s.model.top_mlp.layers[0].kernel.shape == (7 + 26, 11)
    cross = [v for v in s.trainer.dense_variables if "cross" in v.path]
    assert len(cross) == 2 * 3  # per layer: projection, kernel, bias
    before = [v.numpy() for v in cross]
    data = batches(dataset, 8)
    losses = [np.mean([float(s.trainer.train_step(b)) for b in data]) for _ in range(6)]
    assert losses[-1] < 0.95 * losses[0], losses
    assert all(not np.array_equal(a, v.numpy()) for a, v in zip(before, cross, strict=True))


def test_a_dot_checkpoint_of_before_cross_layers_restores(dataset: Path, tmp_path: Path) -> None:
    """Manifests written before the cross interaction and pooling existed have
    no such fields: they describe dot models that sum, and restore into one."""
    s = assembled_run(dataset)
    assert s.trainer is not None
    for b in batches(dataset, 2):
        s.trainer.train_step(b)
    old = s.model_config.to_dict()
    for key in ("interaction", "num_cross_layers", "cross_layer_projection_dim", "pooling"):
        del old[key]
    path = save_training_state(s.trainer, tmp_path, {"model": old})
    resumed = assembled_run(dataset, seed=99)
    assert resumed.trainer is not None
    check_model_matches(Checkpoint(path), resumed.model_config.to_dict())
    assert restore_training_state(resumed.trainer, Checkpoint(path)) == 2
    for a, b in zip(weights(s), weights(resumed), strict=True):
        np.testing.assert_array_equal(b, a)


def test_a_cross_checkpoint_is_refused_by_a_dot_model(dataset: Path, tmp_path: Path) -> None:
    cross = assembled_run(dataset, **CROSS)
    assert cross.trainer is not None
    path = save_training_state(cross.trainer, tmp_path, {"model": cross.model_config.to_dict()})
    dot = assembled_run(dataset)
    with pytest.raises(CheckpointError, match=r"interaction: checkpoint 'cross', this run 'dot'"):
        check_model_matches(Checkpoint(path), dot.model_config.to_dict())


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_int64_ids_train_as_int32_ids_do(
    dataset: Path, tmp_path_factory: pytest.TempPathFactory, optimizer: str
) -> None:
    """The same rows stored with int64 ids (as tables of more than 2^31 rows
    need): int64 ids reach the lookups and the sparse updates, with the
    weights of the int32 run."""
    rows = {"train": 20 * BATCH, "test": 500}
    wide = synthetic_dataset(tmp_path_factory, SMALL_TABLES, 3, rows, 4, id_dtype="int64")
    narrow_run = assembled_run(dataset, optimizer=optimizer)
    wide_run = assembled_run(wide, optimizer=optimizer)
    assert narrow_run.trainer is not None and wide_run.trainer is not None
    for narrow_batch, wide_batch in zip(batches(dataset, 4), batches(wide, 4), strict=True):
        assert wide_batch.categorical.dtype == tf.int64
        narrow_run.trainer.train_step(narrow_batch)
        wide_run.trainer.train_step(wide_batch)
    for a, b in zip(weights(narrow_run), weights(wide_run), strict=True):
        np.testing.assert_array_equal(b, a)
