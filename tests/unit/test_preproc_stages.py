"""Resumable stages: publish with a marker, skip when finished, nothing published
when a stage fails, stale outputs replaced, foreign directories left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from preproc.errors import PreprocessingError
from preproc.stages import SUCCESS, Stage, file_identity, fingerprint, read_marker


def test_fingerprint_is_stable_and_order_free() -> None:
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


def test_publish_then_skip(tmp_path: Path) -> None:
    stage = Stage("vocabulary", tmp_path / "work" / "vocabulary", fingerprint({"x": 1}))
    assert stage.finished() is None

    def body(staging: Path) -> dict[str, int]:
        assert staging.name == ".vocabulary.partial" and not stage.directory.exists()
        (staging / "data.bin").write_bytes(b"123")
        return {"rows": 3}

    marker = stage.run(body)
    assert marker.summary == {"rows": 3}
    assert (stage.directory / "data.bin").read_bytes() == b"123"
    assert stage.finished() == read_marker(stage.directory) == marker
    assert not list(stage.directory.parent.glob(".*partial"))


def test_a_failing_stage_publishes_nothing(tmp_path: Path) -> None:
    stage = Stage("train", tmp_path / "train", "f1")

    def body(staging: Path) -> dict[str, int]:
        (staging / "label.bin").write_bytes(b"\1")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        stage.run(body)
    assert not stage.directory.exists()
    assert not (tmp_path / ".train.partial" / SUCCESS).exists()
    stage.run(lambda staging: {})  # the next run clears the partial directory
    assert stage.finished() is not None and not (tmp_path / ".train.partial").exists()


def test_stale_outputs_are_replaced_and_foreign_ones_kept(tmp_path: Path) -> None:
    old = Stage("train", tmp_path / "train", "old")
    old.run(lambda staging: {})
    new = Stage("train", tmp_path / "train", "new")
    assert new.finished() is None
    assert new.remove_if_stale() and not new.directory.exists()
    assert not new.remove_if_stale()
    foreign = tmp_path / "test"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    with pytest.raises(PreprocessingError, match="has no _SUCCESS marker"):
        Stage("test", foreign, "f").remove_if_stale()
    assert (foreign / "mine.txt").read_text() == "keep me"


def test_file_identity_names_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "day_0").write_text("1\n")
    assert file_identity(tmp_path / "day_0")["bytes"] == 2
    with pytest.raises(PreprocessingError, match="day_1: cannot read input file"):
        file_identity(tmp_path / "day_1")
