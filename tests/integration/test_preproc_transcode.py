"""preproc.transcode on a small non-Criteo schema (the one of docs/byo_dataset.md),
checked against a pure-Python model: `auto` cardinalities computed from the train
files, a pre-encoded id feature, columns in another order than the channels, a
header line, a gzipped file, malformed lines and out-of-float16-range values."""

from __future__ import annotations

import gzip
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from feature_spec import FeatureSpec, minimal_categorical_dtype
from preproc.pipeline import run_pipeline
from preproc.spark import SparkSettings, start_spark
from preproc.transcode import build_parser, transcode_config
from tests.integration.scripts.preproc_reference import (
    Row,
    build_vocabulary,
    expected_arrays,
    read_mapping,
    train_one_step,
)

COLUMNS = ("hour", "country", "clicked", "price", "ad_id", "dwell_seconds", "device")
LABEL, NUMERICAL = "clicked", ("price", "dwell_seconds")
CATEGORICAL = ("country", "device", "ad_id", "hour")  # channel order
HOURS = 24
THRESHOLD = 2
DEVICE_THRESHOLD = 10_000  # more than there are rows: device gets no ids at all
FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,3})?")
MALFORMED = {
    "field_count": "3,DE,1,2.5,ad-1,4.0,ios,extra",
    "label": "3,DE,yes,2.5,ad-1,4.0,ios",
    "numerical": "3,DE,0,2.5.1,ad-1,4.0,ios",
    "categorical": "24,DE,0,2.5,ad-1,4.0,ios",
}

CHANNELS = {"label": [LABEL], "numerical": list(NUMERICAL), "categorical": list(CATEGORICAL)}
TRAIN_FILES = ["train_a.csv", "train_b.csv.gz"]
SPEC = {
    "channel_spec": CHANNELS,
    "feature_spec": {
        "clicked": {"dtype": "bool"},
        "price": {"dtype": "float16"},
        "dwell_seconds": {"dtype": "float16"},
        "country": {"dtype": "int32", "cardinality": "auto"},
        "device": {"dtype": "int32", "cardinality": "auto"},
        "ad_id": {"dtype": "int32", "cardinality": "auto"},
        "hour": {"dtype": "int8", "cardinality": HOURS},
    },
    "metadata": {"dataset": "ad impressions (example)"},
    "source_spec": {
        "train": [{"type": "csv", "features": list(COLUMNS), "files": TRAIN_FILES}],
        "test": [{"type": "csv", "features": list(COLUMNS), "files": ["test.csv"]}],
    },
}  # fmt: skip


def impression(rng: random.Random) -> str:
    country = rng.choice(["DE", "FR", "US", "US", "US", "BR", "", "JP", f"X{rng.randrange(40)}"])
    price = rng.choice([f"{rng.uniform(0, 50):.2f}", "", f"{rng.randrange(100)}", "1e6"])
    dwell = rng.choice([f"{rng.gauss(10, 8):.3f}", "", "-3.5", ".5"])
    ad_id = f"ad-{int(rng.paretovariate(1.2)) % 300}"
    fields = {
        "hour": str(rng.randrange(HOURS)) if rng.random() > 0.05 else "",
        "country": country,
        "clicked": "1" if rng.random() < 0.3 else "0",
        "price": price,
        "ad_id": ad_id,
        "dwell_seconds": dwell,
        "device": rng.choice(["ios", "android", "web"]),
    }
    return ",".join(fields[c] for c in COLUMNS)


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    settings = SparkSettings(
        spark_master="local[2]", shuffle_partitions=4, spark_conf=(("spark.ui.enabled", "false"),)
    )
    session = start_spark(settings, console=lambda line: None)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("byo")
    rng = random.Random(5)
    train_a = [",".join(COLUMNS)] + [impression(rng) for _ in range(700)]  # with a header line
    train_a[100:100] = list(MALFORMED.values())
    train_b = [impression(rng) for _ in range(500)] + ["0,,1"]  # a short row
    test = [impression(rng) for _ in range(400)] + [MALFORMED["numerical"]]
    (out / "train_a.csv").write_text("\n".join(train_a) + "\n")
    with gzip.open(out / "train_b.csv.gz", "wt") as packed:
        packed.write("\n".join(train_b) + "\n")
    (out / "test.csv").write_text("\n".join(test) + "\n")
    (out / "spec.yaml").write_text(yaml.safe_dump(SPEC, sort_keys=False))
    return out


def parse_file(path: Path, file: int) -> tuple[list[Row], dict[str, int], int]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        lines = handle.read().split("\n")[:-1]
    rows, malformed, headers = [], dict.fromkeys(MALFORMED, 0), 0
    for number, line in enumerate(lines):
        fields = line.split(",")
        if len(fields) > len(COLUMNS):
            malformed["field_count"] += 1
            continue
        value = dict(zip(COLUMNS, fields + [""] * (len(COLUMNS) - len(fields)), strict=True))
        if tuple(value[c] for c in COLUMNS) == COLUMNS:
            headers += 1
            continue
        if value[LABEL] not in ("0", "1"):
            malformed["label"] += 1
            continue
        if any(value[n] and not FLOAT.fullmatch(value[n]) for n in NUMERICAL):
            malformed["numerical"] += 1
            continue
        hour = value["hour"]
        if hour and not (hour.isdigit() and int(hour) < HOURS):
            malformed["categorical"] += 1
            continue
        numerical = tuple(float(value[n]) if value[n] else 0.0 for n in NUMERICAL)
        categorical = tuple(value[c] or None for c in CATEGORICAL)
        key = path.name.removesuffix(".gz")
        rows.append(Row(file, key, number, value[LABEL] == "1", numerical, categorical))
    return rows, malformed, headers


def test_transcode_matches_the_python_model(spark: Any, raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "dataset"
    args = build_parser().parse_args(
        [
            "--feature_spec", str(raw / "spec.yaml"), "--output_dir", str(out),
            "--frequency_threshold", str(THRESHOLD),
            "--feature_frequency_threshold", f"device={DEVICE_THRESHOLD}",
            "--seed", "3",
        ]
    )  # fmt: skip
    report = run_pipeline(transcode_config(args), spark, console=lambda line: None)

    parsed = [
        parse_file(raw / name, i)
        for i, name in enumerate(["train_a.csv", "train_b.csv.gz", "test.csv"])
    ]
    train = parsed[0][0] + parsed[1][0]
    thresholds = (THRESHOLD, DEVICE_THRESHOLD, THRESHOLD)
    vocabularies: list[dict[Any, int] | None] = [
        build_vocabulary((r.categorical[i] for r in train), thresholds[i]) for i in range(3)
    ]
    vocabularies.append(None)  # hour: ids given
    cardinalities = [len(v) + 1 for v in vocabularies if v is not None] + [HOURS]
    assert cardinalities[1] == 1  # no device value reached its threshold
    dtypes = [minimal_categorical_dtype(c) for c in cardinalities]

    spec = FeatureSpec.load(out, required_mappings=("train", "test"))
    assert [f.name for f in spec.categorical_features] == list(CATEGORICAL)
    assert [f.name for f in spec.numerical_features] == list(NUMERICAL)
    assert spec.label_feature.name == LABEL
    assert spec.cardinalities == tuple(cardinalities)
    assert [f.dtype for f in spec.categorical_features] == dtypes
    assert spec.metadata["dataset"] == "ad impressions (example)"

    expected = {
        "train": expected_arrays(train, vocabularies, dtypes, shuffle=True, seed=3),
        "test": expected_arrays(parsed[2][0], vocabularies, dtypes, shuffle=False, seed=3),
    }
    for mapping, arrays in expected.items():
        actual = read_mapping(out, mapping)
        assert sorted(actual) == sorted(arrays)
        for name, array in arrays.items():
            np.testing.assert_array_equal(actual[name], array, err_msg=f"{mapping}/{name}")
        assert report["splits"][mapping]["rows"] == len(arrays["label"])

    malformed = {k: sum(p[1][k] for p in parsed) for k in MALFORMED}
    assert malformed == {"field_count": 1, "label": 1, "numerical": 2, "categorical": 1}
    assert report["malformed"] == malformed
    assert report["header_lines"] == 1
    price = next(n for n in report["numerical"] if n["name"] == "price")
    huge = {
        m: sum(r.numerical[0] > 65504 for r in rows)
        for m, rows in [("train", train), ("test", parsed[2][0])]
    }
    assert price["saturated"] == huge and huge["train"] > 0

    loss, change = train_one_step(out)
    assert np.isfinite(loss) and change > 0
