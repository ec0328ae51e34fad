"""tf.data input of a split-binary FeatureSpec dataset, sharded per rank.

Rank and world size are arguments; nothing here imports horovod. With global
batch size G, world size W and local batch L = G / W, batch b of rank r holds:

- labels, numericals and weights of global rows [b*G + r*L, b*G + (r+1)*L);
- categorical ids, by `input_mode`:
  - "model_parallel": the tables in `local_tables`, for the whole global batch
    [b*G, (b+1)*G) (the rank looks them up for every rank, then alltoall);
  - "data_parallel": every table, for the rank's local rows (ids travel later).

A last batch with fewer than G rows is dropped, or padded with zero rows whose
weight is 0, as `last_batch` says.

Each batch's ids are checked against their table's cardinality as they are read
(a GPU lookup of an id outside the table silently returns zeros): an id outside
[0, cardinality) raises DatasetError naming the table, the file, the row and the
value. Inside tf.data that error arrives wrapped in a TensorFlow error; iterate
with `SplitBinaryDataset.batches` (or `raise_dataset_errors`) to get the
DatasetError back.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, TypeVar

import numpy as np
import tensorflow as tf

from dataloading.errors import DatasetError
from dataloading.files import (
    BinaryFile,
    RaggedIds,
    SplitBinaryFiles,
    check_id_rows,
    check_offset_rows,
    check_ragged_id_rows,
)
from feature_spec import FeatureSpec, ids_dtype

T = TypeVar("T")

# Brackets a DatasetError's message inside the TensorFlow error that carries it out
# of tf.numpy_function, so that `raise_dataset_errors` can find it again.
_ERROR_START, _ERROR_END = "<<DatasetError>>", "<</DatasetError>>"
_ERROR_PATTERN = re.compile(re.escape(_ERROR_START) + "(.*?)" + re.escape(_ERROR_END), re.DOTALL)


class InputMode(str, enum.Enum):
    MODEL_PARALLEL = "model_parallel"
    DATA_PARALLEL = "data_parallel"


class LastBatch(str, enum.Enum):
    DROP = "drop"
    PAD = "pad"


class Batch(NamedTuple):
    """One rank's share of a global batch.

    Attributes:
        numerical: [L, n_numerical] float32.
        categorical: [B, T] ids when every table read is one-hot, else a tuple
            of T tensors [B, hotness_t], where a variable-length table's is a
            `tf.RaggedTensor` [B, None] (int64 row lengths); B is G
            (model-parallel) or L. int32, or int64 when any categorical feature
            of the dataset is stored as int64 (the same on every rank).
        label: [L, 1] float32.
        weight: [L, 1] float32, 1 for real rows and 0 for padding.
    """

    numerical: Any
    categorical: Any
    label: Any
    weight: Any


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Which part of each global batch a rank reads."""

    global_batch_size: int
    rank: int = 0
    world_size: int = 1
    local_tables: tuple[int, ...] | None = None
    input_mode: InputMode = InputMode.MODEL_PARALLEL

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise DatasetError(
                f"rank/world_size: expected 0 <= rank < world_size, got rank={self.rank}, "
                f"world_size={self.world_size}"
            )
        if self.global_batch_size < 1 or self.global_batch_size % self.world_size:
            raise DatasetError(
                f"global batch size: expected a positive multiple of the world size "
                f"{self.world_size}, got {self.global_batch_size} "
                f"(remainder {self.global_batch_size % max(self.world_size, 1)})"
            )
        if self.input_mode == InputMode.DATA_PARALLEL and self.local_tables is not None:
            raise DatasetError(
                "local_tables: data-parallel input reads every table for the local rows; "
                "expected local_tables=None"
            )

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.world_size


class SplitBinaryDataset:
    """Reads one mapping ("train", "test") of a split-binary dataset in batches.

    Whole batches are read as raw bytes with positioned reads (page cache), never
    through memory maps (a file that shrinks while it is read is then an error
    naming it, not a SIGBUS), converted with vectorised numpy/TensorFlow ops and
    prefetched.

    Args:
        spec: the dataset's FeatureSpec.
        mapping: which split to read ("train", "test").
        shard: which part of each global batch this rank reads.
        last_batch: drop or pad a last batch with fewer than G rows.
        check_batch_ids: check the ids of every batch read against the cardinality
            of their table (one min and one max per table and batch; only the
            tables this rank reads, for the rows it reads them).
        check_file_ids: check every id of the files of this rank's tables once,
            when the dataset is built (a scan of whole files).

    Raises:
        DatasetError: files that do not match the spec; with `check_file_ids`, an
            id out of range.
    """

    def __init__(
        self,
        spec: FeatureSpec,
        mapping: str,
        shard: ShardSpec,
        last_batch: LastBatch | str = LastBatch.DROP,
        check_batch_ids: bool = True,
        check_file_ids: bool = False,
    ) -> None:
        self.spec = spec
        self.mapping = mapping
        self.shard = shard
        self.last_batch = LastBatch(last_batch)
        self.files = SplitBinaryFiles.open(spec, mapping)
        categorical = spec.categorical_features
        if shard.local_tables is None:
            tables = tuple(range(len(categorical)))
        else:
            tables = tuple(shard.local_tables)
            bad = [t for t in tables if not 0 <= t < len(categorical)]
            if bad or len(set(tables)) != len(tables):
                raise DatasetError(
                    f"local_tables: expected distinct table indices in [0, "
                    f"{len(categorical)}), got {list(tables)}"
                )
        self.tables = tables
        self.table_features = tuple(categorical[t] for t in tables)
        self.check_batch_ids = check_batch_ids
        if check_file_ids:
            self.files.check_ids(spec, [f.name for f in self.table_features])
        self._one_hot = all(f.hotness == 1 for f in self.table_features)
        # Of the whole dataset, not of the tables read: every rank must agree
        # (ids cross the alltoall under data-parallel input).
        self.id_dtype = ids_dtype(f.dtype for f in categorical)

    # ------------------------------------------------------------------ sizes

    @property
    def rows(self) -> int:
        return self.files.rows

    @property
    def num_batches(self) -> int:
        full, remainder = divmod(self.rows, self.shard.global_batch_size)
        return full + (1 if remainder and self.last_batch == LastBatch.PAD else 0)

    @property
    def categorical_batch_size(self) -> int:
        if self.shard.input_mode == InputMode.MODEL_PARALLEL:
            return self.shard.global_batch_size
        return self.shard.local_batch_size

    # ------------------------------------------------------------ numpy reads

    def read_batch(self, index: int) -> Batch:
        """Batch `index` as numpy arrays (the raw dtypes converted as in `Batch`).

        Raises:
            DatasetError: `index` out of range; with `check_batch_ids`, an id of
                the batch outside [0, cardinality) of its table.
        """
        if not 0 <= index < self.num_batches:
            raise DatasetError(
                f"batch index: expected 0 <= index < {self.num_batches}, got {index}"
            )
        shard = self.shard
        global_start = index * shard.global_batch_size
        local_start = global_start + shard.rank * shard.local_batch_size
        local = shard.local_batch_size
        label = _rows(self.files.label, local_start, local).astype(np.float32).reshape(local, 1)
        n_num = len(self.spec.numerical_features)
        if self.files.numerical is not None:
            numerical = _rows(self.files.numerical, local_start, local).astype(np.float32)
        else:
            numerical = np.zeros((local, n_num), np.float32)
        valid = np.clip(self.rows - local_start, 0, local)
        weight = np.zeros((local, 1), np.float32)
        weight[:valid] = 1.0
        if shard.input_mode == InputMode.MODEL_PARALLEL:
            cat_start, cat_rows = global_start, shard.global_batch_size
        else:
            cat_start, cat_rows = local_start, local
        columns = [self._read_ids(f, cat_start, cat_rows) for f in self.table_features]
        if self.check_batch_ids:
            # Padding rows past the end of the file are id 0 (or empty): in range.
            for table, feature, column in zip(
                self.tables, self.table_features, columns, strict=True
            ):
                file = self.files.categorical[feature.name]
                if isinstance(column, RaggedIds):
                    # The ids of a variable-length row sit at its offset, not its row:
                    # the message names the row found by the offsets.
                    check_ragged_id_rows(column, cat_start, file, feature, table)
                else:
                    check_id_rows(column, cat_start, file, feature, table)
        categorical: Any
        if self._one_hot:
            categorical = np.empty((cat_rows, len(columns)), self.id_dtype)
            for i, column in enumerate(columns):
                categorical[:, i] = column
        else:
            categorical = tuple(
                RaggedIds(c.values.astype(self.id_dtype), c.row_lengths)
                if isinstance(c, RaggedIds)
                else c.astype(self.id_dtype).reshape(cat_rows, f.hotness)
                for c, f in zip(columns, self.table_features, strict=True)
            )
        return Batch(numerical=numerical, categorical=categorical, label=label, weight=weight)

    def _read_ids(self, feature: Any, start: int, count: int) -> np.ndarray | RaggedIds:
        """Rows [start, start + count) of a table's ids: [count] or [count, h],
        or a variable-length table's `RaggedIds` (rows past the end empty)."""
        ids = self.files.categorical[feature.name]
        if not feature.is_variable_length:
            return _rows(ids, start, count)
        first, stop = min(start, self.rows), min(start + count, self.rows)
        offsets = self.files.offsets[feature.name].read_rows(first, stop + 1 - first)
        if self.check_batch_ids:
            check_offset_rows(offsets, start, self.files.offsets[feature.name])
        lengths = np.zeros(count, np.int64)
        lengths[: len(offsets) - 1] = np.diff(offsets)
        values = ids.read_rows(int(offsets[0]), int(offsets[-1] - offsets[0]))
        return RaggedIds(values, lengths)

    # ---------------------------------------------------------------- tf.data

    def to_tf_dataset(self, prefetch: int = tf.data.AUTOTUNE, start: int = 0) -> tf.data.Dataset:
        """A dataset of `Batch`es of tensors, one element per global batch, from
        batch `start` (where a resumed run continues) to the end.

        A DatasetError raised while reading reaches its iterator as a TensorFlow
        error (`tf.errors.InvalidArgumentError`); `batches`, or iterating through
        `raise_dataset_errors`, turns it back into the DatasetError.
        """
        if not 0 <= start <= self.num_batches:
            raise DatasetError(
                f"start batch: expected 0 <= start <= {self.num_batches}, got {start}"
            )
        shapes, dtypes = self._flat_signature()

        # Python loops over Python lists only: AutoGraph's rewrite, which tf.data's
        # map would run on it in every process, has nothing to convert.
        @tf.autograph.experimental.do_not_convert
        def to_batch(index: tf.Tensor) -> Batch:
            flat = tf.numpy_function(self._read_flat, [index], dtypes, stateful=False)
            for tensor, shape in zip(flat, shapes, strict=True):
                tensor.set_shape(shape)
            return self._batch_of_flat(flat)

        dataset = tf.data.Dataset.range(start, self.num_batches)
        dataset = dataset.map(to_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return dataset.prefetch(prefetch)

    def _flat_signature(self) -> tuple[list[tuple[int | None, ...]], list[tf.DType]]:
        """The shapes and dtypes of the flat tensors a batch crosses
        tf.numpy_function as: [numerical, categorical..., label, weight], where the
        categorical part is one [B, T] tensor when every table read is one-hot, else
        one per table, or two for a variable-length one: its ids [n] and its row
        lengths [B]."""
        local = self.shard.local_batch_size
        cat_rows = self.categorical_batch_size
        ids = tf.as_dtype(self.id_dtype)
        cat_shapes: list[tuple[int | None, ...]] = []
        cat_dtypes: list[tf.DType] = []
        if self._one_hot:
            cat_shapes, cat_dtypes = [(cat_rows, len(self.table_features))], [ids]
        else:
            for feature in self.table_features:
                if feature.is_variable_length:
                    cat_shapes += [(None,), (cat_rows,)]
                    cat_dtypes += [ids, tf.int64]
                else:
                    cat_shapes.append((cat_rows, feature.hotness))
                    cat_dtypes.append(ids)
        n_num = len(self.spec.numerical_features)
        shapes = [(local, n_num), *cat_shapes, (local, 1), (local, 1)]
        return shapes, [tf.float32, *cat_dtypes, tf.float32, tf.float32]

    def _read_flat(self, index: np.ndarray) -> list[np.ndarray]:
        """Batch `index` as flat arrays; a DatasetError's message is bracketed for
        `raise_dataset_errors`."""
        try:
            batch = self.read_batch(int(index))
        except DatasetError as error:
            raise DatasetError(f"{_ERROR_START}{error}{_ERROR_END}") from error
        cats: list[np.ndarray] = []
        if self._one_hot:
            cats.append(batch.categorical)
        else:
            for column in batch.categorical:
                cats += list(column) if isinstance(column, RaggedIds) else [column]
        return [batch.numerical, *cats, batch.label, batch.weight]

    def _batch_of_flat(self, flat: list[tf.Tensor]) -> Batch:
        """The `Batch` of a batch's flat tensors."""
        cats: Any
        if self._one_hot:
            cats = flat[1]
        else:
            parts = iter(flat[1:-2])
            columns = []
            for feature in self.table_features:
                if feature.is_variable_length:
                    values, lengths = next(parts), next(parts)
                    columns.append(
                        tf.RaggedTensor.from_row_lengths(values, lengths, validate=False)
                    )
                else:
                    columns.append(next(parts))
            cats = tuple(columns)
        return Batch(numerical=flat[0], categorical=cats, label=flat[-2], weight=flat[-1])

    def batches(self, start: int = 0) -> Iterator[Batch]:
        """Iterates `to_tf_dataset(start=start)`; a read error raises DatasetError.

        Raises:
            DatasetError: as `read_batch` (e.g. an id out of range), with its message.
        """
        return raise_dataset_errors(self.to_tf_dataset(start=start))


def categorical_tensors(categorical: Any) -> Any:
    """`read_batch`'s numpy ids as the model takes them (what `to_tf_dataset`
    gives): a variable-length table's `RaggedIds` become a `tf.RaggedTensor`."""
    if not isinstance(categorical, (tuple, list)):
        return tf.convert_to_tensor(categorical)
    return tuple(
        tf.RaggedTensor.from_row_lengths(c.values, c.row_lengths)
        if isinstance(c, RaggedIds)
        else tf.convert_to_tensor(c)
        for c in categorical
    )


def raise_dataset_errors(elements: Iterable[T]) -> Iterator[T]:
    """Yields `elements` (e.g. a dataset made by `to_tf_dataset`, repeated or
    taken from); a TensorFlow error that carries a DatasetError raised while
    reading is raised as that DatasetError.

    Raises:
        DatasetError: with the message of the error raised in `read_batch`.
    """
    iterator = iter(elements)
    while True:
        try:
            element = next(iterator)
        except StopIteration:
            return
        except tf.errors.OpError as error:
            found = _ERROR_PATTERN.search(error.message)
            if found is None:
                raise
            message = found.group(1)
        else:
            yield element
            continue
        # Raised outside the handler, with the reader gone: TensorFlow's error (only
        # its frames around the message) would be this one's context, and its
        # traceback would keep the reader, whose prefetch reads on, alive.
        del iterator
        raise DatasetError(message)


def _rows(file: BinaryFile, start: int, count: int) -> np.ndarray:
    """Rows [start, start + count) of `file`, zero-padded past its end."""
    part = file.read_rows(start, count)
    if len(part) == count:
        return part
    out = np.zeros((count, *file.row_shape), dtype=file.dtype)
    out[: len(part)] = part
    return out
