"""What every rank must hold alike, checked with one allgather, and failures
shared so that a rank's error stops every rank at once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dlrm.distributed.collectives import Collectives


class RankMismatchError(RuntimeError):
    """Ranks hold different plans, tables or settings, or one rank failed a step
    that every rank must finish (a checkpoint write, a restore)."""

    # Found from one allgather, the same on every rank (dlrm.launch.same_on_every_rank).
    same_on_every_rank = True


def check_ranks_agree(collectives: Collectives, facts: Mapping[str, Any]) -> None:
    """One allgather of every rank's `facts` (the plan, table shapes, model and
    optimizer settings); raises `RankMismatchError` on every rank, naming the
    first rank that differs from rank 0 and where, before anything is assembled
    from mismatched pieces."""
    everyone = collectives.allgather_object(dict(facts), name="check_ranks_agree")
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        difference = first_difference(reference, theirs)
        if difference is not None:
            path, ours, other = difference
            raise RankMismatchError(
                f"the ranks disagree before training: rank {rank} differs from rank 0 in "
                f"{path} (rank 0: {_short(ours)}, rank {rank}: {_short(other)}). Every rank "
                f"must see the same FeatureSpec, --sharding_plan file and model, optimizer "
                f"and batch flags"
            )


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """(key path, a's value, b's value) of the first place where `a` and `b`
    differ, or None. Dicts compare key by key, lists item by item."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                return where, a.get(key, "<missing>"), b.get(key, "<missing>")
            found = first_difference(a[key], b[key], where)
            if found is not None:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path} (length)", len(a), len(b)
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    return None if a == b else (path, a, b)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def failures_on_any_rank(
    collectives: Collectives, error: BaseException | None, name: str
) -> list[tuple[int, str]]:
    """(rank, message) of every rank whose `error` is not None, the same list on
    every rank: one allgather, which every rank reaches whether its own part
    succeeded or not, so a failure on one rank stops all of them at once
    instead of leaving the others waiting in their next collective."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    everyone = collectives.allgather_object(message, name=name)
    return [(rank, text) for rank, text in enumerate(everyone) if text is not None]
