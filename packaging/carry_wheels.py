"""Carries wheels to a machine that has no package index and takes files in small
loads (the GPU host: at most 64 MiB of files per command).

Here, on a machine with an index:

    python packaging/carry_wheels.py download --python-version 3.12 \\
        --platform manylinux_2_27_x86_64 --out .cache/carry -- tensorflow-cpu==2.21.0 ...
    python packaging/carry_wheels.py split WHEEL_OR_DIR... --out .cache/carry

write each wheel as numbered chunks of at most --chunk-size (60MB), packed into
loads `load-000/`, `load-001/`, ... of at most that size each, and a `manifest.json`
with every wheel's and every chunk's size and sha256. Send the manifest and this
script, then one load per command. There:

    python3 carry_wheels.py join DIR                  # DIR/wheels/*.whl, each checked
    python3 carry_wheels.py install DIR --target /root/site
    export PYTHONPATH=/root/site

(the chunks in DIR/load-NNN/ or all in DIR). `join` checks every chunk and every
reassembled wheel against the manifest, names each chunk that is missing or
differs, and then writes no wheel; `install` joins and runs `pip install --no-index
--no-deps` on the wheels, all in one pip run (wheels that share a top-level folder,
such as the `nvidia-*` ones, must go into a --target together). Python's standard
library only: the target has no packages yet.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
DEFAULT_CHUNK_SIZE = "60MB"
_BLOCK = 1 << 20
# `split -b`'s units: K, M, G are powers of 1024; KB, MB, GB powers of 1000.
# manifest.json: {"format", "chunk_size", "wheels": [{"name", "size", "sha256",
# "chunks": [{"name", "size", "sha256"}, ...]}, ...]}
Manifest = dict[str, Any]
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


class CarryError(Exception):
    """A wheel, chunk or manifest that is missing or not what the manifest says."""


def parse_size(text: str) -> int:
    """`60MB` (60,000,000 bytes), `60M` (60 MiB), `4096` bytes, as `split -b` reads them."""
    match = re.fullmatch(r"([1-9][0-9]*)([KMG]B?)?", text.strip().upper())
    if match is None:
        raise CarryError(f"--chunk-size: expected a size such as 60MB, 60M or 4096, got {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2) or ""]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _wheels(paths: Iterable[Path]) -> list[Path]:
    """The wheel files named, and those in the folders named, sorted by name."""
    wheels: dict[str, Path] = {}
    for path in paths:
        found = sorted(path.glob("*.whl")) if path.is_dir() else [path]
        if path.is_dir() and not found:
            raise CarryError(f"{path}: a folder with no .whl files")
        for wheel in found:
            if not wheel.is_file() or wheel.suffix != ".whl":
                raise CarryError(f"{wheel}: expected a .whl file")
            if wheel.name in wheels and wheels[wheel.name] != wheel:
                raise CarryError(f"{wheel.name}: named twice ({wheels[wheel.name]}, {wheel})")
            wheels[wheel.name] = wheel
    return [wheels[name] for name in sorted(wheels)]


def split(paths: Sequence[Path], out: Path, chunk_size: int) -> Manifest:
    """Writes every wheel of `paths` as chunks `<wheel>.000`, `.001`, ... of at most
    `chunk_size` bytes, packed into loads `out/load-000/`, ... of at most `chunk_size`
    bytes each (one load per command: the small wheels travel together), and
    `out/manifest.json`; returns the manifest."""
    wheels = _wheels(paths)
    if not wheels:
        raise CarryError("split: no wheels given")
    loads = _plan_loads(wheels, chunk_size)
    entries = [_split_wheel(wheel, out, chunk_size, loads) for wheel in wheels]
    manifest = {"format": FORMAT_VERSION, "chunk_size": chunk_size, "wheels": entries}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _plan_loads(wheels: Sequence[Path], chunk_size: int) -> dict[str, str]:
    """Each chunk's load (chunk name -> `load-NNN`): first fit, largest chunk first."""
    chunks = []
    for wheel in wheels:
        size = wheel.stat().st_size
        if size == 0:
            raise CarryError(f"{wheel}: an empty file")
        for index in range(math.ceil(size / chunk_size)):
            chunk_bytes = min(chunk_size, size - index * chunk_size)
            chunks.append((chunk_bytes, f"{wheel.name}.{index:03d}"))
    room: list[int] = []  # bytes left in each load
    loads = {}
    for chunk_bytes, name in sorted(chunks, key=lambda chunk: -chunk[0]):
        load = next((i for i, left in enumerate(room) if left >= chunk_bytes), len(room))
        if load == len(room):
            room.append(chunk_size)
        room[load] -= chunk_bytes
        loads[name] = f"load-{load:03d}"
    return loads


def _split_wheel(wheel: Path, out: Path, chunk_size: int, loads: dict[str, str]) -> dict[str, Any]:
    """One wheel's chunks, written into their loads (each read whole: `chunk_size`
    bytes of memory), and its manifest entry."""
    whole = hashlib.sha256()
    chunks: list[dict[str, Any]] = []
    with wheel.open("rb") as source:
        while block := source.read(chunk_size):
            name = f"{wheel.name}.{len(chunks):03d}"
            (out / loads[name]).mkdir(parents=True, exist_ok=True)
            (out / loads[name] / name).write_bytes(block)
            whole.update(block)
            chunk = {"name": name, "load": loads[name], "size": len(block)}
            chunks.append({**chunk, "sha256": _digest(block)})
    size = sum(chunk["size"] for chunk in chunks)
    return {"name": wheel.name, "size": size, "sha256": whole.hexdigest(), "chunks": chunks}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST
    if not path.is_file():
        raise CarryError(f"{path}: no manifest (send the manifest.json that split wrote)")
    try:
        manifest: Manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CarryError(f"{path}: not valid JSON ({error})") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CarryError(
            f"{path}: expected format {FORMAT_VERSION}, got {manifest.get('format')!r}"
        )
    return manifest


def chunk_path(folder: Path, chunk: dict[str, Any]) -> Path:
    """Where a chunk is: in its load's folder, as split wrote it, or in `folder`
    itself (the loads' files gathered in one place)."""
    flat: Path = folder / chunk["name"]
    return flat if flat.is_file() else folder / chunk["load"] / chunk["name"]


def check_chunks(folder: Path, manifest: Manifest) -> list[str]:
    """One line per chunk that is missing or differs from the manifest (none: all there)."""
    problems = []
    for wheel in manifest["wheels"]:
        count = len(wheel["chunks"])
        for index, chunk in enumerate(wheel["chunks"]):
            path = chunk_path(folder, chunk)
            where = f"chunk {index + 1} of {count} of {wheel['name']}, in {chunk['load']}"
            if not path.is_file():
                problems.append(f"{path}: missing ({where})")
            elif path.stat().st_size != chunk["size"]:
                problems.append(
                    f"{path}: corrupt ({where}): expected {chunk['size']} bytes, got "
                    f"{path.stat().st_size} (still arriving? send it again)"
                )
            elif (digest := _sha256(path)) != chunk["sha256"]:
                problems.append(
                    f"{path}: corrupt ({where}): expected sha256 {chunk['sha256']}, got "
                    f"{digest} (send it again)"
                )
    return problems


def join(folder: Path, out: Path | None = None) -> list[Path]:
    """Reassembles the wheels of `folder`'s manifest into `out` (default
    `folder/wheels`) after checking every chunk; returns their paths. Raises
    CarryError naming every missing or corrupt chunk, writing no wheel then."""
    manifest = read_manifest(folder)
    problems = check_chunks(folder, manifest)
    if problems:
        raise CarryError(
            f"{folder}: {len(problems)} chunk(s) missing or corrupt, no wheel written:\n  "
            + "\n  ".join(problems)
        )
    out = out if out is not None else folder / "wheels"
    out.mkdir(parents=True, exist_ok=True)
    joined = []
    for wheel in manifest["wheels"]:
        target = out / wheel["name"]
        same_size = target.is_file() and target.stat().st_size == wheel["size"]
        if same_size and _sha256(target) == wheel["sha256"]:
            joined.append(target)  # joined before
            continue
        partial = out / f".{wheel['name']}.partial"
        digest = hashlib.sha256()
        with partial.open("wb") as whole:
            for chunk in wheel["chunks"]:
                with chunk_path(folder, chunk).open("rb") as source:
                    while block := source.read(_BLOCK):
                        whole.write(block)
                        digest.update(block)
        if digest.hexdigest() != wheel["sha256"]:
            partial.unlink()
            raise CarryError(
                f"{wheel['name']}: the joined wheel's sha256 is {digest.hexdigest()}, "
                f"expected {wheel['sha256']} (a chunk changed while joining?)"
            )
        partial.replace(target)
        joined.append(target)
    return joined


def install(
    folder: Path, target: Path | None, python: str = sys.executable, wheels_out: Path | None = None
) -> list[Path]:
    """Joins the wheels of `folder` and installs them with `python`'s pip, from no
    index and without dependencies: into `target` (a folder for PYTHONPATH) or, with
    no target, into `python`'s environment (a venv's python)."""
    wheels = join(folder, wheels_out)
    command = [python, "-m", "pip", "--disable-pip-version-check", "install", "--no-index"]
    command += ["--no-deps", "--quiet"]
    if target is not None:
        # --upgrade: a second run replaces what the first installed there.
        command += ["--upgrade", "--target", str(target)]
    subprocess.run([*command, *map(str, wheels)], check=True)
    return wheels


def download(
    requirements: Sequence[str],
    out: Path,
    python_version: str,
    platforms: Sequence[str],
    with_deps: bool,
    python: str = sys.executable,
) -> None:
    """`pip download`s wheels for another Python and platform into `out`."""
    command = [python, "-m", "pip", "--disable-pip-version-check", "download", "--quiet"]
    command += ["--only-binary=:all:", "--python-version", python_version]
    for platform in platforms:
        for tag in manylinux_tags(platform):
            command += ["--platform", tag]
    command += ["-d", str(out)]
    if not with_deps:
        command.append("--no-deps")
    subprocess.run([*command, *requirements], check=True)


def manylinux_tags(platform: str) -> list[str]:
    """`platform` and, for `manylinux_2_N_ARCH`, every older manylinux tag of ARCH
    (with the legacy names manylinux2014/2010/1), newest first: pip matches
    --platform literally, and a glibc 2.N system runs all of them (libclang, which
    TensorFlow needs, publishes manylinux2010 wheels only)."""
    match = re.fullmatch(r"manylinux_2_([0-9]+)_(\w+)", platform)
    if match is None:
        return [platform]
    newest, arch = int(match.group(1)), match.group(2)
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = []
    for minor in range(newest, 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        if minor in legacy:
            tags.append(f"{legacy[minor]}_{arch}")
    return tags


def _report_split(manifest: Manifest, out: Path) -> None:
    chunks = [chunk for wheel in manifest["wheels"] for chunk in wheel["chunks"]]
    loads = sorted({chunk["load"] for chunk in chunks})
    total = sum(wheel["size"] for wheel in manifest["wheels"])
    print(
        f"[carry] {len(manifest['wheels'])} wheel(s), {total / 1e6:.1f} MB, in {len(chunks)} "
        f"chunk(s) and {len(loads)} load(s) of at most {manifest['chunk_size'] / 1e6:g} MB "
        f"({out}/load-*/), and {out / MANIFEST}: send one load per command"
    )
    for wheel in manifest["wheels"]:
        print(f"  {wheel['name']}: {wheel['size'] / 1e6:.1f} MB, {len(wheel['chunks'])} chunk(s)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="carry_wheels.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    size_help = "largest chunk: 60MB (60,000,000 bytes), 60M (MiB), or bytes; default 60MB"

    split_parser = commands.add_parser("split", help="wheels -> chunks + manifest.json")
    split_parser.add_argument("paths", nargs="+", type=Path, help="wheel files or folders")
    split_parser.add_argument("--out", type=Path, required=True, help="folder for the chunks")
    split_parser.add_argument("--chunk-size", default=DEFAULT_CHUNK_SIZE, help=size_help)

    get = commands.add_parser("download", help="pip download for a target, then split")
    get.add_argument("requirements", nargs="+", help="requirement specifiers, or -r FILE")
    get.add_argument("--out", type=Path, required=True, help="folder for the chunks")
    get.add_argument("--python-version", required=True, help="the target's Python, e.g. 3.12")
    get.add_argument(
        "--platform",
        action="append",
        required=True,
        help="the target's platform, e.g. manylinux_2_27_x86_64 (older manylinux tags "
        "are added: the target runs their wheels too); may be repeated",
    )
    get.add_argument(
        "--with-deps", action="store_true", help="resolve dependencies too (default: only these)"
    )
    get.add_argument("--chunk-size", default=DEFAULT_CHUNK_SIZE, help=size_help)

    join_parser = commands.add_parser("join", help="chunks -> checked wheels")
    join_parser.add_argument("folder", type=Path, help="the chunks and manifest.json")
    join_parser.add_argument("--out", type=Path, help="folder for the wheels (FOLDER/wheels)")

    put = commands.add_parser("install", help="join, then pip install --no-index --no-deps")
    put.add_argument("folder", type=Path, help="the chunks and manifest.json")
    place = put.add_mutually_exclusive_group(required=True)
    place.add_argument("--target", type=Path, help="install into this folder (PYTHONPATH)")
    place.add_argument(
        "--python", help="install into this interpreter's environment (a venv's python)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "split":
            manifest = split(args.paths, args.out, parse_size(args.chunk_size))
            _report_split(manifest, args.out)
        elif args.command == "download":
            size = parse_size(args.chunk_size)
            with tempfile.TemporaryDirectory() as staging:
                download(
                    args.requirements,
                    Path(staging),
                    args.python_version,
                    args.platform,
                    args.with_deps,
                )
                manifest = split([Path(staging)], args.out, size)
            _report_split(manifest, args.out)
        elif args.command == "join":
            for wheel in join(args.folder, args.out):
                print(f"[carry] {wheel}")
        else:
            wheels = install(args.folder, args.target, args.python or sys.executable)
            print(f"[carry] installed {len(wheels)} wheel(s)")
            if args.target is not None:
                site = args.target.resolve()
                print(f'export PYTHONPATH={site}"${{PYTHONPATH:+:$PYTHONPATH}}"')
    except CarryError as error:
        print(f"[carry] error: {error}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as error:
        command = " ".join(map(str, error.cmd[:6]))
        print(f"[carry] error: {command} ... exited {error.returncode}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
