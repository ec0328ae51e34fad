"""A checkpoint's steps run on every rank and fail on every rank together: one
collective per step carries every rank's outcome, so a rank that fails (a full
disk, a corrupted file) stops the others at once instead of leaving them waiting."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dlrm.checkpoint.format import CheckpointError
from dlrm.distributed.agreement import failures_on_any_rank
from dlrm.distributed.collectives import Collectives


def attempt(action: Callable[[], None]) -> Exception | None:
    """Runs `action`; returns what it raised, to be shared with the other ranks
    (any exception: a rank must never leave its peers waiting)."""
    try:
        action()
    except Exception as error:  # reported to every rank, then raised
        return error
    return None


def rank_failure(
    what: str, failed: Sequence[tuple[int, str]], own: BaseException | None
) -> CheckpointError:
    (rank, message), *others = failed
    also = "".join(f"; on rank {r}: {m}" for r, m in others)
    error = CheckpointError(f"{what} failed on rank {rank}: {message}{also}")
    error.__cause__ = own
    error.same_on_every_rank = True  # `failed` is one allgather's (dlrm.launch)
    return error


def on_every_rank(
    collectives: Collectives, what: str, name: str, action: Callable[[], None]
) -> None:
    """Runs `action` on every rank; raises `CheckpointError` on every rank if it
    failed on any (one collective, reached by every rank)."""
    error = attempt(action)
    failed = failures_on_any_rank(collectives, error, name)
    if failed:
        raise rank_failure(what, failed, error)


def restore_on_every_rank(collectives: Collectives, path: str, restore: Callable[[], Any]) -> Any:
    """Runs `restore` (open, check and load a checkpoint) on every rank; if it
    fails on any rank, every rank raises `CheckpointError` naming that rank and
    its error, instead of the others waiting for it in their first step."""
    result: list[Any] = []
    on_every_rank(collectives, f"restoring {path}", "restore", lambda: result.append(restore()))
    return result[0]
