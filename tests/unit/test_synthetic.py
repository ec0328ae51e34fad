"""The synthetic generators: sizes, dtypes, id ranges, label rate, signal, format."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from dataloading.criteo_tsv import MALFORMED_KINDS, categorical_values, generate_criteo_tsv
from dataloading.files import SplitBinaryFiles
from dataloading.synthetic import build_teacher, generate_split_binary, main
from dataloading.teacher import FeatureSampler, power_law_ids
from feature_spec import FeatureSpec

CARDINALITIES = (23, 7, 300, 40000, 2)
HEX8 = re.compile(r"^[0-9a-f]{8}$")


def test_split_binary_sizes_dtypes_ranges(tmp_path: Path) -> None:
    spec = generate_split_binary(
        tmp_path / "d",
        CARDINALITIES,
        4,
        rows={"train": 5000, "test": 777},
        hotness=(1, 1, 3, 1, 1),
        seed=1,
        chunk_rows=1000,
    )
    assert [f.dtype for f in spec.categorical_features] == [
        "int8",
        "int8",
        "int16",
        "int32",
        "int8",
    ]
    for mapping, rows in (("train", 5000), ("test", 777)):
        files = SplitBinaryFiles.open(spec, mapping)
        assert files.rows == rows
        assert files.label.path.stat().st_size == rows
        assert files.numerical is not None
        assert files.numerical.path.stat().st_size == rows * 4 * 2
        assert files.categorical["cat_2"].path.stat().st_size == rows * 3 * 2
        files.check_ids(spec)  # raises when an id is out of range
        numerical = files.numerical.memmap()
        assert np.isfinite(numerical).all() and (numerical >= 0).all()
    assert FeatureSpec.load(tmp_path / "d", required_mappings=("train", "test")) == spec


def test_ids_follow_a_power_law(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    ids = power_law_ids(rng, 1000, 200_000, exponent=1.1)
    counts = np.bincount(ids, minlength=1000)
    assert ids.min() >= 0 and ids.max() < 1000
    # Frequencies fall with rank roughly as (k+1)^-1.1: id 0 vs id 9.
    assert 8 < counts[0] / counts[9] < 16
    uniform = np.bincount(power_law_ids(rng, 10, 100_000, exponent=0.0), minlength=10)
    assert uniform.min() > 9000


def test_labels_carry_teacher_signal(tmp_path: Path) -> None:
    spec = generate_split_binary(tmp_path / "d", CARDINALITIES, 3, rows={"test": 40_000}, seed=7)
    files = SplitBinaryFiles.open(spec, "test")
    labels = files.label.memmap()
    assert 0.22 < labels.mean() < 0.28  # calibrated to positive_rate=0.25
    sampler = FeatureSampler(3, CARDINALITIES, (1,) * len(CARDINALITIES), 1.1)
    teacher = build_teacher(sampler, seed=7, positive_rate=0.25)
    assert teacher.bias == pytest.approx(spec.metadata["teacher_bias"])
    assert files.numerical is not None
    numerical = files.numerical.memmap().astype(np.float32)
    ids = [files.categorical[f.name].memmap().astype(np.int64) for f in spec.categorical_features]
    auc = roc_auc_score(labels, teacher.logits(numerical, ids))
    assert auc > 0.75  # the best model's AUC: plenty of signal to learn
    other = build_teacher(sampler, seed=8, positive_rate=0.25)
    assert abs(roc_auc_score(labels, other.logits(numerical, ids)) - 0.5) < 0.1


def test_same_seed_same_bytes_and_no_overwrite(tmp_path: Path) -> None:
    a = generate_split_binary(tmp_path / "a", CARDINALITIES, 2, rows={"train": 999}, seed=3)
    b = generate_split_binary(
        tmp_path / "b", CARDINALITIES, 2, rows={"train": 999}, seed=3, chunk_rows=1000
    )
    for name in ("cat_3", "cat_0"):
        path_a = a.files("train").categorical[name]
        assert path_a.read_bytes() == b.files("train").categorical[name].read_bytes()
    with pytest.raises(FileExistsError, match="not empty"):
        generate_split_binary(tmp_path / "a", CARDINALITIES, 2, rows={"train": 10})
    assert a.files("train").label.stat().st_size == 999  # untouched
    generate_split_binary(tmp_path / "a", CARDINALITIES, 2, rows={"train": 10}, overwrite=True)
    assert a.files("train").label.stat().st_size == 10
    assert not list(tmp_path.glob(".*partial"))


def test_bad_cardinality_writes_nothing(tmp_path: Path) -> None:
    from feature_spec import FeatureSpecError

    with pytest.raises(FeatureSpecError, match="cardinality: expected a positive int, got 0"):
        generate_split_binary(tmp_path / "d", (5, 0, 7), 2, rows={"train": 10})
    assert list(tmp_path.iterdir()) == []


def test_hotness_of_other_tables_is_refused_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from feature_spec import FeatureSpecError

    with pytest.raises(
        FeatureSpecError, match=r"hotness: expected one value per table \(3\), got 2"
    ):
        generate_split_binary(tmp_path / "d", (5, 9, 7), 2, rows={"train": 10}, hotness=(1, 2))
    # --shape mlperf_dcnv2_small has 26 tables' ids per row.
    with pytest.raises(SystemExit) as exit_info:
        main(["--output_dir", str(tmp_path / "cli"), "--shape", "mlperf_dcnv2_small",
              "--cardinalities", "5,9"])  # fmt: skip
    assert exit_info.value.code == 2
    assert "--cardinalities: 2 tables, but --shape mlperf_dcnv2_small has ids per row for 26" in (
        capsys.readouterr().err
    )
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_dataset(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    code = main(
        ["--output_dir", str(out), "--train_rows", "300", "--test_rows", "50",
         "--cardinalities", "5,9,1000", "--num_numerical", "2"]
    )  # fmt: skip
    assert code == 0
    spec = FeatureSpec.load(out)
    assert spec.cardinalities == (5, 9, 1000)
    assert SplitBinaryFiles.open(spec, "test").rows == 50


def parse_rows(path: Path) -> list[list[str]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return [line.rstrip("\n").split("\t") for line in handle]


@pytest.mark.parametrize("use_gzip", [False, True])
def test_criteo_tsv_format(tmp_path: Path, use_gzip: bool) -> None:
    cardinalities = (50, 7, 3000) + (11,) * 23
    report = generate_criteo_tsv(
        tmp_path / "raw",
        days=3,
        rows_per_day=2000,
        cardinalities=cardinalities,
        use_gzip=use_gzip,
        short_row_fraction=0.05,
        malformed_rows_per_day=7,
        chunk_rows=900,
        seed=2,
    )
    suffix = ".gz" if use_gzip else ""
    assert [p.name for p in report.files] == [f"day_{d}{suffix}" for d in range(3)]
    malformed = dict.fromkeys(MALFORMED_KINDS, 0)
    short = good = positives = 0
    missing_int = negative = 0
    for path in report.files:
        rows = parse_rows(path)
        assert len(rows) == 2000
        for fields in rows:
            if len(fields) > 40:
                malformed["field_count"] += 1
                continue
            if len(fields) < 40:
                short += 1
            fields = fields + [""] * (40 - len(fields))
            ints, cats = fields[1:14], fields[14:]
            if not all(re.fullmatch(r"-?\d+", v) or v == "" for v in ints):
                malformed["numerical"] += 1
                continue
            if not all(HEX8.match(v) or v == "" for v in cats):
                malformed["categorical"] += 1
                continue
            assert fields[0] in ("0", "1")
            good += 1
            positives += fields[0] == "1"
            missing_int += ints.count("")
            negative += sum(v.startswith("-") for v in ints)
    assert malformed == report.malformed and sum(malformed.values()) == 21
    assert positives == report.positives
    assert 0.2 < positives / good < 0.3
    assert short > 100  # trailing empty fields cut off
    assert missing_int > 0 and negative > 0


def test_criteo_categorical_values_distinct_per_table() -> None:
    ids = np.arange(100_000)
    values = categorical_values(3, ids, seed=0)
    assert len(np.unique(values)) == len(ids)
    assert values.max() < 2**32
    assert not np.array_equal(values, categorical_values(4, ids, seed=0))
