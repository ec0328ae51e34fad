"""Criteo click logs -> split binary files + feature_spec.yaml, with Spark.

    python -m preproc.criteo --input_dir day_files/ --output_dir data/ \
        [--frequency_threshold 15] [--feature_frequency_threshold C3=5,C20=2] \
        [--train_days 0-22 --test_days 23 [--validation_days ...]] [--no_log_transform] \
        [--vocabulary_from EARLIER_DATASET] [--oov_buckets K] \
        [--strict] [--spark_master URL] [--spark_conf KEY=VALUE ...] [--gpu --rapids_jar JAR]

Reads the day files `day_<N>` (or `day_<N>.gz`) of `--input_dir`: label, I1..I13,
C1..C26, tab-separated. By default the last day is the test split and the others
the train split. Numericals: missing -> 0, negatives -> 0, log(1 + x), float16.
Categoricals: ids by descending frequency in the train days; missing, rare (fewer
than the threshold) and unseen values -> 0 (rare and unseen: a hashed id in 1..K
with --oov_buckets K). --vocabulary_from keeps an earlier dataset's ids and gives new
values ids after them. Train rows are shuffled (seeded), the
other splits keep input order. Malformed lines are skipped and counted, or fail the
run with --strict. Rerunning the same command resumes after the last finished stage.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from feature_spec import TEST_MAPPING, TRAIN_MAPPING
from preproc.cli import add_output_flags, add_spark_flags, run_cli, run_with_spark
from preproc.config import InputFile, NumericalTransform, PipelineConfig, parse_thresholds
from preproc.errors import PreprocessingError
from preproc.layout import criteo_layout

VALIDATION_MAPPING = "validation"
DAY_FILE = re.compile(r"^day_([0-9]+)(\.gz)?$")
_DAY_RANGE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")


def find_day_files(input_dir: Path) -> dict[int, Path]:
    """The day files of `input_dir` by day number.

    Raises:
        PreprocessingError: no day files, or a day present both plain and gzipped.
    """
    if not input_dir.is_dir():
        raise PreprocessingError(f"--input_dir {input_dir}: expected a directory of day files")
    days: dict[int, Path] = {}
    for path in sorted(input_dir.iterdir()):
        match = DAY_FILE.match(path.name)
        if match is None or not path.is_file():
            continue
        day = int(match.group(1))
        if day in days:
            raise PreprocessingError(
                f"--input_dir {input_dir}: day {day} is there twice ({days[day].name} and "
                f"{path.name}); expected one file per day"
            )
        days[day] = path
    if not days:
        present = sorted(p.name for p in input_dir.iterdir())[:10]
        raise PreprocessingError(
            f"--input_dir {input_dir}: expected day files named day_0, day_1, ... "
            f"(optionally .gz), found none among {present}"
        )
    return days


def parse_days(text: str | None, flag: str) -> list[int] | None:
    """`0-22,24` -> [0, ..., 22, 24]; None stays None."""
    if text is None:
        return None
    days: list[int] = []
    for part in text.split(","):
        match = _DAY_RANGE.match(part.strip())
        if match is None:
            raise PreprocessingError(
                f"{flag}: expected day numbers and ranges such as 0-22,24, got {text!r}"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise PreprocessingError(f"{flag}: range {part!r} runs backwards")
        days.extend(range(first, last + 1))
    return days


def assign_days(
    available: Sequence[int],
    train: list[int] | None,
    test: list[int] | None,
    validation: list[int] | None,
) -> dict[str, list[int]]:
    """Days per mapping. Defaults: test = the last day, validation = none, train =
    every other day.

    Raises:
        PreprocessingError: naming the flag of a day that is missing, given twice,
            or a split left empty.
    """
    given = {"--train_days": train, "--test_days": test, "--validation_days": validation}
    for flag, days in given.items():
        for day in days or []:
            if day not in available:
                raise PreprocessingError(
                    f"{flag}: day {day} has no file; expected days among {sorted(available)}"
                )
    if test is None:
        taken = set(train or []) | set(validation or [])
        rest = [d for d in sorted(available) if d not in taken]
        test = rest[-1:]
    validation = validation or []
    if train is None:
        train = [d for d in sorted(available) if d not in set(test) | set(validation)]
    seen: dict[int, str] = {}
    for flag, days in (
        ("--train_days", train),
        ("--test_days", test),
        ("--validation_days", validation),
    ):
        for day in days:
            if day in seen:
                raise PreprocessingError(
                    f"{flag}: day {day} is also in {seen[day]}; expected each day in one split"
                )
            seen[day] = flag
    if not train or not test:
        empty = "--train_days" if not train else "--test_days"
        raise PreprocessingError(
            f"{empty}: no days left for this split (days found: {sorted(available)}); "
            f"expected at least one train day and one test day"
        )
    out = {TRAIN_MAPPING: train}
    if validation:
        out[VALIDATION_MAPPING] = validation
    out[TEST_MAPPING] = test
    return out


def build_parser(prog: str = "python -m preproc.criteo") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    parser.add_argument("--input_dir", required=True, help="directory of day_<N>[.gz] files")
    add_output_flags(parser)
    parser.add_argument("--train_days", help="e.g. 0-22 (default: all but the test days)")
    parser.add_argument("--test_days", help="e.g. 23 (default: the last day)")
    parser.add_argument("--validation_days", help="days of an optional validation split")
    parser.add_argument(
        "--no_log_transform",
        action="store_true",
        help="store max(x, 0) instead of log(1 + max(x, 0))",
    )
    add_spark_flags(parser)
    return parser


def criteo_config(args: argparse.Namespace) -> PipelineConfig:
    """The pipeline configuration of parsed flags (validated; errors name the flag)."""
    layout = criteo_layout()
    days = find_day_files(Path(args.input_dir))
    split = assign_days(
        sorted(days),
        parse_days(args.train_days, "--train_days"),
        parse_days(args.test_days, "--test_days"),
        parse_days(args.validation_days, "--validation_days"),
    )
    files = tuple(
        InputFile.of(days[day], mapping) for mapping, chosen in split.items() for day in chosen
    )
    names = [(c.source, c.name) for c in layout.categorical]
    thresholds = parse_thresholds(
        args.frequency_threshold,
        args.feature_frequency_threshold,
        names,
        "--feature_frequency_threshold",
    )
    return PipelineConfig(
        layout=layout,
        files=files,
        mappings=tuple(split),
        output_dir=Path(args.output_dir),
        frequency_thresholds=thresholds,
        numerical_transform=(
            NumericalTransform.CLAMP if args.no_log_transform else NumericalTransform.LOG
        ),
        shuffle_train=not args.no_shuffle,
        seed=args.seed,
        strict=args.strict,
        keep_intermediate=args.keep_intermediate,
        overwrite=args.overwrite,
        rows_per_partition=args.rows_per_partition,
        vocabulary_from=None if args.vocabulary_from is None else Path(args.vocabulary_from),
        oov_buckets=args.oov_buckets,
        source="criteo",
    )


def _main(argv: Sequence[str] | None, prog: str = "python -m preproc.criteo") -> int:
    args = build_parser(prog).parse_args(argv)
    return run_with_spark(criteo_config(args), args)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_main, argv)


def console_main() -> int:
    """The `dlrm-preprocess` command: the same tool under its installed name."""
    return run_cli(lambda argv: _main(argv, "dlrm-preprocess"), None)


if __name__ == "__main__":
    sys.exit(main())
