"""ShardedEmbeddings and the Trainer on W ranks simulated in one process (one
thread per rank, harness/simulated_ranks.py), against one process on the
global batch: every rank's vectors, every shard's initial values and gradient,
and the weights after a few training steps, for plans of every kind, a rank that
holds no model-parallel shard, and both input modes. Real horovodrun processes
run the same plans in tests/integration/test_hybrid_parallel.py."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from dataloading.files import RaggedIds
from dataloading.split_binary import Batch
from dlrm.embedding.base import EmbeddingGradients, Embeddings
from dlrm.embedding.local import LocalEmbeddings
from dlrm.embedding.planner.types import TableSpec
from dlrm.embedding.shard import ShardingKind
from dlrm.embedding.sharded import ShardedEmbeddings
from dlrm.embedding.update import piece_slices
from dlrm.model.config import ModelConfig
from dlrm.model.dlrm import Dlrm
from dlrm.optim.optimizers import create_optimizer
from dlrm.train.precision import choose_precision
from dlrm.train.schedule import DlrmSchedule, ScheduleConfig
from dlrm.train.trainer import Trainer
from harness.non_finite import nan_in_one_logit, nan_in_one_vector_gradient
from harness.placements import DIM, plan_for
from harness.simulated_ranks import Hub, SimulatedCollectives, run_ranks

CARDINALITIES = (23, 7, 300, 11, 5)
HOTNESS = (1, 2, 1, 3, 1)
ONE_HOT = (1, 1, 1, 1, 1)
# 0: a variable number of ids per row (empty rows included), as a tf.RaggedTensor.
VARIABLE = (0, 2, 1, 0, 0)
MEAN_POOLING = ("mean", "mean", "sum", "sum", "mean")
MAX_VARIABLE = 4
UNIFORM_DIMS = (DIM,) * len(CARDINALITIES)
UNEQUAL_DIMS = (4, 7, 6, 5, 8)  # odd and even: column slices of unequal widths too
GLOBAL_BATCH = 12  # divides by 2 and 3
NUM_NUMERICAL = 3
SEED = 3
PLANS = ("mixed", "idle_rank", "row_wise_rank", "planner", "data_parallel", "column_wise")


def specs(
    hotness: tuple[int, ...] = HOTNESS, dims: tuple[int, ...] = UNIFORM_DIMS
) -> list[TableSpec]:
    # The planner costs a variable-length table by an estimate of its ids per row.
    return [TableSpec(c, d, h or 2) for c, d, h in zip(CARDINALITIES, dims, hotness, strict=True)]


def table_columns(dims: tuple[int, ...], tables: list[int]) -> list[int]:
    """The columns of `tables` in the layers' output [L, sum of dims]."""
    offsets = np.cumsum((0, *dims))
    return [c for t in tables for c in range(offsets[t], offsets[t + 1])]


def global_ids(rng: np.random.Generator, hotness: tuple[int, ...]) -> list[Any]:
    """Ids [G, hotness_t] per table; `RaggedIds` for a variable-length one."""
    out: list[Any] = []
    for c, h in zip(CARDINALITIES, hotness, strict=True):
        if h == 0:
            lengths = rng.integers(0, MAX_VARIABLE + 1, GLOBAL_BATCH).astype(np.int64)
            lengths[1] = 0  # an empty row, always
            values = rng.integers(0, c, int(lengths.sum())).astype(np.int32)
            out.append(RaggedIds(values, lengths))
        else:
            out.append(rng.integers(0, c, (GLOBAL_BATCH, h)).astype(np.int32))
    return out


def rows_of(ids: Any, start: int, stop: int) -> Any:
    if isinstance(ids, RaggedIds):
        offsets = ids.offsets()
        return RaggedIds(ids.values[offsets[start] : offsets[stop]], ids.row_lengths[start:stop])
    return ids[start:stop]


def as_tensor(ids: Any, id_dtype: Any = np.int32) -> Any:
    if isinstance(ids, RaggedIds):
        return tf.RaggedTensor.from_row_lengths(ids.values.astype(id_dtype), ids.row_lengths)
    return tf.constant(ids.astype(id_dtype))


def loader_ids(
    layer: ShardedEmbeddings, ids: list[np.ndarray], rank: int, id_dtype: Any = np.int32
) -> Any:
    """What the loader gives `rank`: with model-parallel input, the global batch
    of the layer's `input_tables`, in that order; with data-parallel input, the
    local rows of every table. [B, n] when every table read is one-hot (n = 0
    when none is), else a tuple of [B, hotness]."""
    if layer.data_parallel_input:
        rows = GLOBAL_BATCH // layer.world_size
        read = [rows_of(x, rank * rows, (rank + 1) * rows) for x in ids]
    else:
        rows = GLOBAL_BATCH
        read = [ids[t] for t in layer.input_tables]
    if all(not isinstance(x, RaggedIds) and x.shape[1] == 1 for x in read):
        # A rank that reads no table gets [B, 0], as from the loader.
        return tf.constant(np.concatenate([np.empty((rows, 0)), *read], axis=1).astype(id_dtype))
    return tuple(as_tensor(x, id_dtype) for x in read)


def local_rows_of(array: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    rows = len(array) // world_size
    return array[rank * rows : (rank + 1) * rows]


# ----------------------------------------------------- lookup and its backward


@functools.cache
def reference(
    hotness: tuple[int, ...],
    dims: tuple[int, ...] = UNIFORM_DIMS,
    pooling: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """LocalEmbeddings' vectors and table gradients for one global batch."""
    rng = np.random.default_rng(0)
    ids = global_ids(rng, hotness)
    upstream = rng.normal(size=(GLOBAL_BATCH, sum(dims))).astype(np.float32)
    local = LocalEmbeddings(CARDINALITIES, dims, seed=SEED, hotness=hotness, pooling=pooling)
    with tf.GradientTape() as tape:
        vectors = local(tuple(as_tensor(x) for x in ids))
    gradients = tape.gradient(vectors, local.tables, output_gradients=tf.constant(upstream))
    return {
        "ids": ids,
        "upstream": upstream,
        "vectors": vectors.numpy(),
        "gradients": [tf.convert_to_tensor(g).numpy() for g in gradients],
        "tables": [t.numpy() for t in local.tables],
    }


def lookup_on_rank(
    collectives: SimulatedCollectives,
    kind: str,
    hotness: tuple[int, ...],
    data_parallel_input: bool,
    in_function: bool,
    wire_dtype: tf.DType = tf.float32,
    output_dtype: tf.DType = tf.float32,
    upstream_of: Callable[[np.ndarray], np.ndarray] = lambda upstream: upstream,
    dims: tuple[int, ...] = UNIFORM_DIMS,
    id_dtype: Any = np.int32,
    pooling: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """One rank's vectors and shard gradients, by the layer's forward and backward
    passes as the trainer runs them (with `upstream_of(the reference's upstream
    gradient)`); a replicated table's gradient is already summed over the ranks."""
    ref = reference(hotness, dims, pooling)
    rank, world = collectives.rank, collectives.world_size
    layer = ShardedEmbeddings(
        plan_for(kind, specs(hotness, dims), world, GLOBAL_BATCH),
        collectives,
        seed=SEED,
        data_parallel_input=data_parallel_input,
        wire_dtype=wire_dtype,
        hotness=hotness,
        pooling=pooling,
        output_dtype=output_dtype,
    )
    local_rows = GLOBAL_BATCH // world

    def step(ids: Any, upstream: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, list[Any]]:
        lookup = layer.forward(ids, local_rows, [(0, None)])
        vectors = lookup.chunks[0].vectors
        # The trainer's upstream gradient comes from the vectors, so each rank runs
        # its two alltoalls in turn (see simulated_ranks: a waiting collective
        # holds one of TensorFlow's few inter-op threads).
        with tf.control_dependencies([vectors]):
            upstream = tf.identity(upstream)
        gradients = layer.backward(lookup, [upstream])
        # The receipt is what the update checks; here the test's output uses it.
        done = tf.logical_and(gradients.finite, gradients.receipt == 0)
        return done, vectors, dense_shard_gradients(layer, gradients)

    # autograph=False, as the trainer's and the predictor's steps: the layer branches
    # on tensors only through TensorFlow's ops, and AutoGraph's rewrite of its source
    # took about half a second of every case.
    run = tf.function(step, autograph=False) if in_function else step
    upstream = tf.constant(local_rows_of(upstream_of(ref["upstream"]), rank, world))
    upstream = tf.cast(upstream, output_dtype)  # the trainer's: the vectors' dtype
    finite, vectors, gradients = run(loader_ids(layer, ref["ids"], rank, id_dtype), upstream)
    assert bool(finite)
    return {
        "vectors": vectors.numpy(),
        "shards": [
            (shard, gradient.numpy())
            for (shard, _), gradient in zip(layer.local_shards(), gradients, strict=True)
        ],
        "holds_model_parallel": bool(layer.mine),
    }


def dense_shard_gradients(layer: Embeddings, gradients: EmbeddingGradients) -> list[tf.Tensor]:
    """The gradient of every shard in `layer.local_shards()`, densified from its
    pieces (zeros for a shard no piece names)."""
    shards = layer.local_shards()
    dense = [tf.zeros(variable.shape) for _, variable in shards]
    for piece in gradients.pieces:
        shard = shards[piece.target][0]
        dense[piece.target] += tf.convert_to_tensor(piece_slices(piece, shard))
    return dense


def check_against_one_process(
    world_size: int, kind: str, hotness: tuple[int, ...], data_parallel_input: bool, **options: Any
) -> list[dict[str, Any]]:
    """`lookup_on_rank(..., **options)` on every rank, against one process; the ranks' results."""
    results = run_ranks(
        world_size, lambda c: lookup_on_rank(c, kind, hotness, data_parallel_input, **options)
    )
    ref = reference(hotness, options.get("dims", UNIFORM_DIMS), options.get("pooling"))
    replicated: set[int] = set()
    covered = [np.zeros(t.shape, int) for t in ref["tables"]]
    for rank, result in enumerate(results):
        want = local_rows_of(ref["vectors"], rank, world_size)
        np.testing.assert_allclose(
            result["vectors"], want, rtol=1e-5, atol=1e-7, err_msg=f"rank {rank}'s vectors"
        )
        for shard, gradient in result["shards"]:
            whole = (slice(*shard.rows), slice(*shard.columns))
            if shard.kind == ShardingKind.DATA_PARALLEL:  # summed over the ranks by the layer
                replicated.add(shard.table)
            else:
                covered[shard.table][whole] += 1
            want = ref["gradients"][shard.table][whole]
            message = f"rank {rank}'s gradient of {shard.name}"
            np.testing.assert_allclose(gradient, want, rtol=1e-5, atol=1e-6, err_msg=message)
    for table, count in enumerate(covered):  # each table model-parallel xor replicated
        expected = 0 if table in replicated else 1
        assert (count == expected).all(), f"table {table}: elements held {np.unique(count)} times"
    return results


@pytest.mark.parametrize("dims", [UNIFORM_DIMS, UNEQUAL_DIMS], ids=["uniform", "unequal"])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", PLANS)
@pytest.mark.parametrize("data_parallel_input", [False, True])
def test_ranks_get_the_vectors_and_gradients_of_one_process(
    world_size: int, kind: str, data_parallel_input: bool, dims: tuple[int, ...]
) -> None:
    results = check_against_one_process(
        world_size, kind, HOTNESS, data_parallel_input, in_function=False, dims=dims
    )
    if kind == "idle_rank":
        assert [r["holds_model_parallel"] for r in results] == [True] + [False] * (world_size - 1)


@pytest.mark.parametrize("kind", ["mixed", "idle_rank"])
@pytest.mark.parametrize("data_parallel_input", [False, True])
def test_one_hot_ids_in_a_tf_function(kind: str, data_parallel_input: bool) -> None:
    """The loader's [B, n] form, and the collectives as graph ops: on the idle
    rank, nothing uses the received ids or lookup gradients, and pruning or
    constant-folding either collective would leave the other rank waiting."""
    check_against_one_process(2, kind, ONE_HOT, data_parallel_input, in_function=True)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", PLANS)
@pytest.mark.parametrize("data_parallel_input", [False, True])
def test_variable_length_ids_with_mean_pooling(
    world_size: int, kind: str, data_parallel_input: bool
) -> None:
    """Variable-length tables (ragged ids, empty rows) with sum and mean pooling,
    in a tf.function: their lengths and ids cross the id alltoalls, row ranges
    divide their partial sums by the whole row's count."""
    check_against_one_process(
        world_size, kind, VARIABLE, data_parallel_input, in_function=True, pooling=MEAN_POOLING
    )


def test_local_lookup_pools_variable_length_rows_by_sum_and_mean() -> None:
    """The one-process reference itself, against numpy: a row's vectors summed,
    or divided by its count; an empty row is zeros."""
    ref = reference(VARIABLE, UNIFORM_DIMS, MEAN_POOLING)
    offsets = np.cumsum((0, *UNIFORM_DIMS))
    for table, (ids, pooling) in enumerate(zip(ref["ids"], MEAN_POOLING, strict=True)):
        got = ref["vectors"][:, offsets[table] : offsets[table + 1]]
        rows = (
            [ids.values[a:b] for a, b in itertools.pairwise(ids.offsets())]
            if isinstance(ids, RaggedIds)
            else list(ids)
        )
        for row, row_ids in enumerate(rows):
            want = ref["tables"][table][row_ids].sum(axis=0)
            if pooling == "mean" and len(row_ids):
                want = want / len(row_ids)
            np.testing.assert_allclose(got[row], want, rtol=1e-6, atol=1e-7)
    assert not ref["vectors"][1, : offsets[1]].any()  # row 1 of table 0 is empty


@pytest.mark.parametrize("kind", ["mixed", "row_wise_rank"])
@pytest.mark.parametrize("data_parallel_input", [False, True])
def test_int64_ids(kind: str, data_parallel_input: bool) -> None:
    """The loader gives int64 ids when the dataset stores any as int64: they are
    exchanged (data-parallel input), offset into row ranges and looked up as
    int32 ids are."""
    check_against_one_process(
        2, kind, HOTNESS, data_parallel_input, in_function=True, id_dtype=np.int64
    )


def bfloat16_rounded(values: np.ndarray) -> np.ndarray:
    return tf.cast(tf.cast(values, tf.bfloat16), tf.float32).numpy()


def one_hot_gradient(ref: dict[str, Any], table: int, upstream: np.ndarray) -> np.ndarray:
    """A one-hot table's gradient: each row's upstream vectors, summed."""
    gradient = np.zeros_like(ref["tables"][table])
    np.add.at(gradient, ref["ids"][table][:, 0], upstream[:, table_columns(UNIFORM_DIMS, [table])])
    return gradient


class WireRecorder(SimulatedCollectives):
    """Records the dtype of what each named alltoall sends."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.sent_dtypes: dict[str, tf.DType] = {}

    def alltoall(self, tensor: tf.Tensor, splits: Any, name: str) -> tf.Tensor:
        self.sent_dtypes[name] = tf.convert_to_tensor(tensor).dtype
        return super().alltoall(tensor, splits, name)


@pytest.mark.parametrize("output_dtype", [tf.float32, tf.bfloat16])
@pytest.mark.parametrize("kind", ["mixed", "row_wise_rank"])
def test_vectors_and_gradients_cross_in_16_bits_under_amp(
    kind: str, output_dtype: tf.DType
) -> None:
    """Under --amp the model rounds the vectors to bfloat16 first thing, and their
    gradients are bfloat16 values: sent as 16 bits, they arrive as the very
    values one process uses. main.py has the layer give them as bfloat16
    (`output_dtype`), replicated tables' vectors included; float32 output
    rounds only what crossed."""
    hub = Hub(2)
    recorders = [WireRecorder(rank, 2, hub) for rank in range(2)]
    results = run_ranks(
        2,
        lambda c: lookup_on_rank(
            recorders[c.rank],
            kind,
            ONE_HOT,
            data_parallel_input=False,
            in_function=True,
            wire_dtype=tf.bfloat16,
            output_dtype=output_dtype,
            upstream_of=bfloat16_rounded,
        ),
    )
    ref = reference(ONE_HOT)
    # The reference's gradients, for the bfloat16-rounded upstream gradient.
    rounded_upstream = bfloat16_rounded(ref["upstream"])
    for rank, result in enumerate(results):
        sent = recorders[rank].sent_dtypes
        assert sent["embedding_vectors"] == tf.uint16  # bfloat16's bits
        assert sent["embedding_vector_gradients"] == tf.uint16
        # Replicated tables' vectors are looked up here and do not cross.
        replicated = [s.table for s, _ in result["shards"] if s.kind == ShardingKind.DATA_PARALLEL]
        want_vectors = bfloat16_rounded(local_rows_of(ref["vectors"], rank, 2))
        columns = table_columns(UNIFORM_DIMS, replicated)
        if output_dtype == tf.float32:
            want_vectors[:, columns] = local_rows_of(ref["vectors"], rank, 2)[:, columns]
        assert result["vectors"].dtype == output_dtype.as_numpy_dtype
        np.testing.assert_array_equal(result["vectors"].astype(np.float32), want_vectors)
        for shard, gradient in result["shards"]:
            assert gradient.dtype == np.float32, shard.name  # the tables stay float32
            # A replicated table's is summed over the ranks' rows already.
            whole = (slice(*shard.rows), slice(*shard.columns))
            want = one_hot_gradient(ref, shard.table, rounded_upstream)[whole]
            np.testing.assert_allclose(gradient, want, rtol=1e-6, atol=1e-7, err_msg=shard.name)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", PLANS)
def test_every_shard_starts_as_its_slice_of_the_one_process_table(
    world_size: int, kind: str
) -> None:
    tables = reference(HOTNESS)["tables"]
    plan = plan_for(kind, specs(), world_size, GLOBAL_BATCH)
    hub = Hub(world_size)  # building a layer runs no collective
    for rank in range(world_size):
        layer = ShardedEmbeddings(plan, SimulatedCollectives(rank, world_size, hub), seed=SEED)
        assert [s for s, _ in layer.local_shards()], f"rank {rank} holds no shard"
        for shard, variable in layer.local_shards():
            whole = (slice(*shard.rows), slice(*shard.columns))
            np.testing.assert_array_equal(
                variable.numpy(), tables[shard.table][whole], err_msg=shard.name
            )


def test_simulated_ranks_report_the_failing_rank_and_do_not_hang() -> None:
    def work(collectives: SimulatedCollectives) -> None:
        if collectives.rank == 1:
            raise KeyError("boom")
        collectives.alltoall(tf.zeros([2]), [1, 1], name="never_completed")

    with pytest.raises(RuntimeError, match="rank 1 failed: KeyError"):
        run_ranks(2, work, timeout_s=10)


# ------------------------------------------------------------------- training

STEPS = 3
LEARNING_RATES = {"sgd": 0.5, "adam": 0.01, "adagrad": 0.1, "rowwise_adagrad": 0.1}


def make_trainer(
    optimizer: str,
    embeddings: ShardedEmbeddings | None,
    collectives: Any,
    hotness: tuple[int, ...] = HOTNESS,
    dense_chunk_rows: int = 0,
    table_dtype: str = "float32",
) -> Trainer:
    config = ModelConfig(
        NUM_NUMERICAL,
        CARDINALITIES,
        hotness,
        embedding_dim=DIM,
        bottom_mlp_dims=(9, DIM),
        top_mlp_dims=(11, 1),
    )
    model = Dlrm(config, embeddings=embeddings, seed=SEED, table_dtype=table_dtype)
    return Trainer(
        model,
        create_optimizer(optimizer),
        DlrmSchedule(ScheduleConfig(LEARNING_RATES[optimizer])),
        choose_precision(False, False),
        GLOBAL_BATCH,
        collectives=collectives,
        dense_chunk_rows=dense_chunk_rows,
    )


def global_batches(hotness: tuple[int, ...] = HOTNESS) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    return [
        {
            "numerical": rng.normal(size=(GLOBAL_BATCH, NUM_NUMERICAL)).astype(np.float32),
            "ids": global_ids(rng, hotness),
            "label": rng.integers(0, 2, (GLOBAL_BATCH, 1)).astype(np.float32),
            # A padding row (weight 0), as the last batch of an epoch has.
            "weight": np.where(np.arange(GLOBAL_BATCH) == 5, 0.0, 1.0)[:, None].astype(np.float32),
        }
        for _ in range(STEPS)
    ]


def trained_state(trainer: Trainer, losses: list[float]) -> dict[str, Any]:
    shards = trainer.model.embeddings.local_shards()
    slots = trainer.optimizer.slots
    return {
        "losses": np.array(losses),
        "dense": [v.numpy() for v in trainer.dense_variables],
        "shards": [
            (shard, variable.numpy(), {k: s.numpy() for k, s in slots(variable).items()})
            for shard, variable in shards
        ],
    }


@functools.cache
def one_process(
    optimizer: str, hotness: tuple[int, ...] = HOTNESS, table_dtype: str = "float32"
) -> dict[str, Any]:
    keras.utils.set_random_seed(1)
    trainer = make_trainer(optimizer, None, None, hotness, table_dtype=table_dtype)
    initial = [v.numpy() for v in trainer.dense_variables]
    losses = [float(trainer.train_step(rank_batch(trainer, b))) for b in global_batches(hotness)]
    trainer.check_finite()
    return {"initial_dense": initial, **trained_state(trainer, losses)}


def rank_trainer(
    collectives: SimulatedCollectives,
    kind: str,
    optimizer: str,
    data_parallel_input: bool,
    hotness: tuple[int, ...] = HOTNESS,
    dense_chunk_rows: int = 0,
    table_dtype: str = "float32",
) -> Trainer:
    """A rank's trainer, with rank 0's initial dense weights (the one-process
    run's) on every rank."""
    rank, world = collectives.rank, collectives.world_size
    embeddings = ShardedEmbeddings(
        plan_for(kind, specs(hotness), world, GLOBAL_BATCH),
        collectives,
        seed=SEED,
        data_parallel_input=data_parallel_input,
        hotness=hotness,
        table_dtype=table_dtype,
    )
    trainer = make_trainer(
        optimizer, embeddings, collectives, hotness, dense_chunk_rows, table_dtype
    )
    # Rank 0 holds the one-process run's initial dense weights, the others
    # something else: the broadcast must give every rank rank 0's.
    initial = one_process(optimizer, hotness, table_dtype)["initial_dense"] if rank == 0 else None
    for position, variable in enumerate(trainer.dense_variables):
        variable.assign(initial[position] if initial else np.full(variable.shape, 0.1 * rank))
    collectives.broadcast_variables(trainer.dense_variables)
    return trainer


def rank_batch(trainer: Trainer, batch: dict[str, Any], rank: int = 0, world: int = 1) -> Batch:
    """What the loader gives `rank` of the global `batch`; one process gets all of it."""
    local = {k: local_rows_of(batch[k], rank, world) for k in ("numerical", "label", "weight")}
    if world == 1:
        categorical = tuple(as_tensor(x) for x in batch["ids"])
    else:
        categorical = loader_ids(trainer.model.embeddings, batch["ids"], rank)
    return Batch(local["numerical"], categorical, local["label"], local["weight"])


def train_on_rank(
    collectives: SimulatedCollectives,
    kind: str,
    optimizer: str,
    data_parallel_input: bool,
    hotness: tuple[int, ...] = HOTNESS,
    dense_chunk_rows: int = 0,
    table_dtype: str = "float32",
) -> dict[str, Any]:
    rank, world = collectives.rank, collectives.world_size
    trainer = rank_trainer(
        collectives, kind, optimizer, data_parallel_input, hotness, dense_chunk_rows, table_dtype
    )
    losses = [
        float(trainer.train_step(rank_batch(trainer, batch, rank, world)))
        for batch in global_batches(hotness)
    ]
    trainer.check_finite()
    names = collectives.collective_names()
    layer = trainer.model.embeddings
    return {**trained_state(trainer, losses), "collectives": names, "layer": layer}


def weight_atol(optimizer: str) -> float:
    """How far N ranks' weights may be from one process's after `STEPS` steps.

    The ranks sum a step's gradients in another order (over ranks, over chunks),
    which float32 rounds differently. SGD carries that difference as it is. Adam
    divides each gradient element by its own running magnitude, so where an
    element's terms nearly cancel, a rounding difference moves its update by a
    visible share of the learning rate (seen: 4e-7 at lr 0.01, 3 steps, on an
    AVX2-only CPU): allow 1e-4 of the learning rate per step."""
    return 1e-4 * LEARNING_RATES["adam"] * STEPS if optimizer == "adam" else 1e-7


def assert_trained_as_one_process(
    results: list[dict[str, Any]], expected: dict[str, Any], optimizer: str
) -> None:
    atol = weight_atol(optimizer)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5)
    tables = {shard.table: (values, slots) for shard, values, slots in expected["shards"]}
    for rank, result in enumerate(results):
        # Each rank's loss is its local rows' share of the global loss.
        assert result["losses"].shape == expected["losses"].shape
        for position, (ours, theirs) in enumerate(
            zip(result["dense"], expected["dense"], strict=True)
        ):
            close(ours, theirs, atol=atol, err_msg=f"rank {rank} dense {position}")
        for shard, values, slots in result["shards"]:
            whole = (slice(*shard.rows), slice(*shard.columns))
            table_values, table_slots = tables[shard.table]
            close(values, table_values[whole], atol=atol, err_msg=f"rank {rank} {shard.name}")
            for name, slot in slots.items():
                message = f"rank {rank} {shard.name} slot {name}"
                close(slot, table_slots[name][whole], atol=1e-9, err_msg=message)
    close(sum(r["losses"] for r in results), expected["losses"], err_msg="losses")


@pytest.mark.parametrize(
    ("kind", "optimizer", "data_parallel_input", "hotness", "chunk_rows"),
    [
        ("idle_rank", "sgd", False, HOTNESS, 0),  # 0: the dense part in one piece
        ("mixed", "adam", True, HOTNESS, 0),
        ("mixed", "sgd", False, HOTNESS, 0),
        ("mixed", "sgd", False, HOTNESS, 2),  # 6 local rows: chunks 2, 2, 2
        ("mixed", "adam", True, HOTNESS, 4),  # chunks 4, 2
        ("idle_rank", "sgd", False, HOTNESS, 4),  # a rank that holds no shard
        ("row_wise_rank", "adam", True, VARIABLE, 4),  # variable-length ids, row ranges
        ("column_wise", "sgd", False, VARIABLE, 2),
        ("data_parallel", "sgd", False, HOTNESS, 2),  # every table replicated: no exchange
    ],
)
def test_vectors_cross_per_chunk_and_train_as_one_process(
    kind: str,
    optimizer: str,
    data_parallel_input: bool,
    hotness: tuple[int, ...],
    chunk_rows: int,
) -> None:
    """Two ranks train to the weights of one process on the whole batch. With the
    dense part in chunks, each chunk's vectors and their gradients cross between
    ranks on their own (so the next chunk's exchange overlaps this chunk's compute)."""
    results = run_ranks(
        2,
        lambda c: train_on_rank(c, kind, optimizer, data_parallel_input, hotness, chunk_rows),
    )
    assert_trained_as_one_process(results, one_process(optimizer, hotness), optimizer)
    chunks = -(-GLOBAL_BATCH // 2 // chunk_rows) if chunk_rows else 1
    for result in results:
        # One exchange of vectors each way per chunk and step, and no vote of its
        # own: the ranks' verdicts on finiteness travel with the gradients.
        assert "non_finite" not in result["collectives"]
        if kind == "data_parallel":
            assert not any(name.startswith("embedding_vector") for name in result["collectives"])
            continue
        for name in ("embedding_vectors", "embedding_vector_gradients"):
            assert result["collectives"][name] == STEPS
            for chunk in range(1, chunks):
                assert result["collectives"][f"{name}_{chunk}"] == STEPS
            assert f"{name}_{chunks}" not in result["collectives"]


@pytest.mark.parametrize(
    ("kind", "optimizer", "table_dtype"),
    [
        ("mixed", "adagrad", "bfloat16"),
        ("row_wise_rank", "rowwise_adagrad", "float16"),
        ("column_wise", "sgd", "bfloat16"),
        ("data_parallel", "adam", "float16"),
    ],
)
def test_sixteen_bit_tables_on_two_ranks_round_as_one_process(
    kind: str, optimizer: str, table_dtype: str
) -> None:
    """The stochastic rounding's bits hash a row's global id and a value's global
    column, so a shard of any rank draws what the one-process table draws: two
    ranks store the one process's 16-bit values, but where the ranks' float32
    update differs by a rounding (their sums' order) from the one process's
    and falls on the other side of the random threshold (rare): one 16-bit
    step apart there."""
    results = run_ranks(
        2,
        lambda c: train_on_rank(c, kind, optimizer, False, HOTNESS, 0, table_dtype),
    )
    expected = one_process(optimizer, HOTNESS, table_dtype)
    tables = {shard.table: values for shard, values, _ in expected["shards"]}
    unit = 2.0**-7 if table_dtype == "bfloat16" else 2.0**-10  # a 16-bit step, relative
    equal = total = 0
    for result in results:
        for shard, values, _ in result["shards"]:
            assert values.dtype.name == table_dtype
            ours = values.astype(np.float32)
            theirs = tables[shard.table][slice(*shard.rows), slice(*shard.columns)].astype(
                np.float32
            )
            close = np.abs(ours - theirs) <= 1e-6 + 1e-5 * np.abs(theirs)
            equal, total = equal + int(close.sum()), total + close.size
            step_apart = np.abs(ours - theirs) <= unit * np.abs(theirs) * 1.01 + 1e-6
            assert step_apart.all(), shard.name
    assert equal >= 0.99 * total, (equal, total)


def test_a_request_of_one_rank_reaches_every_rank_after_the_same_step() -> None:
    """Rank 1 asks to stop with the second step, rank 0 to checkpoint with the
    third: every rank gets each answer after that same step, through the step's
    own allreduce (no collective of its own), and the requests change no weight."""

    def work(collectives: SimulatedCollectives) -> dict[str, Any]:
        rank, world = collectives.rank, collectives.world_size
        trainer = rank_trainer(collectives, "mixed", "sgd", False)
        answers, losses = [], []
        for step, batch in enumerate(global_batches()):
            requests = [rank == 1 and step == 1, rank == 0 and step == 2]
            loss, agreed = trainer.train_step_agreeing(
                rank_batch(trainer, batch, rank, world), requests
            )
            answers.append(agreed.numpy().tolist())
            losses.append(float(loss))
        names = collectives.collective_names()
        return {**trained_state(trainer, losses), "answers": answers, "collectives": names}

    results = run_ranks(2, work)
    for rank, result in enumerate(results):
        assert result["answers"] == [[False, False], [True, False], [False, True]], rank
        assert not any("request" in name or "stop" in name for name in result["collectives"])
    assert_trained_as_one_process(results, one_process("sgd"), "sgd")


def test_one_process_answers_its_own_requests() -> None:
    trainer = make_trainer("sgd", None, None, HOTNESS)
    inputs = rank_batch(trainer, global_batches()[0])
    for requests in ([False, True], [True, False]):
        _, agreed = trainer.train_step_agreeing(inputs, requests)
        assert agreed.numpy().tolist() == requests


# In the "mixed" plan table 0 is replicated and table 1 lives on rank 1 alone.
POISONS = {
    "loss": nan_in_one_logit,
    "replicated_table_gradient": nan_in_one_vector_gradient,
    "gradient_sent_to_rank_1": functools.partial(nan_in_one_vector_gradient, column=DIM),
}


@pytest.mark.parametrize("chunk_rows", [0, 2])
@pytest.mark.parametrize("poison", POISONS)
def test_a_non_finite_step_on_one_rank_is_applied_on_none(poison: str, chunk_rows: int) -> None:
    """A NaN loss on rank 1, or a NaN in the vectors' gradient rank 0 computes
    (summed into a replicated table's gradient, or sent to the rank that holds the
    table): no rank applies the step, and every rank records it."""

    def work(collectives: SimulatedCollectives) -> dict[str, Any]:
        rank, world = collectives.rank, collectives.world_size
        trainer = rank_trainer(collectives, "mixed", "sgd", False, dense_chunk_rows=chunk_rows)
        poisoned = tf.Variable(False)
        if (rank == 1) == (poison == "loss"):
            model = trainer.model
            model.dense_forward = POISONS[poison](model.dense_forward, poisoned)  # type: ignore[method-assign]
        batches = global_batches()
        trainer.train_step(rank_batch(trainer, batches[0], rank, world))
        trainer.check_finite()  # the patch changes nothing while off
        good = trained_state(trainer, [])
        poisoned.assign(True)
        trainer.train_step(rank_batch(trainer, batches[1], rank, world))
        return {
            "good": good,
            "after": trained_state(trainer, []),
            "step": trainer.first_non_finite_step.numpy(),
        }

    for rank, result in enumerate(run_ranks(2, work)):
        assert result["step"] == 1, f"rank {rank}"
        for ours, theirs in zip(result["after"]["dense"], result["good"]["dense"], strict=True):
            np.testing.assert_array_equal(ours, theirs, err_msg=f"rank {rank} dense")
        for (shard, ours, _), (_, theirs, _) in zip(
            result["after"]["shards"], result["good"]["shards"], strict=True
        ):
            np.testing.assert_array_equal(ours, theirs, err_msg=f"rank {rank} {shard.name}")


@pytest.mark.parametrize(
    ("kind", "data_parallel_input", "hotness", "chunk_rows", "world_size"),
    [
        ("idle_rank", False, ONE_HOT, 0, 2),  # ranks 1.. hold no model-parallel shard
        ("idle_rank", True, HOTNESS, 2, 3),  # and receive ids they have no use for
        ("one_rank", False, ONE_HOT, 0, 2),  # ranks 1.. hold nothing, update nothing
        ("one_rank", True, HOTNESS, 2, 3),
        ("row_wise_rank", True, VARIABLE, 4, 2),  # a second id exchange: ragged ids
        ("mixed", True, VARIABLE, 2, 3),
        ("data_parallel", False, HOTNESS, 2, 2),  # no vectors cross at all
    ],
)
def test_every_rank_runs_the_same_collectives_in_a_traced_step(
    kind: str,
    data_parallel_input: bool,
    hotness: tuple[int, ...],
    chunk_rows: int,
    world_size: int,
) -> None:
    """The training step as TensorFlow runs it (one tf.function, Horovod-like
    collectives that are not stateful ops) on ranks that hold different shards:
    a rank whose graph lacked a collective another rank's has (pruned because
    the rank does not use what it receives, or folded because it sends a
    constant) would leave the others waiting, and `run_ranks` would report them
    stuck. Every rank runs the same collectives, as often: the layer keeps its
    exchanges alive itself (`StepExchanges`), whatever the trainer checks."""

    def work(collectives: SimulatedCollectives) -> dict[str, Any]:
        trained = train_on_rank(collectives, kind, "adam", data_parallel_input, hotness, chunk_rows)
        # And the forward pass alone, as prediction traces it: ids a rank does not
        # use are received all the same (the vectors' exchange depends on them).
        layer = trained["layer"]
        rank, world = collectives.rank, collectives.world_size
        ids = loader_ids(layer, global_batches(hotness)[0]["ids"], rank)
        tf.function(lambda x: layer(x, local_rows=GLOBAL_BATCH // world), autograph=False)(ids)
        return {"trained": trained["collectives"], "all": collectives.collective_names()}

    results = run_ranks(world_size, work, timeout_s=20)
    for key in ("trained", "all"):
        names = [result[key] for result in results]
        assert all(theirs == names[0] for theirs in names), names
    # The trainer's one allreduce per step: the verdicts with the dense gradients.
    names = results[0]["trained"]
    (trainer_sum,) = [name for name in names if name.startswith("non_finite|")]
    assert names[trainer_sum] == STEPS


def trainer_variables(trainer: Trainer) -> list[tf.Variable]:
    """Every variable a training step changes: weights, their slots, the optimizer's
    and the trainer's counters."""
    weights = [*trainer.dense_variables, *trainer.embedding_variables]
    slots = [slot for v in weights for slot in trainer.optimizer.slots(v).values()]
    counters = [trainer.optimizer.iterations, trainer.step, trainer.schedule_offset]
    verdicts = [trainer.first_non_finite_step, trainer.first_non_finite_loss]
    return [*weights, *slots, *counters, *verdicts]


@pytest.mark.parametrize(
    ("kind", "hotness", "chunk_rows", "world_size"),
    [
        ("mixed", HOTNESS, 0, 2),
        ("row_wise_rank", VARIABLE, 4, 2),  # ragged ids: a second id exchange ahead too
        ("idle_rank", HOTNESS, 2, 3),  # ranks that receive ids they have no shard for
    ],
)
def test_ids_exchanged_a_step_ahead_train_bit_for_bit_as_in_their_own_step(
    kind: str, hotness: tuple[int, ...], chunk_rows: int, world_size: int
) -> None:
    """Data-parallel input with each step naming the next batch: the next batch's
    ids cross during this step (only the first step's cross alone, before it), and
    the weights, slots and losses are bit for bit those of steps that exchange
    their own ids. A batch other than the one named exchanges its own again."""

    def work(collectives: SimulatedCollectives) -> dict[str, Any]:
        rank, world = collectives.rank, collectives.world_size
        states: dict[str, Any] = {}
        # One trainer, its variables set back to their starting values before each
        # mode: the modes share its traced steps (their signatures are the same).
        trainer = rank_trainer(collectives, kind, "adam", True, hotness, chunk_rows)
        assert trainer.exchanges_ids_ahead
        start = [(v, v.numpy()) for v in trainer_variables(trainer)]
        alone = 0
        exchange = trainer._exchange_ids

        def counted(*args: Any) -> Any:
            nonlocal alone
            alone += 1
            return exchange(*args)

        trainer._exchange_ids = counted
        for mode in ("in_step", "ahead", "other_batch"):
            for variable, value in start:
                variable.assign(value)
            trainer.ids_exchanged_ahead = 0
            alone = 0
            batches = [rank_batch(trainer, b, rank, world) for b in global_batches(hotness)]
            losses = []
            for step, batch in enumerate(batches):
                following = None
                if mode != "in_step" and step + 1 < len(batches):
                    following = batches[step + 1]
                if mode == "other_batch" and step == 1:
                    batch = Batch(*batch)  # equal, but not the batch named: exchanged again
                loss, _ = trainer.train_step_agreeing(batch, [False, False], following)
                losses.append(float(loss))
            trainer.check_finite()
            states[mode] = {**trained_state(trainer, losses), "alone": alone}
        states["collectives"] = collectives.collective_names()
        return states

    results = run_ranks(world_size, work, timeout_s=40)
    for rank, result in enumerate(results):
        assert result["in_step"]["alone"] == 0
        assert result["ahead"]["alone"] == 1  # the first step's; the others' crossed ahead
        assert result["other_batch"]["alone"] == 2
        # Every step's ids crossed once in each mode, and in "other_batch" the named
        # batch's too (unused).
        assert result["collectives"]["embedding_ids"] == 3 * STEPS + 1, rank
        expected = result["in_step"]
        for mode in ("ahead", "other_batch"):
            ours = result[mode]
            np.testing.assert_array_equal(ours["losses"], expected["losses"], err_msg=mode)
            for position, (a, b) in enumerate(zip(ours["dense"], expected["dense"], strict=True)):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} {mode} dense {position}")
            for (shard, a, a_slots), (_, b, b_slots) in zip(
                ours["shards"], expected["shards"], strict=True
            ):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} {mode} {shard.name}")
                for name in a_slots:
                    np.testing.assert_array_equal(a_slots[name], b_slots[name], err_msg=name)
    assert_trained_as_one_process(
        [result["ahead"] for result in results], one_process("adam", hotness), "adam"
    )


def test_one_process_and_model_parallel_input_ignore_a_following_batch() -> None:
    """Where no ids cross between the ranks, naming the next batch changes nothing."""
    expected = one_process("sgd")
    keras.utils.set_random_seed(1)  # as one_process's
    trainer = make_trainer("sgd", None, None, HOTNESS)
    assert not trainer.exchanges_ids_ahead
    batches = [rank_batch(trainer, b) for b in global_batches()]
    losses = [
        float(trainer.train_step_agreeing(batch, [False, False], following)[0])
        for batch, following in zip(batches, [*batches[1:], None], strict=True)
    ]
    np.testing.assert_array_equal(losses, expected["losses"])

    def work(collectives: SimulatedCollectives) -> bool:
        return rank_trainer(collectives, "mixed", "sgd", False).exchanges_ids_ahead

    assert run_ranks(2, work) == [False, False]
