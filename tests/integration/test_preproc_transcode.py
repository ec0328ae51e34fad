"""preproc.transcode on a small non-Criteo schema (the one of docs/byo_dataset.md),
checked against a pure-Python model: `auto` cardinalities computed from the train
files, a pre-encoded id feature, columns in another order than the channels, a
header line, a gzipped file, malformed lines and out-of-float16-range values; and
list columns (`hotness: variable`): ids and global row offsets, empty lists, bad
list elements."""

from __future__ import annotations

import gzip
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from dataloading.files import SplitBinaryFiles
from dlrm.app.records import read_records
from feature_spec import FeatureSpec, minimal_categorical_dtype
from harness.preproc_reference import (
    Row,
    build_vocabulary,
    expected_arrays,
    read_mapping,
    shuffle_key,
    train_one_step,
)
from harness.processes import main_py
from harness.spark import spark_fixture
from preproc.errors import PreprocessingError
from preproc.pipeline import run_pipeline
from preproc.transcode import build_parser, transcode_config

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


spark = spark_fixture(shuffle_partitions=4)


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


def transcode(spark: Any, spec: Path, out: Path, *flags: str) -> dict[str, Any]:
    """The report of `preproc.transcode` of `spec` into `out` with `flags`, run in `spark`."""
    arguments = ["--feature_spec", str(spec), "--output_dir", str(out), *flags]
    config = transcode_config(build_parser().parse_args(arguments))
    return run_pipeline(config, spark, console=lambda line: None)


def test_transcode_matches_the_python_model(spark: Any, raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "dataset"
    report = transcode(
        spark, raw / "spec.yaml", out,
        "--frequency_threshold", str(THRESHOLD),
        "--feature_frequency_threshold", f"device={DEVICE_THRESHOLD}",
        "--seed", "3",
    )  # fmt: skip

    parsed = [parse_file(raw / name, i) for i, name in enumerate([*TRAIN_FILES, "test.csv"])]
    train = parsed[0][0] + parsed[1][0]
    splits = {"train": train, "test": parsed[2][0]}
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
        "test": expected_arrays(splits["test"], vocabularies, dtypes, shuffle=False, seed=3),
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
    huge = {m: sum(r.numerical[0] > 65504 for r in rows) for m, rows in splits.items()}
    assert price["saturated"] == huge and huge["train"] > 0

    loss, change = train_one_step(out)
    assert np.isfinite(loss) and change > 0


# ------------------------------------------------------------------ list columns

# tags: text values, `auto`; slots: ids given, cardinality 9; both `hotness: variable`.
LIST_COLUMNS = ("clicked", "tags", "price", "slots", "country")
SLOTS = 9
LIST_SPEC = {
    "channel_spec": {
        "label": ["clicked"], "numerical": ["price"], "categorical": ["country", "tags", "slots"]
    },
    "feature_spec": {
        "clicked": {"dtype": "bool"},
        "price": {"dtype": "float16"},
        "country": {"dtype": "int32", "cardinality": "auto"},
        "tags": {"dtype": "int32", "cardinality": "auto", "hotness": "variable"},
        "slots": {"dtype": "int32", "cardinality": SLOTS, "hotness": "variable"},
    },
    "source_spec": {
        "train": [{"type": "csv", "features": list(LIST_COLUMNS), "files": ["train.csv"]}],
        "test": [{"type": "csv", "features": list(LIST_COLUMNS), "files": ["test.csv"]}],
    },
}  # fmt: skip
BAD_SLOTS = {"3|12": ("2", "'12'"), "x": ("1", "'x'"), "4|5|-1": ("3", "'-1'")}


def listing(rng: random.Random) -> str:
    tags = [rng.choice(["sport", "news", "news", "car", "tv", f"t{rng.randrange(30)}", ""])]
    tags = tags[: rng.randrange(4)] + [rng.choice(["news", "car", "x"]) for _ in range(3)]
    slots = [str(rng.randrange(SLOTS)) for _ in range(rng.choice([0, 0, 1, 2, 5]))]
    fields = {
        "clicked": rng.choice("01"),
        "tags": "|".join(tags[: rng.choice([0, 1, 2, 4])]),
        "price": f"{rng.randrange(100)}",
        "slots": "|".join(slots),
        "country": rng.choice(["DE", "US", "FR", ""]),
    }
    return ",".join(fields[c] for c in LIST_COLUMNS)


def expected_lists(
    lines: list[str], vocabulary: dict[Any, int], ordered: list[int]
) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (ids, offsets) of the well-formed `lines` in the order of line numbers
    `ordered`: each list element through the vocabulary (tags) or as an id (slots);
    an empty field is no ids, an empty element missing (0)."""
    out: dict[str, tuple[list[int], list[int]]] = {}
    for name in ("tags", "slots"):
        ids, offsets = [], [0]
        for number in ordered:
            field = dict(zip(LIST_COLUMNS, lines[number].split(","), strict=True))[name]
            elements = field.split("|") if field else []
            if name == "tags":
                ids += [vocabulary.get(e, 0) if e else 0 for e in elements]
            else:
                ids += [int(e) if e else 0 for e in elements]
            offsets.append(len(ids))
        out[name] = (ids, offsets)
    return out


@pytest.fixture(scope="module")
def raw_lists(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lists")
    rng = random.Random(11)
    train = [listing(rng) for _ in range(300)]
    train[7] = "1,news||car,3,|4|,DE"  # empty elements: missing values
    train[8] = "0,,5,,US"  # two empty lists
    train[40:40] = [f"0,news,1,{slots},DE" for slots in BAD_SLOTS]  # malformed
    test = [listing(rng) for _ in range(80)] + ["1,zzz|news|,2,8|0,JP"]
    (out / "train.csv").write_text("\n".join(train) + "\n")
    (out / "test.csv").write_text("\n".join(test) + "\n")
    (out / "spec.yaml").write_text(yaml.safe_dump(LIST_SPEC, sort_keys=False))
    return out


@pytest.mark.parametrize("size", ["small", "medium", "large"])
def test_list_columns_write_ids_and_global_offsets(
    spark: Any, raw_lists: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: str
) -> None:
    """Also the paths that depend on the data's size (forced here by lowering the
    limits): small vocabularies are summed on the driver and looked up by the binary
    writers; medium ones joined by broadcast; large ones summed by Spark and joined
    with a shuffle."""
    if size != "small":
        monkeypatch.setattr("preproc.encode.WRITER_VOCABULARY_IDS", 0)
    if size == "large":
        monkeypatch.setattr("preproc.encode.BROADCAST_VOCABULARY_IDS", 0)
        monkeypatch.setattr("preproc.vocabulary.DRIVER_COUNT_ROWS", 0)
    out = tmp_path / "dataset"
    report = transcode(
        spark, raw_lists / "spec.yaml", out, "--frequency_threshold", str(THRESHOLD), "--seed", "4",
        "--rows_per_partition", "40",  # many tasks and buckets: offsets must carry over
    )  # fmt: skip

    train = (raw_lists / "train.csv").read_text().split("\n")[:-1]
    test = (raw_lists / "test.csv").read_text().split("\n")[:-1]
    bad = [n for n, line in enumerate(train) if line.split(",")[3] in BAD_SLOTS]
    assert len(bad) == len(BAD_SLOTS) and report["malformed"]["categorical"] == len(bad)
    good = [n for n in range(len(train)) if n not in bad]
    tags = [e for n in good for e in train[n].split(",")[1].split("|") if e]
    vocabulary = build_vocabulary(tags, THRESHOLD)
    assert "x" in vocabulary and vocabulary["news"] == 1  # the most frequent element

    spec = FeatureSpec.load(out, required_mappings=("train", "test"))
    features = {f.name: f for f in spec.categorical_features}
    assert [f.hotness for f in spec.categorical_features] == [1, 0, 0]
    assert features["tags"].cardinality == len(vocabulary) + 1
    assert features["slots"].cardinality == SLOTS
    assert spec.files("train").offsets == {
        "tags": out / "train" / "cat_1.offsets.bin",
        "slots": out / "train" / "cat_2.offsets.bin",
    }

    train_order = sorted(good, key=lambda n: (shuffle_key(4, "train.csv", n), n))
    expected = {
        "train": expected_lists(train, vocabulary, train_order),
        "test": expected_lists(test, vocabulary, list(range(len(test)))),
    }
    assert expected["train"]["slots"][1][1:3] != [0, 0]  # some rows have slots
    for mapping, lists in expected.items():
        files = SplitBinaryFiles.open(spec, mapping)
        assert files.rows == len(lists["tags"][1]) - 1
        for name, (ids, offsets) in lists.items():
            values = np.fromfile(files.categorical[name].path, dtype=features[name].dtype)
            stored = np.fromfile(files.offsets[name].path, dtype=np.int64)
            np.testing.assert_array_equal(stored, offsets, err_msg=f"{mapping}/{name} offsets")
            np.testing.assert_array_equal(values, ids, err_msg=f"{mapping}/{name} ids")
        files.check_ids(spec)
    # The hand-written rows: "news||car" -> [news, 0, car]; "|4|" -> [0, 4, 0].
    row = train_order.index(7)
    ids, offsets = expected["train"]["tags"]
    assert ids[offsets[row] : offsets[row + 1]] == [1, 0, vocabulary["car"]]
    ids, offsets = expected["train"]["slots"]
    assert ids[offsets[row] : offsets[row + 1]] == [0, 4, 0]
    row = train_order.index(8)
    assert offsets[row] == offsets[row + 1]

    tags_report = next(c for c in report["categorical"] if c["name"] == "tags")
    test_ids = expected["test"]["tags"][0]
    assert tags_report["oov_rate"]["test"] == test_ids.count(0) / len(test_ids)
    # The one-value feature: its values through its vocabulary.
    countries = [train[n].split(",")[4] for n in good]
    known = build_vocabulary((c for c in countries if c), THRESHOLD)
    for mapping, lines, order in (("train", train, train_order), ("test", test, range(len(test)))):
        values = [lines[n].split(",")[4] for n in order]
        path = SplitBinaryFiles.open(spec, mapping).categorical["country"].path
        ids = np.fromfile(path, dtype=features["country"].dtype)
        np.testing.assert_array_equal(ids, [known.get(v, 0) for v in values], err_msg=mapping)
    if size != "small":
        return

    # main.py trains on it: the list features pooled by mean, evaluated.
    log = tmp_path / "train.jsonl"
    main_py(
        1, f"--dataset_path={out}", "--batch_size=32", "--embedding_dim=4",
        "--bottom_mlp_dims=8,4", "--top_mlp_dims=8,1", "--pooling=mean", "--max_steps=4",
        f"--log_path={log}", check=True,
    )  # fmt: skip
    summary = read_records(log)[-1]
    assert summary["event"] == "summary" and summary["steps"] == 4
    assert summary["samples"] == len(test) and 0.0 <= summary["auc"] <= 1.0


def test_strict_names_the_bad_list_element(spark: Any, raw_lists: Path, tmp_path: Path) -> None:
    message = (
        r"train\.csv:41: malformed line \(categorical\): field 4 \(slots\), list element 2: "
        r"expected an integer id in \[0, 9\), got '12'\. 3 malformed lines in all"
    )
    with pytest.raises(PreprocessingError, match=message):
        transcode(spark, raw_lists / "spec.yaml", tmp_path / "o", "--strict")
