"""Staged writes: build a file or a directory under a hidden name beside its final
path, then rename it into place, so a reader sees the old output or the complete
new one, and an interrupted writer leaves nothing that looks finished.

The staging name of `<dir>/<name>` is `<dir>/.<name>.partial` (`staging_path`).
A directory that replaces an existing one first moves it aside to
`.<name>.retired` and deletes it once the new one is in place.

Standard library only, so every stage (the sharding planner and the run config
included) can use it without loading TensorFlow.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

PARTIAL_SUFFIX = ".partial"
RETIRED_SUFFIX = ".retired"


def staging_path(target: str | os.PathLike[str]) -> Path:
    """`.<name>.partial` beside `target`: where a staged write of it is built."""
    target = Path(target)
    return target.with_name(f".{target.name}{PARTIAL_SUFFIX}")


def write_file_atomically(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Writes `data` to `path` through `.<name>.partial` beside it (fsynced, then
    renamed into place). Creates the parent directory when missing.

    Args:
        path: the file to write.
        data: its whole content; text is written as UTF-8.

    Returns:
        `path`, as a Path.

    Raises:
        OSError: the file cannot be written; the partial file is removed and a
            previous `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    with staged_file(path) as partial, open(partial, "wb") as out:
        out.write(payload)
        out.flush()
        os.fsync(out.fileno())
    _fsync_directory(path.parent)
    return path


@contextlib.contextmanager
def staged_file(path: str | os.PathLike[str], *, unique: bool = False) -> Iterator[Path]:
    """A hidden path beside file `path` to write it at: renamed to `path` when the
    block completes (replacing it whole), removed when it raises.

    Args:
        path: the file to write.
        unique: name the partial file `.<name>.<random>.partial` instead of
            `.<name>.partial`, for writers of the same file that may run at the same
            time (retried Spark tasks).
    """
    path = Path(path)
    if unique:
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}")
    else:
        partial = staging_path(path)
    try:
        yield partial
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def start_staging(
    output: str | os.PathLike[str], *, overwrite: bool = False, unique: bool = False
) -> Path:
    """Creates a fresh, empty staging directory beside directory `output`.

    Args:
        output: the directory the staged content is published to (`publish`).
        overwrite: allow replacing an `output` that exists and is not empty
            (checked here, before any work; `publish` replaces what it finds).
        unique: name the staging directory `.<name>.<random>.partial` instead of
            `.<name>.partial`, for writers of the same output that may run at the
            same time (retried Spark tasks). A unique one is not cleared by a
            later writer; the caller removes what a killed writer left.

    Returns:
        The staging directory; a stale one of the same name is removed first.

    Raises:
        FileExistsError: `output` exists and is not a directory, or is a
            non-empty directory and `overwrite` is false. Nothing is created.
    """
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise FileExistsError(
            f"{output}: exists and is not a directory; expected a new or empty directory"
        )
    if not overwrite and output.is_dir() and any(output.iterdir()):
        raise FileExistsError(
            f"{output}: output directory exists and is not empty; expected a new or empty "
            f"directory (pass overwrite=True / --overwrite to replace it)"
        )
    if unique:
        staging = output.with_name(f".{output.name}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}")
    else:
        staging = staging_path(output)
        shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: str | os.PathLike[str], output: str | os.PathLike[str]) -> Path:
    """Renames the complete directory `staging` to `output`.

    An existing `output` is first renamed to `staging`'s name with `.retired` for
    `.partial`, then deleted once the new one is in place; if that rename fails,
    the old `output` is put back.

    Returns:
        `output`, as a Path.
    """
    staging, output = Path(staging), Path(output)
    if output.exists() or output.is_symlink():
        retired = staging.with_suffix(RETIRED_SUFFIX)
        _remove(retired)  # left by a writer killed while publishing
        os.replace(output, retired)
        try:
            os.replace(staging, output)
        except BaseException:
            os.replace(retired, output)
            raise
        _remove(retired)
    else:
        os.replace(staging, output)
    _fsync_directory(output.parent)
    return output


@contextlib.contextmanager
def staged_directory(
    output: str | os.PathLike[str], *, overwrite: bool = False, unique: bool = False
) -> Iterator[Path]:
    """A fresh staging directory to fill; published to `output` when the block
    completes, removed (and `output` left as it was) when it raises.

    Usage: `with staged_directory(out, overwrite=True) as staging: write(staging)`.
    The arguments and errors are those of `start_staging`.
    """
    staging = start_staging(output, overwrite=overwrite, unique=unique)
    try:
        yield staging
        publish(staging, output)
    except BaseException:
        _remove(staging)
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    """Makes a rename in `directory` durable. Best effort: some file systems
    refuse to fsync a directory, and the rename itself has already succeeded."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
