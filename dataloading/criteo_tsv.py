"""Synthetic click logs in the raw Criteo format, for preprocessing and the demo.

    python -m dataloading.criteo_tsv --output_dir raw/ --days 3 --rows_per_day 100000

Each line: label, I1..I13 (integer counts, possibly negative), C1..C26 (8
lowercase hex digits), tab-separated, an empty field for a missing value, one
file per day (`day_0`, `day_1`, ...; `.gz` with --gzip). Labels come from the
same teacher model as `dataloading.synthetic`, applied to what preprocessing
keeps (log-transformed counts, categorical values), so a model trained on the
preprocessed output has signal to learn.

Options add what real logs contain: rows whose trailing empty fields are cut
off (`short_row_fraction`), and malformed rows (`malformed_rows_per_day`: wrong
field count, non-integer count, malformed categorical), counted in the report.

`--drift F` (0 to 1; default 0, no drift) makes the click model drift over days,
as in production, for day-by-day training: on day d >= 1 each categorical
feature draws a share F of its values from ids first appearing that day (new
ads, new items), and every older value's popularity shrinks by a factor 1 - F
per day, so day 0's values fade. New values have effects of their own in the
teacher (its effects are hashes of the ids), so a model not updated since an
early day loses accuracy on later ones. Each table gets about F times its
cardinality new ids a day (at least one). Day 0 is the same as without drift,
and a day file does not depend on --days. `VocabularyDrift` has the details.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, NamedTuple

import numpy as np

from dataloading.synthetic import DEFAULT_CARDINALITIES, build_teacher
from dataloading.teacher import FeatureSampler, RawRows, Teacher, power_law_ids, splitmix64
from feature_spec.staged import publish, start_staging

NUM_INTEGER = 13
NUM_CATEGORICAL = 26
MALFORMED_KINDS = ("field_count", "numerical", "categorical")
_MULTIPLIER = 0x9E3779B1  # odd: k -> k * M mod 2^32 is a bijection
# Ids past it would collide with others in the 32-bit values written.
MAX_ID = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class CriteoLogReport:
    files: tuple[Path, ...]
    rows_per_file: tuple[int, ...]  # lines written, malformed ones included
    malformed: dict[str, int]  # lines per kind, over all files
    positives: int  # label-1 lines among the well-formed ones


@dataclasses.dataclass(frozen=True)
class VocabularyDrift:
    """How each categorical table's vocabulary changes from day to day.

    Day d draws a table's values from generations 0..d. Generation 0 is the
    table's own ids [0, C); generation g >= 1 holds `new_ids_per_day(C)` ids
    first drawn on day g, `generation_ids(C, g)`. Generation d takes `rate` of
    day d's draws, and every older generation's share shrinks by (1 - rate) a
    day: on day d, generation g >= 1 has rate * (1 - rate)^(d - g), generation 0
    (1 - rate)^d. Within a generation, ids follow the table's power law. With
    about rate * C ids a generation, a new id is as popular as an original one
    was on day 0.

    Attributes:
        rate: the share of a day's draws that go to that day's new ids, in [0, 1];
            0 is no drift.
    """

    rate: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"drift: expected a share in [0, 1], got {self.rate}")

    def generation_shares(self, day: int) -> np.ndarray:
        """[day + 1] float64: the share of day `day`'s draws per generation (sum 1)."""
        age = day - np.arange(day + 1, dtype=np.float64)
        shares = self.rate * np.power(1.0 - self.rate, age)
        shares[0] = (1.0 - self.rate) ** day
        return shares

    def new_ids_per_day(self, cardinality: int) -> int:
        return max(1, round(cardinality * self.rate)) if self.rate else 0

    def generation_ids(self, cardinality: int, generation: int) -> range:
        """The ids of `generation` of a table of `cardinality` ids."""
        if generation == 0:
            return range(cardinality)
        size = self.new_ids_per_day(cardinality)
        first = cardinality + (generation - 1) * size
        return range(first, first + size)

    def check_ids_fit(self, cardinalities: Sequence[int], days: int) -> None:
        """Raises ValueError where a table's ids of `days` days pass `MAX_ID`."""
        for table, cardinality in enumerate(cardinalities):
            last_id = cardinality - 1 + max(days - 1, 0) * self.new_ids_per_day(cardinality)
            if last_id > MAX_ID:
                raise ValueError(
                    f"drift: C{table + 1} (cardinality {cardinality}) would reach id "
                    f"{last_id} by day {days - 1}; ids must stay <= {MAX_ID}"
                )

    def day_ids(
        self,
        ids: np.ndarray,
        cardinality: int,
        day: int,
        rng: np.random.Generator,
        exponent: float,
    ) -> np.ndarray:
        """[N] ids of day `day` from [N] power-law ids of generation 0.

        Each row moves to a generation drawn from `generation_shares(day)`;
        the rows left in generation 0 keep their ids, so its power law holds.
        """
        if day == 0 or self.rate == 0.0:
            return ids
        cumulative = np.cumsum(self.generation_shares(day))
        generation = np.searchsorted(cumulative, rng.random(len(ids)), side="right")
        generation = np.minimum(generation, day)  # a sum short of 1 by rounding
        moved = generation > 0
        size = self.new_ids_per_day(cardinality)
        within = power_law_ids(rng, size, int(moved.sum()), exponent)
        out = ids.copy()
        out[moved] = cardinality + (generation[moved] - 1) * size + within
        return out


def categorical_values(table: int, ids: np.ndarray, seed: int) -> np.ndarray:
    """The 32-bit value written for vocabulary index `ids` of `table` (bijective per table)."""
    key = int(splitmix64(np.array([seed * 1000 + table]))[0]) & 0xFFFFFFFF
    with np.errstate(over="ignore"):
        return (
            (ids.astype(np.uint64) * np.uint64(_MULTIPLIER)) & np.uint64(0xFFFFFFFF)
        ) ^ np.uint64(key)


def generate_criteo_tsv(
    output_dir: str | os.PathLike[str],
    days: int = 3,
    rows_per_day: int = 100_000,
    cardinalities: Sequence[int] = DEFAULT_CARDINALITIES,
    exponent: float = 1.1,
    positive_rate: float = 0.25,
    seed: int = 0,
    use_gzip: bool = False,
    short_row_fraction: float = 0.0,
    malformed_rows_per_day: int = 0,
    chunk_rows: int = 200_000,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
    drift: float = 0.0,
) -> CriteoLogReport:
    """Writes `days` Criteo-format day files into `output_dir`.

    `drift` is `VocabularyDrift.rate`: from day 1 on, that share of each day's
    categorical draws goes to values new that day, and older values fade.
    """
    if len(cardinalities) != NUM_CATEGORICAL:
        raise ValueError(
            f"cardinalities: expected {NUM_CATEGORICAL} values (C1..C26), got {len(cardinalities)}"
        )
    vocabulary_drift = VocabularyDrift(drift)
    vocabulary_drift.check_ids_fit(cardinalities, days)
    output = Path(output_dir)
    staging = start_staging(output, overwrite=overwrite)
    sampler = FeatureSampler(NUM_INTEGER, tuple(cardinalities), (1,) * NUM_CATEGORICAL, exponent)
    writer = _DayWriter(
        sampler=sampler,
        teacher=build_teacher(sampler, seed, positive_rate),
        drift=vocabulary_drift,
        seed=seed,
        rows_per_day=rows_per_day,
        chunk_rows=chunk_rows,
        short_row_fraction=short_row_fraction,
        malformed_rows_per_day=malformed_rows_per_day,
        use_gzip=use_gzip,
        progress=progress,
    )
    streams = np.random.SeedSequence([seed, 0xC417E0]).spawn(days)
    written = [writer.write(staging, day, stream) for day, stream in enumerate(streams)]
    publish(staging, output)
    return CriteoLogReport(
        files=tuple(output / day.name for day in written),
        rows_per_file=(rows_per_day,) * len(written),
        malformed={kind: sum(day.malformed[kind] for day in written) for kind in MALFORMED_KINDS},
        positives=sum(day.positives for day in written),
    )


class _DayFile(NamedTuple):
    name: str
    positives: int  # label-1 lines among the well-formed ones
    malformed: dict[str, int]  # lines per kind


@dataclasses.dataclass(frozen=True)
class _DayWriter:
    """Writes day files: rows drawn by `sampler` (with the day's `drift`), labelled
    by `teacher`, some cut short or malformed."""

    sampler: FeatureSampler
    teacher: Teacher
    drift: VocabularyDrift
    seed: int
    rows_per_day: int
    chunk_rows: int
    short_row_fraction: float
    malformed_rows_per_day: int
    use_gzip: bool
    progress: Callable[[str], None] | None

    def write(self, directory: Path, day: int, stream: np.random.SeedSequence) -> _DayFile:
        """Writes the file of day `day` into `directory`, its rows drawn from `stream`."""
        name = f"day_{day}" + (".gz" if self.use_gzip else "")
        rng = np.random.default_rng(stream)
        # A stream of its own, so that drift leaves the other draws as they were.
        drift_rng = np.random.default_rng([self.seed, 0xD21F7, day])
        rows = self.rows_per_day
        bad_at = set(
            rng.choice(rows, size=min(self.malformed_rows_per_day, rows), replace=False).tolist()
        )
        malformed = dict.fromkeys(MALFORMED_KINDS, 0)
        positives = 0
        opener = gzip.open if self.use_gzip else open
        start = time.monotonic()
        with opener(directory / name, "wt") as out:
            for done in range(0, rows, self.chunk_rows):
                n = min(self.chunk_rows, rows - done)
                raw = self._sample(rng, drift_rng, day, n)
                lines, pos = _lines(raw, self.teacher, rng, self.seed, self.short_row_fraction)
                bad = sorted(i - done for i in bad_at if done <= i < done + n)
                positives += pos - _malform_lines(lines, bad, day, malformed)
                _write(out, lines)
                self._report(name, done + n, start)
        return _DayFile(name, positives, malformed)

    def _sample(
        self, rng: np.random.Generator, drift_rng: np.random.Generator, day: int, n: int
    ) -> RawRows:
        """`n` rows of day `day`: the ids of generation 0 moved by the drift."""
        raw = self.sampler.sample(rng, n)
        if self.drift.rate:
            raw.ids = [
                self.drift.day_ids(
                    _one_hot(table, ids), cardinality, day, drift_rng, self.sampler.exponent
                )
                for table, (ids, cardinality) in enumerate(
                    zip(raw.ids, self.sampler.cardinalities, strict=True)
                )
            ]
        return raw

    def _report(self, name: str, rows: int, start: float) -> None:
        if self.progress is not None:
            rate = rows / max(time.monotonic() - start, 1e-9)
            self.progress(
                f"[criteo_tsv] {name}: {rows:,}/{self.rows_per_day:,} rows ({rate:,.0f} rows/s)"
            )


def _malform_lines(
    lines: list[str], offsets: Sequence[int], day: int, malformed: dict[str, int]
) -> int:
    """Malforms `lines[offset]` for each of `offsets` (in place), a kind of malformation
    per line in turn, counted into `malformed`; returns how many of them were label 1."""
    positives = 0
    for offset in offsets:
        kind = MALFORMED_KINDS[(offset + day) % len(MALFORMED_KINDS)]
        positives += lines[offset].startswith("1\t")
        lines[offset] = _malform(lines[offset], kind)
        malformed[kind] += 1
    return positives


def _one_hot(table: int, ids: object) -> np.ndarray:
    if not isinstance(ids, np.ndarray):  # a log's fields hold one value each
        raise TypeError(f"table {table}: expected one id per row, got variable-length ids")
    return ids


def _lines(
    raw: RawRows,
    teacher: Teacher,
    rng: np.random.Generator,
    seed: int,
    short_row_fraction: float,
) -> tuple[list[str], int]:
    n = len(raw.counts)
    short = rng.random(n) < short_row_fraction
    # A short row is one whose last two categoricals are missing and cut off.
    for table in (NUM_CATEGORICAL - 2, NUM_CATEGORICAL - 1):
        raw.categorical_missing[table] = raw.categorical_missing[table] | short
    logits = teacher.logits(raw.numerical_features(), raw.ids, raw.categorical_missing)
    labels = teacher.sample_labels(rng, logits)
    columns: list[list[str]] = [["1" if v else "0" for v in labels.tolist()]]
    for j in range(NUM_INTEGER):
        values = list(map(str, raw.counts[:, j].tolist()))
        columns.append(_blank(values, raw.numerical_missing[:, j]))
    for t in range(NUM_CATEGORICAL):
        ids = _one_hot(t, raw.ids[t])
        values = _hex8(categorical_values(t, ids, seed))
        columns.append(_blank(values, raw.categorical_missing[t]))
    lines = ["\t".join(fields) for fields in zip(*columns, strict=True)]
    for i in np.flatnonzero(short).tolist():
        lines[i] = lines[i].rstrip("\t")
    return lines, int(labels.sum())


def _hex8(values: np.ndarray) -> list[str]:
    """Each 32-bit value as 8 lowercase hex digits ("{:08x}"), cut from one hex
    string of all of them: 2.5x faster than formatting each."""
    digits = values.astype(">u4").tobytes().hex()
    return [digits[i : i + 8] for i in range(0, len(digits), 8)]


def _blank(values: list[str], missing: np.ndarray) -> list[str]:
    """`values` with the entries where `missing` is true made empty, in place."""
    for i in np.flatnonzero(missing).tolist():
        values[i] = ""
    return values


def _malform(line: str, kind: str) -> str:
    fields = line.split("\t")
    fields += [""] * (1 + NUM_INTEGER + NUM_CATEGORICAL - len(fields))
    if kind == "field_count":
        # Too many fields. (Too few is not malformed: real logs cut trailing
        # empty fields, so a short row reads as missing values.)
        return "\t".join([*fields, "1f2e3d4c"])
    if kind == "numerical":
        fields[3] = "4.5x"
    else:
        fields[1 + NUM_INTEGER + 4] = "not-hex!"
    return "\t".join(fields)


def _write(out: IO[str], lines: list[str]) -> None:
    out.write("\n".join(lines))
    out.write("\n")


def main(argv: Sequence[str] | None = None, prog: str = "python -m dataloading.criteo_tsv") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--days", type=int, default=3)
    parser.add_argument("--rows_per_day", type=int, default=100_000)
    parser.add_argument("--exponent", type=float, default=1.1)
    parser.add_argument("--positive_rate", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gzip", action="store_true")
    parser.add_argument("--short_row_fraction", type=float, default=0.01)
    parser.add_argument("--malformed_rows_per_day", type=int, default=0)
    parser.add_argument(
        "--drift",
        type=float,
        default=0.0,
        metavar="F",
        help="from day 1 on, the share F (0 to 1) of each categorical feature's values "
        "that are new that day, while older values fade by 1 - F a day; 0: no drift",
    )
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        VocabularyDrift(args.drift).check_ids_fit(DEFAULT_CARDINALITIES, args.days)
    except ValueError as error:
        parser.error(str(error))
    try:
        report = _generate(args)
    except FileExistsError as error:  # an earlier log there: one line, not a traceback
        parser.error(str(error))
    total = sum(report.rows_per_file)
    print(f"wrote {len(report.files)} day files, {total:,} rows, malformed {report.malformed}")
    return 0


def _generate(args: argparse.Namespace) -> CriteoLogReport:
    return generate_criteo_tsv(
        args.output_dir,
        days=args.days,
        rows_per_day=args.rows_per_day,
        exponent=args.exponent,
        positive_rate=args.positive_rate,
        seed=args.seed,
        use_gzip=args.gzip,
        short_row_fraction=args.short_row_fraction,
        malformed_rows_per_day=args.malformed_rows_per_day,
        overwrite=args.overwrite,
        progress=lambda line: print(line, file=sys.stderr),
        drift=args.drift,
    )


if __name__ == "__main__":
    sys.exit(main())
