"""The synthetic generators: sizes, dtypes, id ranges, label rate, signal, format."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np
import pytest

from dataloading import commands
from dataloading.criteo_tsv import (
    MALFORMED_KINDS,
    _hex8,
    categorical_values,
    generate_criteo_tsv,
)
from dataloading.files import RaggedIds, SplitBinaryFiles
from dataloading.synthetic import build_teacher, generate_split_binary, main
from dataloading.teacher import FeatureSampler, Teacher, power_law_ids
from feature_spec import FeatureSpec, FeatureSpecError
from harness.reference_metrics import reference_auc

CARDINALITIES = (23, 7, 300, 40000, 2)
HEX8 = re.compile(r"^[0-9a-f]{8}$")


def test_split_binary_sizes_dtypes_ranges(tmp_path: Path) -> None:
    path = tmp_path / "d"
    rows = {"train": 5000, "test": 777}
    spec = generate_split_binary(
        path, CARDINALITIES, 4, rows=rows, hotness=(1, 1, 3, 1, 1), seed=1, chunk_rows=1000
    )
    dtypes = [f.dtype for f in spec.categorical_features]
    assert dtypes == ["int8", "int8", "int16", "int32", "int8"]
    for mapping, count in rows.items():
        files = SplitBinaryFiles.open(spec, mapping)
        assert files.rows == count
        assert files.label.path.stat().st_size == count
        assert files.numerical is not None
        assert files.numerical.path.stat().st_size == count * 4 * 2
        assert files.categorical["cat_2"].path.stat().st_size == count * 3 * 2
        files.check_ids(spec)  # raises when an id is out of range
        numerical = files.numerical.memmap()
        assert np.isfinite(numerical).all() and (numerical >= 0).all()
    assert FeatureSpec.load(path, required_mappings=("train", "test")) == spec


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
    auc = reference_auc(labels, teacher.logits(numerical, ids))
    assert auc > 0.75  # the best model's AUC: plenty of signal to learn
    other = build_teacher(sampler, seed=8, positive_rate=0.25)
    assert abs(reference_auc(labels, other.logits(numerical, ids)) - 0.5) < 0.1


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
    with pytest.raises(FeatureSpecError, match="cardinality: expected a positive int, got 0"):
        generate_split_binary(tmp_path / "d", (5, 0, 7), 2, rows={"train": 10})
    assert list(tmp_path.iterdir()) == []


def test_hotness_of_other_tables_is_refused_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
    assert main(["--output_dir", str(out), "--train_rows", "300", "--test_rows", "50",
                 "--cardinalities", "5,9,1000", "--num_numerical", "2"]) == 0  # fmt: skip
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
    short = good = positives = missing_int = negative = 0
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


# Variable-length tables (hotness 0) beside a multi-hot one; odd, tiny sizes.
VARIABLE_CARDINALITIES = (23, 7, 11)
VARIABLE_HOTNESS = (0, 3, 0)
MAX_VARIABLE_HOTNESS = 5


def generate_variable(path: Path, rows: dict[str, int], seed: int = 4) -> FeatureSpec:
    return generate_split_binary(
        path,
        VARIABLE_CARDINALITIES,
        2,
        rows=rows,
        hotness=VARIABLE_HOTNESS,
        seed=seed,
        chunk_rows=700,  # offsets cross chunk boundaries
        max_variable_hotness=MAX_VARIABLE_HOTNESS,
    )


def read_ids(spec: FeatureSpec, files: SplitBinaryFiles) -> list[np.ndarray | RaggedIds]:
    ids: list[np.ndarray | RaggedIds] = []
    for feature in spec.categorical_features:
        values = files.categorical[feature.name].memmap().astype(np.int64)
        if feature.is_variable_length:
            ids.append(RaggedIds.from_offsets(values, files.offsets[feature.name].memmap()))
        else:
            ids.append(values)
    return ids


def test_variable_length_tables_values_and_offsets(tmp_path: Path) -> None:
    spec = generate_variable(tmp_path / "d", {"train": 3001, "test": 0})
    assert spec.hotness == VARIABLE_HOTNESS
    assert spec.metadata["max_variable_hotness"] == MAX_VARIABLE_HOTNESS
    assert FeatureSpec.load(tmp_path / "d", required_mappings=("train", "test")) == spec
    files = SplitBinaryFiles.open(spec, "train")  # checks offsets[0] and offsets[-1]
    assert files.rows == 3001
    assert sorted(files.offsets) == ["cat_0", "cat_2"]
    files.check_ids(spec)  # ids in range, offsets non-decreasing
    for name in files.offsets:
        offsets = files.offsets[name].memmap()
        values = files.categorical[name].memmap()
        assert offsets.dtype == np.int64 and len(offsets) == 3001 + 1
        assert offsets[0] == 0 and offsets[-1] == len(values)
        lengths = np.diff(offsets)
        assert lengths.min() == 0 and lengths.max() == MAX_VARIABLE_HOTNESS
        assert (lengths == 0).sum() > 100  # about 1 row in 6 is empty
        cardinality = spec.features[name].cardinality
        assert values.min() >= 0 and values.max() < cardinality  # type: ignore[operator]
    assert files.categorical["cat_1"].memmap().shape == (3001, 3)
    empty = SplitBinaryFiles.open(spec, "test")
    assert empty.rows == 0
    assert empty.offsets["cat_0"].memmap().tolist() == [0]


def test_variable_length_labels_follow_the_teacher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    used: list[np.ndarray] = []
    sample_labels = Teacher.sample_labels

    def recording(self: Teacher, rng: np.random.Generator, logits: np.ndarray) -> np.ndarray:
        used.append(logits)
        return sample_labels(self, rng, logits)

    monkeypatch.setattr(Teacher, "sample_labels", recording)
    spec = generate_variable(tmp_path / "d", {"train": 4000})
    files = SplitBinaryFiles.open(spec, "train")
    sampler = FeatureSampler(
        2, VARIABLE_CARDINALITIES, VARIABLE_HOTNESS, 1.1, max_variable_hotness=MAX_VARIABLE_HOTNESS
    )
    teacher = build_teacher(sampler, seed=4, positive_rate=0.25)
    assert teacher.bias == pytest.approx(spec.metadata["teacher_bias"])
    assert files.numerical is not None
    numerical = files.numerical.memmap().astype(np.float32)
    logits = teacher.logits(numerical, read_ids(spec, files))
    # The files hold the numerical features in float16: close, not equal.
    np.testing.assert_allclose(logits, np.concatenate(used), atol=0.02)
    labels = files.label.memmap()
    assert 0.2 < labels.mean() < 0.3
    assert reference_auc(labels, logits) > 0.75
    # The tolerance is tight enough to catch ids read one row off.
    ids = read_ids(spec, files)
    ragged = ids[2]
    assert isinstance(ragged, RaggedIds)
    ids[2] = RaggedIds(ragged.values, np.roll(ragged.row_lengths, 1))
    shifted = teacher.logits(numerical, ids)
    assert np.abs(shifted - np.concatenate(used)).max() > 0.5


def test_id_effects_of_ragged_rows_average_and_empty_rows_are_zero() -> None:
    teacher = Teacher.create(num_numerical=1, num_tables=2, seed=0)
    ids = RaggedIds(np.array([4, 1, 1, 9, 2]), np.array([0, 2, 0, 0, 3, 0]))
    effects = teacher.id_effects(1, ids)
    rows = [[], [4, 1], [], [], [1, 9, 2], []]
    expected = [teacher.id_effects(1, np.array(row)).mean() if row else 0.0 for row in rows]
    np.testing.assert_allclose(effects, expected)
    missing = [np.zeros(6, bool), np.array([False, True, False, False, False, False])]
    logits = teacher.logits(np.zeros((6, 1), np.float32), [np.zeros(6, np.int64), ids], missing)
    without = teacher.logits(np.zeros((6, 1), np.float32), [np.zeros(6, np.int64), ids])
    assert logits[1] != without[1]
    np.testing.assert_array_equal(np.delete(logits, 1), np.delete(without, 1))
    all_empty = RaggedIds(np.zeros(0, np.int64), np.zeros(4, np.int64))
    np.testing.assert_array_equal(teacher.id_effects(0, all_empty), np.zeros(4))


def test_variable_length_same_seed_same_bytes(tmp_path: Path) -> None:
    for name, seed in (("a", 4), ("b", 4), ("c", 5)):
        generate_variable(tmp_path / name, {"train": 1500, "test": 99}, seed=seed)
    names = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.*"))
    assert Path("train/cat_2.offsets.bin") in names and Path("feature_spec.yaml") in names
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    offsets = Path("train/cat_0.offsets.bin")
    assert (tmp_path / "a" / offsets).read_bytes() != (tmp_path / "c" / offsets).read_bytes()


def test_cli_variable_hotness(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main(["--output_dir", str(out), "--train_rows", "300", "--test_rows", "50",
                 "--cardinalities", "23,7,11", "--hotness", "1,0,3", "--num_numerical", "2",
                 "--max_variable_hotness", "2"]) == 0  # fmt: skip
    spec = FeatureSpec.load(out)
    assert spec.hotness == (1, 0, 3)
    files = SplitBinaryFiles.open(spec, "train")
    files.check_ids(spec)
    assert np.diff(files.offsets["cat_1"].memmap()).max() <= 2
    for flags, message in (
        (["--max_variable_hotness", "0"], "max_variable_hotness: expected an int >= 1, got 0"),
        (["--hotness", "1,-1,3"], "hotness: expected ids per row >= 1, or 0 for a variable"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["--output_dir", str(tmp_path / "bad"), "--cardinalities", "23,7,11",
                  "--hotness", "1,0,3", *flags])  # fmt: skip
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("command", ["dataset", "clicklog"])
def test_dlrm_synthetic_refuses_a_non_empty_directory_in_one_line(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(SystemExit) as exit_info:
        commands.main([command, f"--output_dir={tmp_path}"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"dlrm-synthetic {command}: error: {tmp_path}: output directory exists" in error
    assert "--overwrite" in error and "Traceback" not in error
    assert (tmp_path / "keep.txt").read_text() == "user data"


def test_dlrm_synthetic_names_its_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert commands.main(["--help"]) == 0
    assert "dataset" in capsys.readouterr().out
    assert commands.main(["clicks"]) == 2
    assert "unknown command 'clicks'; expected one of dataset, clicklog" in capsys.readouterr().err


def test_categorical_values_are_written_as_8_hex_digits_each() -> None:
    values = np.array([0, 1, 0xDEADBEEF, 0x00ABCDEF, 2**32 - 1], np.uint64)
    expected = ["00000000", "00000001", "deadbeef", "00abcdef", "ffffffff"]
    assert _hex8(values) == expected == [f"{v:08x}" for v in values.tolist()]
    assert _hex8(np.array([], np.uint64)) == []
