"""A model's weights from a checkpoint: whether the checkpoint fits the model
(tables may grow when the dataset's vocabulary extends the checkpoint's), and
its dense weights and table shards restored in bounded row blocks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dlrm.checkpoint.format import CheckpointError
from dlrm.checkpoint.reader import Checkpoint
from dlrm.embedding.base import assign_rows
from dlrm.embedding.shard import TableShard
from dlrm.model.config import LEGACY_VALUES
from dlrm.model.dlrm import Dlrm
from dlrm.variables import variable_name
from feature_spec.vocabulary import VocabularyLineage

CARDINALITIES = "cardinalities"  # the field of the model config that may grow
VOCABULARY_FIELD = "vocabulary"  # the manifest's: the dataset vocabulary's id, or None


def check_model_matches(
    checkpoint: Checkpoint,
    model_config: Mapping[str, Any],
    lineage: VocabularyLineage | None = None,
) -> None:
    """Raises `CheckpointError` naming every architecture field that differs.

    The tables may have fewer rows in the checkpoint than this run's dataset has
    ids (`cardinalities`): they grow on restore when the dataset's vocabulary
    (`lineage`) is the checkpoint's or extends it, so that every old id still
    means the same value. A table with more rows in the checkpoint, or growth
    without that lineage, is an error naming the table and both sizes: a table
    is never truncated, and rows are never given to other values.
    """
    saved = checkpoint.manifest.get("model")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{checkpoint.path}: the manifest has no model config")
    # A manifest written before a field existed holds the model that field's
    # legacy value describes (a dot model, before cross layers existed).
    saved = {**LEGACY_VALUES, **saved}
    _check_same_architecture(checkpoint, saved, model_config)
    old, new = list(saved.get(CARDINALITIES) or []), list(model_config[CARDINALITIES])
    smaller = [(t, o, n) for t, (o, n) in enumerate(zip(old, new, strict=True)) if o > n]
    if smaller:
        raise CheckpointError(
            f"{checkpoint.path}: "
            + "; ".join(
                f"table {t} has {o:,} rows, this run's dataset {n:,}" for t, o, n in smaller
            )
            + ". A checkpoint's tables can grow to a dataset's cardinalities, never shrink "
            "(expected the dataset the checkpoint was trained on, or one whose vocabulary "
            "extends it: preprocess with --vocabulary_from)"
        )
    _check_growth(checkpoint, grown_tables(checkpoint, new), lineage)


def _check_same_architecture(
    checkpoint: Checkpoint, saved: Mapping[str, Any], model_config: Mapping[str, Any]
) -> None:
    """Every field but the tables' rows equal, and as many tables."""
    differences = [
        f"{key}: checkpoint {saved.get(key)!r}, this run {value!r}"
        for key, value in model_config.items()
        if key != CARDINALITIES and saved.get(key) != value
    ]
    old, new = list(saved.get(CARDINALITIES) or []), list(model_config[CARDINALITIES])
    if len(old) != len(new):
        differences.append(
            f"{CARDINALITIES}: checkpoint {len(old)} tables {old}, this run {len(new)} tables {new}"
        )
    if differences:
        raise CheckpointError(
            f"{checkpoint.path}: written for another model or dataset; " + "; ".join(differences)
        )


def _check_growth(
    checkpoint: Checkpoint,
    grown: list[tuple[int, int, int]],
    lineage: VocabularyLineage | None,
) -> None:
    """Tables grow only when the dataset's vocabulary extends the checkpoint's."""
    if not grown:
        return
    vocabulary = checkpoint.manifest.get(VOCABULARY_FIELD)
    if lineage is not None and isinstance(vocabulary, str) and lineage.descends_from(vocabulary):
        return
    t, o, n = grown[0]
    if not isinstance(vocabulary, str):
        why = "the checkpoint records no vocabulary (its dataset was not made by dlrm-preprocess)"
    elif lineage is None:
        why = f"the checkpoint's vocabulary is {vocabulary}, and this dataset records none"
    else:
        why = (
            f"the checkpoint's vocabulary is {vocabulary}, and this dataset's ({lineage.id}) "
            f"does not extend it (it extends {list(lineage.extends) or 'none'})"
        )
    raise CheckpointError(
        f"{checkpoint.path}: table {t} has {o:,} rows, this run's dataset {n:,}"
        + (f" ({len(grown)} tables grow)" if len(grown) > 1 else "")
        + f"; a table grows only when the dataset's ids extend the checkpoint's, but {why}. "
        "Expected a dataset preprocessed with --vocabulary_from the checkpoint's dataset"
    )


def grown_tables(
    checkpoint: Checkpoint, cardinalities: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(table, rows in the checkpoint, rows now) of each table that grows on restore."""
    saved = checkpoint.manifest.get("model", {}).get(CARDINALITIES) or []
    return [(t, o, n) for t, (o, n) in enumerate(zip(saved, cardinalities, strict=False)) if o < n]


def table_dtype_change(checkpoint: Checkpoint, dtype: str) -> str | None:
    """A line saying how a restore converts the checkpoint's tables to `dtype`,
    what this run's tables store (`--embedding_dtype`), or None when they are
    alike: 16-bit values widen exactly, float32 ones round to nearest."""
    stored = sorted({checkpoint.table_dtype(t) for t in checkpoint.tables})
    if stored == [dtype]:
        return None
    how = (
        "widened exactly"
        if dtype == "float32"
        else "rounded to nearest on restore"
        if stored == ["float32"]
        else "converted (rounded to nearest) on restore"
    )
    return f"checkpoint tables are {' and '.join(stored)}, this run stores {dtype}: {how}"


def restore_model_weights(model: Dlrm, checkpoint: Checkpoint) -> None:
    """Loads dense weights and embedding tables (not optimizer state) into `model`.

    Reads only what this process holds, in bounded blocks written straight into
    the variables, so a resharding restore needs one block of extra host memory,
    not a copy of the shard. A table with fewer rows in the checkpoint than in the
    model (checked by `check_model_matches`) fills its first rows; the others
    keep their initial values."""
    model.build_all()
    for variable in model.dense_variables:
        variable.assign(checkpoint.dense_array(variable_name(variable), variable.shape))
    for shard, variable in model.embeddings.local_shards():
        shape = checkpoint.table_shape(shard.table)
        expected = model.embeddings.table_shape(shard.table)
        if shape[1] != expected[1] or shape[0] > expected[0]:
            raise CheckpointError(
                f"{checkpoint.path}: table {shard.table} has shape {list(shape)}, the model "
                f"expects {list(expected)} (another dataset or --embedding_dim?)"
            )
        restore_shard(checkpoint, shard, variable, None)


def restore_shard(
    checkpoint: Checkpoint, shard: TableShard, variable: Any, slot: str | None
) -> None:
    """Fills the rows of `shard` that the checkpoint's table has (all of them,
    unless the table grew); the others keep what the variable holds (a new row's
    initial value, and its slots' initial values).

    A row-wise `slot` ([rows, 1]) fills a [height, 1] variable: resharded as
    `Checkpoint.restore_table_slice` describes."""
    if slot is not None:
        _check_slot_shape(checkpoint, shard, variable, slot)
    stop = min(shard.rows[1], checkpoint.table_shape(shard.table)[0])
    if stop <= shard.rows[0]:
        return  # rows that are all new

    def assign(offset: int, block: np.ndarray) -> None:
        assign_rows(variable, offset, block)

    checkpoint.restore_table_slice(
        shard.table, (shard.rows[0], stop), shard.columns, assign, slot=slot
    )


def _check_slot_shape(checkpoint: Checkpoint, shard: TableShard, variable: Any, slot: str) -> None:
    """CheckpointError unless the variable has the slot's width as stored: one
    value per row, or one per element."""
    row_wise = checkpoint.is_row_wise_slot(shard.table, slot)
    width = 1 if row_wise else shard.width
    if list(variable.shape) == [shard.height, width]:
        return
    stored = checkpoint.manifest.get("optimizer", {}).get("name")
    kept = "one value per row" if row_wise else "one value per element"
    raise CheckpointError(
        f"{checkpoint.path}: optimizer slot {slot!r} of table {shard.table} is stored with "
        f"{kept} (--optimizer {stored}), this run's {shard.name} has it as "
        f"{list(variable.shape)}, expected {[shard.height, width]}; optimizer state cannot "
        "carry over between optimizers"
    )
