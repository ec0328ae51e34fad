"""Vocabularies carried from one preprocessing run to the next (`--vocabulary_from`)
and OOV buckets (`--oov_buckets`), on hand-written files whose ids are known.

Day A is preprocessed, then day B with A's vocabulary: every id A gave means the
same value in B, the values new in B that pass the threshold get ids after A's
cardinality. One Spark session (local[2]) serves the module; `preproc.transcode`'s
flags build every run.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from feature_spec import FeatureSpec
from feature_spec.vocabulary import VocabularyLineage
from harness.preproc_reference import build_vocabulary, read_mapping
from harness.spark import spark_fixture
from preproc.errors import PreprocessingError
from preproc.pipeline import run_pipeline
from preproc.report import format_report
from preproc.transcode import build_parser, transcode_config

THRESHOLD = 2
SLOTS = 5
# Columns: click, price, color (text), tags (a list of text), slot (an id < SLOTS).
SPEC = {
    "feature_spec": {
        "click": {"dtype": "bool"},
        "price": {"dtype": "float16"},
        "color": {"dtype": "int32", "cardinality": "auto"},
        "tags": {"dtype": "int32", "cardinality": "auto", "hotness": "variable"},
        "slot": {"dtype": "int8", "cardinality": SLOTS},
    },
    "channel_spec": {
        "label": ["click"], "numerical": ["price"], "categorical": ["color", "tags", "slot"]
    },
}  # fmt: skip
# Day A's train: color red 4, blue 3, green 2, pink 1 (rare); tags x 3, y 2, z 1 (rare).
A_TRAIN = [
    "1,1.0,red,x|y,0", "0,2.0,red,x,1", "0,3.0,red,x|z,2", "1,4.0,red,y,3",
    "0,5.0,blue,,4", "0,6.0,blue,,0", "1,7.0,blue,,1",
    "0,8.0,green,,2", "0,9.0,green,,3", "1,1.5,pink,,4", "0,2.5,,,0",
]  # fmt: skip
A_TEST = ["1,1.0,red,x,0", "0,1.0,pink,z,1", "0,1.0,black,q,2"]
# Day B's train: red 1 (kept: it has an id), blue 0, green 2, pink 2 (passes now),
# cyan 3 and violet 3 (new), teal 1 (rare); tags y 2, z 2 (passes now), w 4 (new).
B_TRAIN = [
    "0,1,green,w|y,0", "1,1,green,w,1", "0,1,pink,w|z,2", "0,1,pink,w|z,3",
    "1,1,cyan,y,4", "0,1,cyan,,0", "0,1,cyan,,1",
    "1,1,violet,,2", "0,1,violet,,3", "0,1,violet,,4",
    "0,1,red,,0", "0,1,teal,,1",
]  # fmt: skip
B_TEST = ["1,1,red,x|w,0", "0,1,blue,y,1", "0,1,cyan,z,2", "0,1,teal,q,3", "0,1,pink,,4", "0,1,,,0"]
A_IDS = {"color": {"red": 1, "blue": 2, "green": 3}, "tags": {"x": 1, "y": 2}}
# After A's ids (cardinalities 4 and 3): by descending count in B, then by value.
B_IDS = {
    "color": {**A_IDS["color"], "cyan": 4, "violet": 5, "pink": 6},
    "tags": {**A_IDS["tags"], "w": 3, "z": 4},
}
VOCABULARY_FEATURES = ("color", "tags")


spark = spark_fixture(shuffle_partitions=3)


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("days")
    files = {"a_train": A_TRAIN, "a_test": A_TEST, "b_train": B_TRAIN, "b_test": B_TEST}
    for name, lines in files.items():
        (out / f"{name}.csv").write_text("\n".join(lines) + "\n")
    (out / "spec.yaml").write_text(yaml.safe_dump(SPEC, sort_keys=False))
    return out


def preprocess(spark: Any, raw: Path, day: str, out: Path, *flags: str) -> dict[str, Any]:
    args = build_parser().parse_args(
        [
            "--feature_spec", str(raw / "spec.yaml"), "--output_dir", str(out),
            "--input", f"train={raw / f'{day}_train.csv'}", f"test={raw / f'{day}_test.csv'}",
            "--frequency_threshold", str(THRESHOLD), "--no_shuffle", *flags,
        ]
    )  # fmt: skip
    return run_pipeline(transcode_config(args), spark, console=lambda line: None)


def read_vocabularies(dataset: Path) -> dict[int, dict[str, tuple[int, int]]]:
    """Per feature index: value -> (id, count), from `<dataset>/vocabulary/`."""
    out: dict[int, dict[str, tuple[int, int]]] = {}
    for directory in sorted((dataset / "vocabulary").glob("_feature=*")):
        files = [f for f in sorted(directory.glob("*.parquet")) if not f.name.startswith(".")]
        table = pa.concat_tables([pq.read_table(f) for f in files])
        rows = zip(*(table[c].to_pylist() for c in ("_value", "_id", "_count")), strict=True)
        out[int(directory.name.split("=")[1])] = {v: (i, c) for v, i, c in rows}
    return out


def ids_of(vocabularies: dict[int, dict[str, tuple[int, int]]], feature: int) -> dict[str, int]:
    return {value: id_ for value, (id_, _) in vocabularies.get(feature, {}).items()}


def bucket(value: str, buckets: int) -> int:
    """The documented OOV bucket: 1 + (60 bits of sha256 of the value) mod K."""
    return 1 + int(hashlib.sha256(value.encode()).hexdigest()[:15], 16) % buckets


def expected_ids(
    lines: Sequence[str], vocabularies: dict[str, dict[str, int]], buckets: int = 0
) -> dict[str, list[int]]:
    """The ids the files of a split (input order) hold: color, tags (flattened), slot."""

    def id_of(value: str, feature: str) -> int:
        if not value:
            return 0
        known = vocabularies[feature].get(value)
        return known if known is not None else (bucket(value, buckets) if buckets else 0)

    out: dict[str, list[int]] = {"color": [], "tags": [], "slot": []}
    for line in lines:
        _, _, color, tags, slot = line.split(",")
        out["color"].append(id_of(color, "color"))
        out["tags"] += [id_of(tag, "tags") for tag in tags.split("|") if tags]
        out["slot"].append(int(slot))
    return out


def read_ids(dataset: Path, mapping: str) -> dict[str, list[int]]:
    """The ids the files of a split hold, keyed as `expected_ids`."""
    arrays = read_mapping(dataset, mapping)
    return {name: arrays[f"cat_{i}"].tolist() for i, name in enumerate(("color", "tags", "slot"))}


def lineage(dataset: Path) -> VocabularyLineage:
    found = VocabularyLineage.from_metadata(FeatureSpec.load(dataset).metadata)
    assert found is not None
    return found


# ------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def carried(spark: Any, raw: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Day A, then day B with A's vocabulary."""
    base = tmp_path_factory.mktemp("carried")
    a_report = preprocess(spark, raw, "a", base / "a")
    b_report = preprocess(spark, raw, "b", base / "b", "--vocabulary_from", str(base / "a"))
    return {"a": base / "a", "b": base / "b", "a_report": a_report, "b_report": b_report}


def test_the_model_of_the_files(raw: Path) -> None:
    """The ids written below are those of the documented rules (guards the constants)."""
    colors = [line.split(",")[2] for line in A_TRAIN]
    assert build_vocabulary((c or None for c in colors), THRESHOLD) == A_IDS["color"]


def test_every_dataset_keeps_its_vocabulary(carried: dict[str, Any]) -> None:
    a = carried["a"]
    assert not (a / "_work").exists()
    vocabularies = read_vocabularies(a)
    assert sorted(vocabularies) == [0, 1]  # slot holds ids: no vocabulary
    assert ids_of(vocabularies, 0) == A_IDS["color"] and ids_of(vocabularies, 1) == A_IDS["tags"]
    assert vocabularies[0]["red"] == (1, 4)
    found = lineage(a)
    assert len(found.id) == 16 and int(found.id, 16) >= 0
    assert found.extends == () and found.directory == "vocabulary" and found.oov_buckets == 0
    spec = FeatureSpec.load(a)
    assert spec.cardinalities == (4, 3, SLOTS)
    kinds = spec.metadata["preprocessing"]["categorical_kinds"]
    assert kinds == {"color": "token", "tags": "token", "slot": "id"}
    assert read_ids(a, "test") == expected_ids(A_TEST, A_IDS)
    assert carried["a_report"]["vocabulary_from"] is None
    assert all(c["previous_cardinality"] is None for c in carried["a_report"]["categorical"])


def test_a_carried_vocabulary_keeps_every_id_and_appends_new_ones(carried: dict[str, Any]) -> None:
    a, b = carried["a"], carried["b"]
    old, new = read_vocabularies(a), read_vocabularies(b)
    # (a) every value with an id in A has the same id in B, also one not seen in B.
    for feature in (0, 1):
        for value, (id_, _) in old[feature].items():
            assert new[feature][value][0] == id_, (feature, value)
    assert new[0]["blue"] == (2, 0)  # counts are B's: blue is not in B's train
    # (b) new ids from A's cardinality on, by descending count in B, then value;
    # (c) pink was rare in A and passes in B: it gets a new id.
    assert {f: ids_of(new, i) for i, f in enumerate(VOCABULARY_FEATURES)} == B_IDS
    assert "pink" not in old[0] and new[0]["pink"] == (6, 2)
    assert "teal" not in new[0]  # rare in B
    # (d) cardinalities grow; the lineage names A.
    a_spec, b_spec = FeatureSpec.load(a), FeatureSpec.load(b)
    assert a_spec.cardinalities == (4, 3, SLOTS) and b_spec.cardinalities == (7, 5, SLOTS)
    assert lineage(b).extends == (lineage(a).id, *lineage(a).extends)
    assert lineage(b).id != lineage(a).id and lineage(b).descends_from(lineage(a).id)
    # The binary files: a row of values A knew decodes to A's ids.
    b_test = read_ids(b, "test")
    assert b_test == expected_ids(B_TEST, B_IDS)
    assert b_test["color"][0] == read_ids(a, "test")["color"][0] == A_IDS["color"]["red"]
    assert read_ids(b, "train") == expected_ids(B_TRAIN, B_IDS)


def test_the_report_shows_old_and_new_cardinalities(carried: dict[str, Any]) -> None:
    report = carried["b_report"]
    assert report["vocabulary_from"] == str(carried["a"])
    assert report["vocabulary"] == lineage(carried["b"]).to_metadata()
    features = {c["name"]: c for c in report["categorical"]}
    assert [features[n]["previous_cardinality"] for n in ("color", "tags", "slot")] == [4, 3, 5]
    assert [features[n]["cardinality"] for n in ("color", "tags", "slot")] == [7, 5, 5]
    # Of B's test ids: color cyan (4), pink (6) of 6 rows; tags w (3), z (4) of 5 ids.
    assert features["color"]["new_id_rate"]["test"] == pytest.approx(2 / 6)
    assert features["tags"]["new_id_rate"]["test"] == pytest.approx(2 / 5)
    assert features["slot"]["new_id_rate"]["test"] == 0.0
    assert features["color"]["oov_rate"]["test"] == pytest.approx(2 / 6)  # teal, missing
    text = format_report(report)
    assert "old cardinality" in text and "new test" in text
    row = next(line for line in text.splitlines() if line.startswith("color "))
    assert row.split()[3:6] == ["6", "4", "7"]  # distinct in B's train, old, new
    assert row.split()[-1] == "33.33%"
    assert f"carries {carried['a']}" in text


def test_a_vocabulary_that_does_not_fit_is_refused(
    spark: Any, raw: Path, carried: dict[str, Any], tmp_path: Path
) -> None:
    a = carried["a"]

    def edited(name: str, edit: Any) -> Path:
        copy = tmp_path / name
        shutil.copytree(a, copy, ignore=shutil.ignore_patterns("train", "test"))
        spec = yaml.safe_load((copy / "feature_spec.yaml").read_text())
        edit(spec)
        (copy / "feature_spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        return copy

    def rename(spec: dict[str, Any]) -> None:
        spec["feature_spec"]["colour"] = spec["feature_spec"].pop("color")
        spec["channel_spec"]["categorical"][0] = "colour"
        for chunks in spec["source_spec"].values():
            for chunk in chunks:
                chunk["features"] = ["colour" if f == "color" else f for f in chunk["features"]]

    def retype(spec: dict[str, Any]) -> None:
        spec["metadata"]["preprocessing"]["categorical_kinds"]["color"] = "hex"

    cases = [
        (tmp_path / "nowhere", (), r"--vocabulary_from \S*nowhere: .*got no feature_spec.yaml"),
        (
            edited("no_lineage", lambda spec: spec["metadata"].pop("vocabulary")),
            (),
            r"--vocabulary_from \S*no_lineage: feature_spec.yaml has no metadata.vocabulary",
        ),
        (
            edited("renamed", rename),
            (),
            r"--vocabulary_from \S*renamed: channel_spec.categorical\[0\]: expected 'color', "
            r"got 'colour'",
        ),
        (
            edited("retyped", retype),
            (),
            r"--vocabulary_from \S*retyped: feature 'color': expected kind 'token' .*got 'hex'",
        ),
        (
            a,
            ("--oov_buckets", "2"),
            r"--oov_buckets: expected 0, the OOV buckets of --vocabulary_from \S*/a .*got 2",
        ),
    ]
    for parent, flags, message in cases:
        out = tmp_path / f"from_{parent.name}"
        with pytest.raises(PreprocessingError, match=message):
            preprocess(spark, raw, "b", out, "--vocabulary_from", str(parent), *flags)
        assert not out.exists()  # refused before anything was written


@pytest.fixture(scope="module")
def bucketed(spark: Any, raw: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Day A with 3 OOV buckets, twice; day B with the first's vocabulary."""
    base = tmp_path_factory.mktemp("buckets")
    for name in ("a", "a_again"):
        preprocess(spark, raw, "a", base / name, "--oov_buckets", "3")
    preprocess(
        spark, raw, "b", base / "b", "--oov_buckets", "3", "--vocabulary_from", str(base / "a")
    )
    return {name: base / name for name in ("a", "a_again", "b")}


def test_oov_buckets_hold_rare_and_unseen_values(bucketed: dict[str, Path]) -> None:
    a, again, b = bucketed["a"], bucketed["a_again"], bucketed["b"]
    k = 3
    # Kept values from K + 1 on; rare and unseen ones by their hash in 1..K.
    a_ids = {f: {v: i + k for v, i in A_IDS[f].items()} for f in VOCABULARY_FEATURES}
    assert {f: ids_of(read_vocabularies(a), i) for i, f in enumerate(VOCABULARY_FEATURES)} == a_ids
    assert FeatureSpec.load(a).cardinalities == (1 + k + 3, 1 + k + 2, SLOTS)
    assert lineage(a).oov_buckets == k == lineage(b).oov_buckets
    assert read_ids(a, "test") == expected_ids(A_TEST, a_ids, k)
    assert read_ids(a, "train") == expected_ids(A_TRAIN, a_ids, k)
    buckets = {bucket(v, k) for v in ("pink", "black", "z", "q", "teal")}
    assert buckets <= {1, 2, 3} and len(buckets) > 1
    # The same in a second run (the same vocabulary id too) ...
    assert lineage(again).id == lineage(a).id
    for path in sorted(a.rglob("*.bin")):
        assert path.read_bytes() == (again / path.relative_to(a)).read_bytes(), path
    # ... and through the carried vocabulary: pink passes in B (new id after A's 7),
    # teal is rare in B and q unseen: their buckets.
    b_ids = {
        "color": {**a_ids["color"], "cyan": 7, "violet": 8, "pink": 9},
        "tags": {**a_ids["tags"], "w": 6, "z": 7},
    }
    assert read_ids(b, "test") == expected_ids(B_TEST, b_ids, k)
    assert read_ids(b, "test")["color"][3] == bucket("teal", k)
    assert FeatureSpec.load(b).cardinalities == (10, 8, SLOTS)


def test_the_spark_paths_give_the_same_vocabulary_and_ids(
    spark: Any,
    raw: Path,
    bucketed: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The vocabulary summed and numbered by Spark (with the parent's ids joined in),
    and the ids found by a Spark join (OOV buckets by Spark's sha2), equal the
    driver's vocabulary and the writers' lookup."""
    monkeypatch.setattr("preproc.vocabulary.DRIVER_COUNT_ROWS", 0)
    monkeypatch.setattr("preproc.encode.WRITER_VOCABULARY_IDS", 0)
    monkeypatch.setattr("preproc.encode.BROADCAST_VOCABULARY_IDS", 0)
    out = tmp_path / "b_spark"
    flags = ("--oov_buckets", "3", "--vocabulary_from", str(bucketed["a"]))
    preprocess(spark, raw, "b", out, *flags)
    driver = bucketed["b"]
    assert read_vocabularies(out) == read_vocabularies(driver)
    assert lineage(out) == lineage(driver)
    for path in sorted(driver.rglob("*.bin")):
        assert path.read_bytes() == (out / path.relative_to(driver)).read_bytes(), path
