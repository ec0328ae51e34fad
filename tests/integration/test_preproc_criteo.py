"""Spark preprocessing of Criteo-format day files, checked against a pure-Python model.

One Spark session (local[2]) serves the module; the raw logs are generated: three
days with missing values, negative counts, short rows and malformed lines of every
kind, plus a bad label and a very short row added by hand.
"""

from __future__ import annotations

import gzip
import math
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dataloading.criteo_tsv import generate_criteo_tsv
from feature_spec import FeatureSpec, criteo_feature_spec, minimal_categorical_dtype
from harness.preproc_reference import (
    Row,
    build_vocabulary,
    expected_arrays,
    read_mapping,
    train_one_step,
)
from harness.processes import run
from harness.spark import spark_fixture
from preproc.config import InputFile, NumericalTransform, PipelineConfig
from preproc.encode import concatenate_parts
from preproc.errors import PreprocessingError
from preproc.layout import criteo_layout
from preproc.pipeline import run_pipeline

DAYS = 3
ROWS_PER_DAY = 1200
# Odd, small tables: many values fall under the thresholds.
CARDINALITIES = (41, 7, 300, 13, 3, 90, 25, 61, 11, 203, 17, 5, 77) * 2
THRESHOLD = 3
OVERRIDES = ("C2=1", "cat_5=10")  # by raw name and by output name
THRESHOLDS = tuple(1 if i == 1 else 10 if i == 5 else THRESHOLD for i in range(26))
SEED = 11
BAD_LABEL = "2" + "\t1" * 13 + "\tabcdef01" * 26
VERY_SHORT = "1\t3\t\t-4"  # label and three counts; everything else cut off
INTEGER = re.compile(r"-?[0-9]{1,18}")
HEX = re.compile(r"[0-9a-fA-F]{1,8}")


spark = spark_fixture(shuffle_partitions=4)


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Day files and the malformed-line counts the generator and we put in."""
    out = tmp_path_factory.mktemp("criteo") / "raw"
    log = generate_criteo_tsv(
        out,
        days=DAYS,
        rows_per_day=ROWS_PER_DAY,
        cardinalities=CARDINALITIES,
        seed=SEED,
        short_row_fraction=0.05,
        malformed_rows_per_day=4,
    )
    with open(out / "day_1", "a") as day:
        day.write(f"{BAD_LABEL}\n{VERY_SHORT}\n")
    malformed = {**log.malformed, "label": 1}
    assert all(n > 0 for n in malformed.values())
    return out, malformed


def criteo_config(raw_dir: Path, output_dir: Path, **overrides: Any) -> PipelineConfig:
    splits = ["train"] * (DAYS - 1) + ["test"]
    settings: dict[str, Any] = {
        "layout": criteo_layout(),
        "files": tuple(InputFile.of(raw_dir / f"day_{d}", split) for d, split in enumerate(splits)),
        "mappings": ("train", "test"),
        "output_dir": output_dir,
        "frequency_thresholds": THRESHOLDS,
        "numerical_transform": NumericalTransform.LOG,
        "seed": SEED,
        "keep_intermediate": True,
        **overrides,
    }
    return PipelineConfig(**settings)


# ------------------------------------------------------------ the Python model


def parse_day(path: Path, file: int) -> tuple[list[Row], list[tuple[int, str]]]:
    """Well-formed rows and (1-based line, reason) of malformed lines, by the rules
    in docs/preprocessing.md."""
    rows, bad = [], []
    key = path.name.removesuffix(".gz")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        lines = handle.read().split("\n")[:-1]
    for number, line in enumerate(lines):
        fields = line.split("\t")
        if len(fields) > 40:
            bad.append((number + 1, "field_count"))
            continue
        fields += [""] * (40 - len(fields))
        if fields[0] not in ("0", "1"):
            bad.append((number + 1, "label"))
            continue
        counts, values = fields[1:14], fields[14:]
        if any(v and not INTEGER.fullmatch(v) for v in counts):
            bad.append((number + 1, "numerical"))
            continue
        if any(v and not HEX.fullmatch(v) for v in values):
            bad.append((number + 1, "categorical"))
            continue
        numerical = tuple(math.log1p(max(int(v), 0)) if v else 0.0 for v in counts)
        categorical = tuple(v or None for v in values)  # tokens, as text
        rows.append(Row(file, key, number, fields[0] == "1", numerical, categorical))
    return rows, bad


def reference(raw_dir: Path, seed: int = SEED) -> dict[str, Any]:
    parsed = [parse_day(raw_dir / f"day_{d}", d) for d in range(DAYS)]
    train = [r for rows, _ in parsed[:-1] for r in rows]
    test = parsed[-1][0]
    vocabularies = [
        build_vocabulary((r.categorical[i] for r in train), THRESHOLDS[i]) for i in range(26)
    ]
    cardinalities = [len(v) + 1 for v in vocabularies]
    dtypes = [minimal_categorical_dtype(c) for c in cardinalities]
    malformed = Counter(reason for _, bad in parsed for _, reason in bad)
    return {
        "cardinalities": cardinalities,
        "train": expected_arrays(train, vocabularies, dtypes, shuffle=True, seed=seed),
        "test": expected_arrays(test, vocabularies, dtypes, shuffle=False, seed=seed),
        "malformed": malformed,
        "first_bad": (parsed[0][1][0]),
    }


def assert_same_dataset(actual_dir: Path, expected: dict[str, Any]) -> None:
    for mapping in ("train", "test"):
        actual = read_mapping(actual_dir, mapping)
        assert sorted(actual) == sorted(expected[mapping])
        for name, array in expected[mapping].items():
            assert actual[name].dtype == array.dtype, (mapping, name)
            np.testing.assert_array_equal(actual[name], array, err_msg=f"{mapping}/{name}")


# ------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def reference_run(
    spark: Any, raw: tuple[Path, dict[str, int]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("criteo") / "dataset"
    report = run_pipeline(criteo_config(raw[0], out), spark, console=lambda line: None)
    return out, report


def test_output_matches_the_python_model(
    raw: tuple[Path, dict[str, int]], reference_run: tuple[Path, dict[str, Any]]
) -> None:
    raw_dir, generated_malformed = raw
    out, report = reference_run
    expected = reference(raw_dir)
    assert_same_dataset(out, expected)
    # The spec is Criteo's layout with the counted cardinalities, and loads as is.
    spec = FeatureSpec.load(out, required_mappings=("train", "test"))
    assert spec.cardinalities == tuple(expected["cardinalities"])
    layout = criteo_feature_spec(expected["cardinalities"], base_directory=out)
    assert spec.source_spec == layout.source_spec
    assert spec.features == layout.features
    # The report: rows, positives, malformed lines per reason (as generated), OOV rates.
    assert report["malformed"] == generated_malformed == expected["malformed"]
    for mapping in ("train", "test"):
        labels = expected[mapping]["label"]
        split = report["splits"][mapping]
        assert split["rows"] == len(labels)
        assert split["positives"] == int(labels.sum())
        for i, feature in enumerate(report["categorical"]):
            zero = float(np.mean(expected[mapping][f"cat_{i}"] == 0))
            assert feature["oov_rate"][mapping] == pytest.approx(zero)
    assert report["lines"] == DAYS * ROWS_PER_DAY + 2
    assert report["splits"]["train"]["rows"] + report["splits"]["test"]["rows"] == (
        report["lines"] - sum(report["malformed"].values())
    )
    assert [c["frequency_threshold"] for c in report["categorical"]] == list(THRESHOLDS)
    assert (out / "report.json").is_file() and (out / "_SUCCESS").is_file()


def test_a_training_step_runs_on_the_output(reference_run: tuple[Path, dict[str, Any]]) -> None:
    loss, change = train_one_step(reference_run[0])
    assert np.isfinite(loss) and 0.2 < loss < 2.0
    assert change > 0


def test_strict_mode_fails_on_the_first_malformed_line(
    spark: Any, raw: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    raw_dir, _ = raw
    out = tmp_path / "strict"
    line, _reason = reference(raw_dir)["first_bad"]
    with pytest.raises(PreprocessingError) as caught:
        run_pipeline(criteo_config(raw_dir, out, strict=True), spark, console=lambda line: None)
    message = str(caught.value)
    assert message.startswith(f"{raw_dir / 'day_0'}:{line}: malformed line (")
    assert re.search(r"field \d+ \((I|C)\d+\): expected|expected at most 40 fields", message)
    assert "--strict" in message
    assert not (out / "feature_spec.yaml").exists() and not (out / "_SUCCESS").exists()
    assert not (out / "train").exists()


def test_resumes_after_a_stage_fails_midway(
    spark: Any,
    raw: tuple[Path, dict[str, int]],
    reference_run: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "resumed"

    def fail_on_test(part: Any, output_dir: Path) -> int:
        if output_dir.name.startswith(".test"):
            (output_dir / "label.bin").write_bytes(b"\1\0")  # half written
            raise RuntimeError("injected failure")
        return concatenate_parts(part, output_dir)

    monkeypatch.setattr("preproc.encode.concatenate_parts", fail_on_test)
    with pytest.raises(RuntimeError, match="injected failure"):
        run_pipeline(criteo_config(raw[0], out), spark, console=lambda line: None)
    # Finished stages are published; the failed one left no directory that looks done.
    assert (out / "train" / "_SUCCESS").is_file()
    assert not (out / "test").exists()
    assert not (out / "feature_spec.yaml").exists() and not (out / "_SUCCESS").exists()
    assert not list(out.rglob("test/_SUCCESS"))

    monkeypatch.setattr("preproc.encode.concatenate_parts", concatenate_parts)
    lines: list[str] = []
    run_pipeline(criteo_config(raw[0], out), spark, console=lines.append)
    for stage in ("parse", "vocabulary", "train"):
        assert any(line.startswith(f"[preproc] {stage}: done in an earlier run") for line in lines)
    assert any(line.startswith("[preproc] test: done in ") for line in lines)
    for name in ("train/cat_3.bin", "test/label.bin", "test/numerical.bin", "feature_spec.yaml"):
        assert (out / name).read_bytes() == (reference_run[0] / name).read_bytes(), name
    assert not list(out.rglob("*.partial"))

    # A rerun of the same settings does nothing; a new seed redoes the train split only.
    lines.clear()
    run_pipeline(criteo_config(raw[0], out), spark, console=lines.append)
    assert lines == [f"[preproc] {out}: complete from an earlier run with these settings"]
    lines.clear()
    run_pipeline(criteo_config(raw[0], out, seed=SEED + 1), spark, console=lines.append)
    redone = [
        line.split(":")[0] for line in lines if ": done in " in line and "earlier" not in line
    ]
    assert redone == ["[preproc] train"]
    assert_same_dataset(out, reference(raw[0], seed=SEED + 1))


def test_cli_reads_gzipped_days(
    raw: tuple[Path, dict[str, int]], reference_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    gz_dir = tmp_path / "gz"
    gz_dir.mkdir()
    for day in range(DAYS):
        with (
            open(raw[0] / f"day_{day}", "rb") as plain,
            gzip.open(gz_dir / f"day_{day}.gz", "wb") as packed,
        ):
            shutil.copyfileobj(plain, packed)
    out = tmp_path / "from_gz"
    result = run(
        [
            "python", "-m", "preproc.criteo",
            "--input_dir", str(gz_dir), "--output_dir", str(out),
            "--frequency_threshold", str(THRESHOLD),
            "--feature_frequency_threshold", OVERRIDES[0],
            "--feature_frequency_threshold", OVERRIDES[1],
            "--seed", str(SEED),
            "--spark_master", "local[2]", "--shuffle_partitions", "3",
            "--spark_conf", "spark.ui.enabled=false",
        ],
        timeout=300,
        check=True,
    )  # fmt: skip
    assert re.search(r"^train\s+[\d,]+\s+[\d,]+\s+[\d.]+%$", result.stdout, re.MULTILINE)
    assert "[preproc] parse: done in" in result.stderr
    reference_dir = reference_run[0]
    expected_files = sorted(p.relative_to(reference_dir) for p in reference_dir.rglob("*.bin"))
    assert sorted(p.relative_to(out) for p in out.rglob("*.bin")) == expected_files
    for name in expected_files:
        assert (out / name).read_bytes() == (reference_dir / name).read_bytes(), name
    assert not (out / "_work").exists()  # intermediates removed after success
