"""Flags and configuration of the preprocessing CLIs (no Spark): day files, day
splits, thresholds, layouts, and errors that name the flag."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest

from preproc.config import (
    InputFile,
    NumericalTransform,
    PipelineConfig,
    parse_thresholds,
    strip_compression_suffix,
)
from preproc.criteo import (
    assign_days,
    build_parser,
    criteo_config,
    find_day_files,
    main,
    parse_days,
)
from preproc.errors import PreprocessingError
from preproc.layout import CategoricalColumn, CategoricalKind, InputLayout, criteo_layout


def day_files(directory: Path, names: list[str]) -> Path:
    directory.mkdir()
    for name in names:
        (directory / name).write_text("0\n")
    return directory


def test_finds_plain_and_gzipped_day_files(tmp_path: Path) -> None:
    raw = day_files(tmp_path / "raw", ["day_0", "day_1.gz", "day_10", "notes.txt", "day_x"])
    found = {d: p.name for d, p in find_day_files(raw).items()}
    assert found == {0: "day_0", 1: "day_1.gz", 10: "day_10"}


def test_day_file_errors(tmp_path: Path) -> None:
    with pytest.raises(PreprocessingError, match=r"--input_dir .*expected a directory"):
        find_day_files(tmp_path / "missing")
    empty = day_files(tmp_path / "empty", ["readme"])
    with pytest.raises(PreprocessingError, match=r"expected day files named day_0.*\['readme'\]"):
        find_day_files(empty)
    twice = day_files(tmp_path / "twice", ["day_3", "day_3.gz"])
    with pytest.raises(PreprocessingError, match="day 3 is there twice"):
        find_day_files(twice)


def test_parse_days() -> None:
    assert parse_days("0-3,7", "--train_days") == [0, 1, 2, 3, 7]
    assert parse_days(None, "--test_days") is None
    with pytest.raises(PreprocessingError, match="--test_days: expected day numbers"):
        parse_days("last", "--test_days")
    with pytest.raises(PreprocessingError, match="--train_days: range '5-2' runs backwards"):
        parse_days("5-2", "--train_days")


def test_assign_days_defaults_and_overrides() -> None:
    days = [0, 1, 2, 3]
    assert assign_days(days, None, None, None) == {"train": [0, 1, 2], "test": [3]}
    assert assign_days(days, None, None, [2]) == {"train": [0, 1], "validation": [2], "test": [3]}
    assert assign_days(days, [0], [1], None) == {"train": [0], "test": [1]}  # 2, 3 unused
    assert assign_days(days, [1, 2, 3], None, None) == {"train": [1, 2, 3], "test": [0]}


@pytest.mark.parametrize(
    ("train", "test", "validation", "message"),
    [
        ([0, 9], None, None, "--train_days: day 9 has no file"),
        ([0, 1], [1], None, "--test_days: day 1 is also in --train_days"),
        (None, [3], [3], "--validation_days: day 3 is also in --test_days"),
        ([0, 1, 2, 3], None, None, "--test_days: no days left"),
    ],
)
def test_assign_days_errors(
    train: list[int] | None, test: list[int] | None, validation: list[int] | None, message: str
) -> None:
    with pytest.raises(PreprocessingError, match=message):
        assign_days([0, 1, 2, 3], train, test, validation)


def test_one_day_is_not_enough_by_default() -> None:
    with pytest.raises(PreprocessingError, match="--train_days: no days left"):
        assign_days([0], None, None, None)


def test_thresholds_by_either_name() -> None:
    names = [("C1", "cat_0"), ("C2", "cat_1"), ("C3", "cat_2")]
    assert parse_thresholds(4, ["C2=1,cat_2=9"], names, "--f") == (4, 1, 9)
    assert parse_thresholds(0, [], names, "--f") == (0, 0, 0)
    with pytest.raises(PreprocessingError, match=r"--f: expected NAME=N .*C1, C2, C3.*'C9=2'"):
        parse_thresholds(1, ["C9=2"], names, "--f")
    with pytest.raises(PreprocessingError, match=r"--f: expected a non-negative integer.*'C1=-2'"):
        parse_thresholds(1, ["C1=-2"], names, "--f")
    with pytest.raises(PreprocessingError, match="--frequency_threshold: expected >= 0"):
        parse_thresholds(-1, [], names, "--f")


def test_input_file_keys_ignore_compression() -> None:
    assert InputFile.of("/data/day_3.gz", "train").key == "day_3"
    assert InputFile.of("x/part.csv.bz2", "test").key == "part.csv"
    assert strip_compression_suffix("day_3") == "day_3"


def test_criteo_layout() -> None:
    layout = criteo_layout()
    assert layout.fields[:3] == ("label", "I1", "I2") and layout.fields[-1] == "C26"
    assert [c.name for c in layout.numerical][-1] == "num_12"
    assert [c.name for c in layout.categorical][:2] == ["cat_0", "cat_1"]
    assert layout.vocabulary_columns == tuple(range(26))
    assert layout.position("C1") == 14


def test_layout_validation() -> None:
    kind = criteo_layout().numerical_kind
    with pytest.raises(PreprocessingError, match="every field used exactly once"):
        InputLayout(",", ("y", "a", "b"), "y", "y", (), kind, ())
    no_cardinality = CategoricalColumn("a", "a", CategoricalKind.ID)
    with pytest.raises(PreprocessingError, match="an id column needs a cardinality"):
        InputLayout(",", ("y", "a"), "y", "y", (), kind, (no_cardinality,))
    with pytest.raises(PreprocessingError, match="delimiter"):
        InputLayout("\n", ("y",), "y", "y", (), kind, ())


def test_pipeline_config_validation(tmp_path: Path) -> None:
    files = (InputFile.of(tmp_path / "day_0", "train"), InputFile.of(tmp_path / "day_1", "test"))
    valid = PipelineConfig(
        layout=criteo_layout(),
        files=files,
        mappings=("train", "test"),
        output_dir=tmp_path / "out",
        frequency_thresholds=(0,) * 26,
        numerical_transform=NumericalTransform.LOG,
    )
    config = functools.partial(dataclasses.replace, valid)  # validated anew
    assert valid.files_of("test") == (1,)
    with pytest.raises(PreprocessingError, match="expected 'train' first"):
        config(mappings=("test", "train"))
    with pytest.raises(PreprocessingError, match="mapping 'validation': expected input files"):
        config(mappings=("train", "test", "validation"))
    with pytest.raises(PreprocessingError, match="one per categorical feature \\(26\\), got 3"):
        config(frequency_thresholds=(1, 2, 3))
    with pytest.raises(PreprocessingError, match="each file once"):
        config(files=(*files, files[0]))
    with pytest.raises(PreprocessingError, match="mapping 'bad-name'"):
        config(
            files=(*files, InputFile.of(tmp_path / "x", "bad-name")),
            mappings=("train", "test", "bad-name"),
        )


def test_cli_prints_flag_errors_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = day_files(tmp_path / "raw", ["day_0", "day_1"])
    common = ["--input_dir", str(raw), "--output_dir", str(tmp_path / "out")]
    nowhere = str(tmp_path / "nowhere")
    for flags, error in [
        (["--test_days", "7"], "--test_days: day 7 has no file"),
        (
            ["--feature_frequency_threshold", "C30=3"],
            "--feature_frequency_threshold: expected NAME=N",
        ),
        (["--gpu"], "--gpu: the RAPIDS Accelerator jar is required"),
        (["--spark_conf", "novalue"], "--spark_conf: expected key=value, got 'novalue'"),
        # A dataset to carry forward that is none: refused before Spark starts.
        (["--vocabulary_from", nowhere], f"--vocabulary_from {nowhere}: expected a dataset"),
        (["--oov_buckets", "-1"], "--oov_buckets: expected an int >= 0, got -1"),
    ]:
        assert main([*common, *flags]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {error}") and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_vocabulary_flags_reach_the_config(tmp_path: Path) -> None:
    raw = day_files(tmp_path / "raw", ["day_0", "day_1"])
    common = ["--input_dir", str(raw), "--output_dir", str(tmp_path / "out")]

    def config(*flags: str) -> PipelineConfig:
        return criteo_config(build_parser().parse_args([*common, *flags]))

    assert config().vocabulary_from is None and config().oov_buckets == 0
    carried = config("--vocabulary_from", str(tmp_path / "day_a"), "--oov_buckets", "7")
    assert carried.vocabulary_from == tmp_path / "day_a" and carried.oov_buckets == 7
    with pytest.raises(PreprocessingError, match=r"--vocabulary_from \S+: expected an earlier"):
        config("--vocabulary_from", str(tmp_path / "out"))
