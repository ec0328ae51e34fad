"""Staged writes: a success replaces the output whole, a failure leaves no partial
file or directory and the previous output intact, a non-empty output is refused
without overwrite."""

from __future__ import annotations

import os
import re
from pathlib import Path
from unittest import mock

import pytest

from feature_spec.staged import (
    publish,
    staged_directory,
    staged_file,
    staging_path,
    start_staging,
    write_file_atomically,
)


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_staging_path_is_a_hidden_sibling(tmp_path: Path) -> None:
    assert staging_path(tmp_path / "plan.json") == tmp_path / ".plan.json.partial"
    assert staging_path(str(tmp_path / "step_7")) == tmp_path / ".step_7.partial"


def test_file_is_written_and_replaced(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "config.json"
    assert write_file_atomically(path, "first\n") == path  # creates the parent
    assert path.read_text() == "first\n"
    write_file_atomically(path, b"\x00\xffsecond")
    assert path.read_bytes() == b"\x00\xffsecond"
    write_file_atomically(path, "ünïcode")
    assert path.read_bytes() == "ünïcode".encode()
    assert hidden(path.parent) == []


def test_failed_file_write_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "plan.json"
    path.write_text("old")
    monkeypatch.setattr(os, "fsync", mock.Mock(side_effect=OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space left"):
        write_file_atomically(path, "new")
    assert path.read_text() == "old"
    assert hidden(tmp_path) == []


def test_file_write_over_a_directory_fails_cleanly(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(IsADirectoryError):
        write_file_atomically(tmp_path / "taken", "x")
    assert hidden(tmp_path) == []


def test_directory_is_published_and_replaced(tmp_path: Path) -> None:
    output = tmp_path / "dataset"
    with staged_directory(output) as staging:
        assert staging == tmp_path / ".dataset.partial" and not output.exists()
        (staging / "label.bin").write_bytes(b"\1\0")
    assert (output / "label.bin").read_bytes() == b"\1\0"
    with staged_directory(output, overwrite=True) as staging:
        (staging / "cat_0.bin").write_bytes(b"\7")
    assert sorted(p.name for p in output.iterdir()) == ["cat_0.bin"]  # replaced whole
    assert hidden(tmp_path) == []


def test_failure_inside_the_block_keeps_the_old_directory(tmp_path: Path) -> None:
    output = tmp_path / "saved_model"
    output.mkdir()
    (output / "saved_model.pb").write_text("old")
    with (
        pytest.raises(RuntimeError, match="boom"),
        staged_directory(output, overwrite=True) as staging,
    ):
        (staging / "saved_model.pb").write_text("half")
        raise RuntimeError("boom")
    assert (output / "saved_model.pb").read_text() == "old"
    assert hidden(tmp_path) == []


def test_non_empty_output_is_refused_without_overwrite(tmp_path: Path) -> None:
    output = tmp_path / "data"
    output.mkdir()
    (output / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=rf"{re.escape(str(output))}: .*not empty"):
        start_staging(output)
    with pytest.raises(FileExistsError, match="not empty"), staged_directory(output):
        pytest.fail("the block must not run")
    assert (output / "mine.txt").read_text() == "keep me"
    assert hidden(tmp_path) == []
    with staged_directory(tmp_path / "empty_ok"):
        pass
    (tmp_path / "empty").mkdir()
    with staged_directory(tmp_path / "empty") as staging:  # an empty one is fine
        (staging / "a").write_text("a")
    assert (tmp_path / "empty" / "a").is_file()


def test_a_file_in_the_way_is_refused_even_with_overwrite(tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.write_text("not a directory")
    message = rf"{re.escape(str(output))}: exists and is not a directory"
    with pytest.raises(FileExistsError, match=message):
        start_staging(output, overwrite=True)
    assert output.read_text() == "not a directory"
    assert hidden(tmp_path) == []


def test_stale_staging_is_cleared_and_unique_staging_is_separate(tmp_path: Path) -> None:
    output = tmp_path / "step_3"
    stale = staging_path(output)
    stale.mkdir()
    (stale / "half.npy").write_bytes(b"?")
    assert start_staging(output) == stale and not any(stale.iterdir())
    first = start_staging(output, unique=True)
    second = start_staging(output, unique=True)
    assert len({first, second, stale}) == 3
    assert first.name.startswith(".step_3.") and first.name.endswith(".partial")
    (first / "a").write_text("first")
    (second / "a").write_text("second")
    publish(first, output)
    publish(second, output)  # the later attempt replaces the earlier one whole
    assert (output / "a").read_text() == "second"
    assert hidden(tmp_path) == [stale.name]


def test_publish_puts_the_old_output_back_when_the_rename_fails(tmp_path: Path) -> None:
    output = tmp_path / "step_5"
    output.mkdir()
    (output / "manifest.json").write_text("old")
    staging = staging_path(output)  # never created: the rename into place fails
    with pytest.raises(FileNotFoundError):
        publish(staging, output)
    assert (output / "manifest.json").read_text() == "old"
    assert hidden(tmp_path) == []


def test_unique_staged_files_are_hidden_apart_and_replace_the_file(tmp_path: Path) -> None:
    target = tmp_path / "part-00001.parquet"
    target.write_text("first attempt")
    with staged_file(target, unique=True) as one, staged_file(target, unique=True) as two:
        assert one != two and one.parent == two.parent == tmp_path
        assert re.fullmatch(r"\.part-00001\.parquet\.[0-9a-f]{32}\.partial", one.name)
        one.write_text("second attempt")
        two.write_text("third attempt")
    assert target.read_text() == "second attempt"  # the outer block completes last
    assert hidden(tmp_path) == []
    with pytest.raises(OSError, match="disk full"), staged_file(target, unique=True) as failed:
        failed.write_text("half")
        raise OSError("disk full")
    assert target.read_text() == "second attempt" and hidden(tmp_path) == []
