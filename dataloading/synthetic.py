"""Synthetic split-binary datasets: the FeatureSpec layout, teacher-model labels.

    python -m dataloading.synthetic --output_dir data/ --train_rows 1000000 \
        --test_rows 100000 [--shape criteo_small|mlperf_dcnv2|mlperf_dcnv2_small] \
        [--cardinalities 1000,20,...] [--hotness 3,0,...] [--num_numerical 13] \
        [--max_variable_hotness 8]

`--shape` picks the tables: 26 small Criteo-like one-hot tables (the default),
MLPerf DLRM-DCNv2's (the Criteo 1TB cardinalities capped at 40M, with its
multi-hot sizes), or the same multi-hot sizes over tables capped at
`SMALL_TABLE_ROWS` rows, which train on a 2-core machine. Hotness 0 is a
variable-length table (`hotness: variable`): each row has a uniform number of
ids in [0, --max_variable_hotness], empty rows included, stored as the ids and
their int64 row offsets.

Rows are generated and written in chunks, so 100M rows need little memory. The
dataset is written into a temporary directory beside `output_dir` and renamed
into place when complete: an interrupted run leaves no dataset that looks whole.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from dataloading.files import RaggedIds
from dataloading.teacher import FeatureSampler, Teacher
from feature_spec import (
    CRITEO_1TB_MLPERF_CARDINALITIES,
    MLPERF_DCNV2_MULTI_HOT_SIZES,
    FeatureSpec,
    FeatureSpecError,
    build_split_binary_spec,
    minimal_categorical_dtype,
)
from feature_spec.staged import publish, start_staging

# A small default table set: skewed sizes, as in Criteo, but quick to train.
DEFAULT_CARDINALITIES = (
    100000, 5000, 2000, 800, 3000, 3, 700, 150, 60, 50000, 20000, 9000, 10,
    200, 1200, 155, 4, 97, 14, 70000, 30000, 60000, 5800, 1300, 108, 36,
)  # fmt: skip
SMALL_TABLE_ROWS = 2_000
# --shape: (cardinalities, hotness); None is one-hot.
SHAPES: dict[str, tuple[tuple[int, ...], tuple[int, ...] | None]] = {
    "criteo_small": (DEFAULT_CARDINALITIES, None),
    "mlperf_dcnv2": (CRITEO_1TB_MLPERF_CARDINALITIES, MLPERF_DCNV2_MULTI_HOT_SIZES),
    "mlperf_dcnv2_small": (
        tuple(min(c, SMALL_TABLE_ROWS) for c in CRITEO_1TB_MLPERF_CARDINALITIES),
        MLPERF_DCNV2_MULTI_HOT_SIZES,
    ),
}
CALIBRATION_ROWS = 200_000
# Standard deviation of the teacher's logits: with it the teacher's own AUC is
# about 0.85, near what the best models reach on real Criteo data (~0.80).
TEACHER_LOGIT_STD = 1.8


def generate_split_binary(
    output_dir: str | os.PathLike[str],
    cardinalities: Sequence[int] = DEFAULT_CARDINALITIES,
    num_numerical: int = 13,
    rows: Mapping[str, int] | None = None,
    hotness: Sequence[int] | None = None,
    exponent: float = 1.1,
    positive_rate: float = 0.25,
    seed: int = 0,
    chunk_rows: int = 1 << 20,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
    id_dtype: str | None = None,
    max_variable_hotness: int = 8,
) -> FeatureSpec:
    """Writes a split-binary dataset with `feature_spec.yaml` into `output_dir`.

    Args:
        cardinalities: rows of each categorical table.
        rows: rows per mapping; default {"train": 100_000, "test": 20_000}.
        hotness: ids per row for each table (default 1 everywhere); 0 is a
            variable-length table, with a uniform number of ids per row in
            [0, max_variable_hotness].
        exponent: power-law exponent of id frequencies (0 = uniform).
        positive_rate: the share of label 1 the teacher is calibrated to.
        seed: everything (teacher, features, labels) follows from it.
        chunk_rows: rows generated and written at a time.
        overwrite: replace an existing `output_dir`; otherwise it is an error.
        id_dtype: the stored dtype of every table's ids (e.g. "int64"); by
            default the smallest that holds each table's cardinality.
        max_variable_hotness: the most ids of a row of a variable-length table.

    Returns:
        The FeatureSpec of the written dataset (its metadata records the
        generator's parameters and the teacher's bias).
    """
    rows = dict(rows if rows is not None else {"train": 100_000, "test": 20_000})
    sampler = _table_sampler(num_numerical, cardinalities, hotness, exponent, max_variable_hotness)
    teacher = build_teacher(sampler, seed, positive_rate)
    metadata = _generator_metadata(sampler, teacher, seed, positive_rate)
    # Everything is validated before anything is written.
    staging = start_staging(output_dir, overwrite=overwrite)
    spec = build_split_binary_spec(
        cardinalities,
        num_numerical,
        sampler.hotness,
        mappings=tuple(rows),
        base_directory=staging,
        metadata=metadata,
        id_dtype=id_dtype,
    )
    _write_rows(spec, rows, sampler, teacher, seed, chunk_rows, progress)
    spec.dump(staging / "feature_spec.yaml")
    return FeatureSpec.load(publish(staging, output_dir))


def _table_sampler(
    num_numerical: int,
    cardinalities: Sequence[int],
    hotness: Sequence[int] | None,
    exponent: float,
    max_variable_hotness: int,
) -> FeatureSampler:
    """The sampler of these tables (hotness None: 1 everywhere).

    Raises:
        FeatureSpecError: a cardinality no id dtype holds, or a hotness that does
            not fit the tables.
    """
    hotness = tuple(hotness) if hotness is not None else (1,) * len(cardinalities)
    for cardinality in cardinalities:
        minimal_categorical_dtype(cardinality)  # validates the cardinality
    if len(hotness) != len(cardinalities):
        raise FeatureSpecError(
            f"hotness: expected one value per table ({len(cardinalities)}), "
            f"got {len(hotness)}: {','.join(map(str, hotness))}"
        )
    if any(hot < 0 for hot in hotness):
        raise FeatureSpecError(
            f"hotness: expected ids per row >= 1, or 0 for a variable-length table, "
            f"got {','.join(map(str, hotness))}"
        )
    if max_variable_hotness < 1:
        raise FeatureSpecError(
            f"max_variable_hotness: expected an int >= 1, got {max_variable_hotness}"
        )
    return FeatureSampler(
        num_numerical,
        tuple(cardinalities),
        hotness,
        exponent,
        max_variable_hotness=max_variable_hotness,
    )


def _generator_metadata(
    sampler: FeatureSampler, teacher: Teacher, seed: int, positive_rate: float
) -> dict[str, object]:
    """The spec's metadata: the generator's parameters and the teacher's bias."""
    metadata: dict[str, object] = {
        "generator": "dataloading.synthetic",
        "seed": seed,
        "exponent": sampler.exponent,
        "positive_rate": positive_rate,
        "teacher_bias": teacher.bias,
    }
    # Only a spec with a variable-length table has a use for it.
    if 0 in sampler.hotness:
        metadata["max_variable_hotness"] = sampler.max_variable_hotness
    return metadata


def build_teacher(sampler: FeatureSampler, seed: int, positive_rate: float) -> Teacher:
    """The teacher for `seed`, its bias calibrated on a sample of the features."""
    teacher = Teacher.create(sampler.num_numerical, len(sampler.cardinalities), seed)
    raw = sampler.sample(np.random.default_rng([seed, 0xCA1]), CALIBRATION_ROWS)
    features = raw.numerical_features()
    teacher = teacher.scaled(TEACHER_LOGIT_STD / float(np.std(teacher.logits(features, raw.ids))))
    return teacher.calibrated(teacher.logits(features, raw.ids), positive_rate)


def _write_rows(
    spec: FeatureSpec,
    rows: Mapping[str, int],
    sampler: FeatureSampler,
    teacher: Teacher,
    seed: int,
    chunk_rows: int,
    progress: Callable[[str], None] | None,
) -> None:
    """Writes `rows[mapping]` rows of each mapping, each from a random stream of its own."""
    streams = np.random.SeedSequence([seed, 0x5B1]).spawn(len(rows))
    for (mapping, count), stream in zip(rows.items(), streams, strict=True):
        _write_mapping(spec, mapping, count, sampler, teacher, stream, chunk_rows, progress)


def _write_mapping(
    spec: FeatureSpec,
    mapping: str,
    count: int,
    sampler: FeatureSampler,
    teacher: Teacher,
    stream: np.random.SeedSequence,
    chunk_rows: int,
    progress: Callable[[str], None] | None,
) -> None:
    files = spec.files(mapping)
    files.label.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(stream)
    features = spec.categorical_features
    dtypes = [np.dtype(f.dtype) for f in features]
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        label_out = stack.enter_context(open(files.label, "wb"))
        numerical_out = (
            stack.enter_context(open(files.numerical, "wb")) if files.numerical else None
        )
        id_outs = [stack.enter_context(open(p, "wb")) for p in files.categorical.values()]
        # A variable-length table's offsets are global over the mapping: the file
        # starts with 0 and each chunk's offsets continue from the ids written.
        offset_outs = {
            t: stack.enter_context(open(files.offsets[f.name], "wb"))
            for t, f in enumerate(features)
            if f.is_variable_length
        }
        ids_written = dict.fromkeys(offset_outs, 0)
        for out in offset_outs.values():
            out.write(np.zeros(1, dtype=np.int64).tobytes())
        for done in range(0, count, chunk_rows):
            n = min(chunk_rows, count - done)
            raw = sampler.sample(rng, n)
            numerical = raw.numerical_features()
            # The split-binary generator writes preprocessed ids directly: no
            # categorical value is missing (preprocessing would map it to id 0).
            labels = teacher.sample_labels(rng, teacher.logits(numerical, raw.ids))
            label_out.write(labels.astype(np.bool_).tobytes())
            if numerical_out is not None:
                numerical_out.write(numerical.astype(np.float16).tobytes())
            for table, (out, ids, dtype) in enumerate(zip(id_outs, raw.ids, dtypes, strict=True)):
                if isinstance(ids, RaggedIds):
                    out.write(ids.values.astype(dtype).tobytes())
                    offsets = ids.offsets()[1:] + ids_written[table]
                    offset_outs[table].write(offsets.astype(np.int64).tobytes())
                    ids_written[table] += len(ids.values)
                else:
                    out.write(ids.astype(dtype).tobytes())
            if progress is not None:
                rate = (done + n) / max(time.monotonic() - start, 1e-9)
                progress(f"[synthetic] {mapping}: {done + n:,}/{count:,} rows ({rate:,.0f} rows/s)")


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None, prog: str = "python -m dataloading.synthetic") -> int:
    parser = _argument_parser(prog)
    args = parser.parse_args(argv)
    cardinalities, hotness = _tables(parser, args)
    try:
        spec = generate_split_binary(
            args.output_dir,
            cardinalities=cardinalities,
            num_numerical=args.num_numerical,
            rows={"train": args.train_rows, "test": args.test_rows},
            hotness=hotness,
            exponent=args.exponent,
            positive_rate=args.positive_rate,
            seed=args.seed,
            overwrite=args.overwrite,
            progress=lambda line: print(line, file=sys.stderr),
            id_dtype=args.id_dtype,
            max_variable_hotness=args.max_variable_hotness,
        )
    except (FeatureSpecError, FileExistsError) as error:  # one line, not a traceback
        parser.error(str(error))
    print(f"wrote {args.output_dir}/feature_spec.yaml ({len(spec.categorical_features)} tables)")
    return 0


def _argument_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--train_rows", type=int, default=100_000)
    parser.add_argument("--test_rows", type=int, default=20_000)
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="criteo_small",
        help="the tables and their ids per row (see the module docstring)",
    )
    parser.add_argument(
        "--cardinalities", type=_int_list, default=None, help="comma-separated table sizes"
    )
    parser.add_argument(
        "--hotness",
        type=_int_list,
        default=None,
        help="comma-separated ids per row per table; 0 is a variable number of ids per row",
    )
    parser.add_argument(
        "--max_variable_hotness",
        type=int,
        default=8,
        help="the most ids of a row of a variable-length table (--hotness 0)",
    )
    parser.add_argument("--num_numerical", type=int, default=13)
    parser.add_argument("--exponent", type=float, default=1.1)
    parser.add_argument("--positive_rate", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--id_dtype",
        choices=["int8", "int16", "int32", "int64"],
        default=None,
        help="stored dtype of every table's ids (default: the smallest per table)",
    )
    parser.add_argument("--overwrite", action="store_true")
    return parser


def _tables(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[Sequence[int], Sequence[int] | None]:
    """The cardinalities and ids per row of the run: those given, else `--shape`'s."""
    cardinalities, hotness = SHAPES[args.shape]
    # A shape's ids per row fit its own tables only.
    if (
        args.cardinalities
        and not args.hotness
        and hotness is not None
        and len(args.cardinalities) != len(hotness)
    ):
        parser.error(
            f"--cardinalities: {len(args.cardinalities)} tables, but --shape {args.shape} "
            f"has ids per row for {len(hotness)}; give --hotness for these tables"
        )
    return args.cardinalities or cardinalities, args.hotness or hotness


if __name__ == "__main__":
    sys.exit(main())
