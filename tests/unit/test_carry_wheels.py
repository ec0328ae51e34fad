"""packaging/carry_wheels.py's split and join on small wheels made here, split at a
few KB: chunks no larger than asked, every size and sha256 in the manifest, the
joined wheels byte for byte the originals, and a missing, truncated or changed chunk
named in the error, with no wheel written. (Installing what was joined, with pip and
no index: tests/integration/test_carry_wheels.py.)"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from harness.wheels import carry_wheels, corrupt, make_wheel

CHUNK = 4096


@pytest.fixture
def wheels(tmp_path: Path) -> list[Path]:
    folder = tmp_path / "downloads"
    folder.mkdir()
    return [make_wheel(folder, "tinycarry", 10_000), make_wheel(folder, "tinyother", 1_000)]


def test_split_writes_chunks_no_larger_than_asked_with_their_checksums(
    wheels: list[Path], tmp_path: Path
) -> None:
    out = tmp_path / "carry"
    manifest = carry_wheels.split([wheels[0].parent], out, CHUNK)  # a folder of wheels
    assert manifest == json.loads((out / "manifest.json").read_text())
    assert manifest["chunk_size"] == CHUNK
    assert [entry["name"] for entry in manifest["wheels"]] == sorted(w.name for w in wheels)
    for wheel in wheels:
        (entry,) = (e for e in manifest["wheels"] if e["name"] == wheel.name)
        data = wheel.read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert len(entry["chunks"]) == math.ceil(len(data) / CHUNK)
        paths = [out / chunk["load"] / chunk["name"] for chunk in entry["chunks"]]
        assert b"".join(path.read_bytes() for path in paths) == data
        for chunk in entry["chunks"]:
            chunk_data = (out / chunk["load"] / chunk["name"]).read_bytes()
            assert len(chunk_data) == chunk["size"] <= CHUNK
            assert chunk["sha256"] == hashlib.sha256(chunk_data).hexdigest()
    assert len(manifest["wheels"][0]["chunks"]) >= 3  # the larger wheel spans chunks


def test_the_chunks_are_packed_into_loads_of_at_most_the_chunk_size(tmp_path: Path) -> None:
    """One load per command: small wheels travel together, or with a last chunk."""
    wheels = [make_wheel(tmp_path, "tinycarry", 10_000)]
    wheels += [make_wheel(tmp_path, f"tiny{i}", 50) for i in range(3)]
    out = tmp_path / "carry"
    manifest = carry_wheels.split(wheels, out, CHUNK)
    chunks = [chunk for wheel in manifest["wheels"] for chunk in wheel["chunks"]]
    loads = sorted(path.name for path in out.iterdir() if path.is_dir())
    assert loads == sorted({chunk["load"] for chunk in chunks})
    assert loads[0] == "load-000"
    for load in loads:
        assert sum(path.stat().st_size for path in (out / load).iterdir()) <= CHUNK
    assert len(loads) < len(chunks) == 6


def test_join_gives_back_the_wheels(wheels: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "carry"
    carry_wheels.split(wheels, out, CHUNK)
    joined = carry_wheels.join(out)
    assert [path.name for path in joined] == sorted(w.name for w in wheels)
    for wheel in wheels:
        assert (out / "wheels" / wheel.name).read_bytes() == wheel.read_bytes()
    assert carry_wheels.join(out) == joined  # again: the joined wheels are kept
    assert not list((out / "wheels").glob(".*partial"))


def test_join_finds_the_chunks_gathered_in_one_folder(wheels: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "carry"
    carry_wheels.split(wheels, out, CHUNK)
    gathered = tmp_path / "gathered"
    gathered.mkdir()
    (out / "manifest.json").rename(gathered / "manifest.json")
    for chunk in out.glob("load-*/*"):
        chunk.rename(gathered / chunk.name)
    joined = carry_wheels.join(gathered)
    assert [path.read_bytes() for path in joined] == [w.read_bytes() for w in sorted(wheels)]


def test_a_wheel_that_ends_on_a_chunk_boundary_has_no_empty_chunk(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, "tinycarry", 5_000)
    size = wheel.stat().st_size
    manifest = carry_wheels.split([wheel], tmp_path / "carry", size)
    assert [chunk["size"] for chunk in manifest["wheels"][0]["chunks"]] == [size]
    assert carry_wheels.join(tmp_path / "carry")[0].read_bytes() == wheel.read_bytes()


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("missing", r"missing \(chunk 2 of 3 of tinycarry-1\.0-py3-none-any\.whl, in load-0"),
        ("truncated", r"corrupt \(chunk 2 of 3 of tinycarry.*\): expected 4096 bytes, got 4086"),
        ("changed", r"corrupt \(chunk 2 of 3 of tinycarry.*\): expected sha256 [0-9a-f]{64}, got"),
    ],
)
def test_a_bad_chunk_is_named_and_no_wheel_is_written(
    wheels: list[Path], tmp_path: Path, how: str, says: str
) -> None:
    out = tmp_path / "carry"
    carry_wheels.split(wheels, out, CHUNK)
    name = corrupt(out, how)
    with pytest.raises(carry_wheels.CarryError, match=f"{out / name}: {says}") as error:
        carry_wheels.join(out)
    assert str(error.value).startswith(f"{out}: 1 chunk(s) missing or corrupt, no wheel written")
    assert not (out / "wheels").exists()


def test_every_bad_chunk_is_listed_at_once(wheels: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "carry"
    manifest = carry_wheels.split(wheels, out, CHUNK)
    for entry in manifest["wheels"]:
        (out / entry["chunks"][-1]["load"] / entry["chunks"][-1]["name"]).unlink()
    with pytest.raises(carry_wheels.CarryError, match="2 chunk") as error:
        carry_wheels.join(out)
    for entry in manifest["wheels"]:
        assert entry["chunks"][-1]["name"] in str(error.value)


def test_the_command_line_reports_errors_in_one_line_and_exits_1(
    wheels: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "carry"
    split = ["split", "--out", str(out)]
    assert carry_wheels.main([*split, *map(str, wheels), "--chunk-size", "4K"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("[carry] 2 wheel(s), ") and "of at most 0.004096 MB" in printed
    assert carry_wheels.main(["join", str(out)]) == 0
    corrupt(out, "missing")
    (out / "wheels").rename(tmp_path / "joined-before")
    assert carry_wheels.main(["join", str(out)]) == 1
    assert capsys.readouterr().err.startswith(f"[carry] error: {out}: 1 chunk(s) missing")
    assert carry_wheels.main(["join", str(tmp_path)]) == 1
    assert "no manifest" in capsys.readouterr().err
    assert carry_wheels.main([*split, str(wheels[0]), "--chunk-size", "lots"]) == 1
    assert "--chunk-size: expected a size such as 60MB" in capsys.readouterr().err


def test_chunk_sizes_read_as_split_reads_them() -> None:
    assert carry_wheels.parse_size("60MB") == 60_000_000
    assert carry_wheels.parse_size("60M") == 60 * 2**20
    assert carry_wheels.parse_size("4k") == 4096
    assert carry_wheels.parse_size("4096") == 4096
    # The default leaves room under the GPU host's 64 MiB per command.
    assert carry_wheels.parse_size(carry_wheels.DEFAULT_CHUNK_SIZE) <= 60_000_000
    with pytest.raises(carry_wheels.CarryError, match="--chunk-size"):
        carry_wheels.parse_size("0")


def test_download_asks_for_every_older_manylinux_tag_too() -> None:
    # pip matches --platform literally; TensorFlow's libclang has manylinux2010 wheels only.
    tags = carry_wheels.manylinux_tags("manylinux_2_27_x86_64")
    assert tags[:2] == ["manylinux_2_27_x86_64", "manylinux_2_26_x86_64"]
    for legacy in ("manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"):
        assert legacy in tags
    assert tags[-1] == "manylinux1_x86_64" and len(tags) == len(set(tags)) == 23 + 3
    assert carry_wheels.manylinux_tags("macosx_11_0_arm64") == ["macosx_11_0_arm64"]
