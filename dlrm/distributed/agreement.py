"""What every rank must hold alike, checked with one allgather, and failures
shared so that a rank's error stops every rank at once."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from dlrm.distributed.collectives import Collectives


class RankMismatchError(RuntimeError):
    """Ranks hold different plans, tables or settings, or one rank failed a step
    that every rank must finish (a checkpoint write, a restore)."""

    # Found from one allgather, the same on every rank (dlrm.launch.same_on_every_rank).
    same_on_every_rank = True


# What to do about a difference outside the sections given their own advice.
AGREEMENT_HINT = (
    "Every rank must see the same FeatureSpec, --sharding_plan file and model, "
    "optimizer and batch flags"
)


def check_ranks_agree(
    collectives: Collectives, facts: Mapping[str, Any], hints: Mapping[str, str] | None = None
) -> None:
    """One allgather of every rank's `facts` (the plan, table shapes, model and
    optimizer settings); raises `RankMismatchError` on every rank, naming the
    first rank that differs from rank 0 and where, before anything is assembled
    from mismatched pieces. `hints`: advice for a difference in a top-level
    section of `facts`, by its key (else `AGREEMENT_HINT`)."""
    everyone = collectives.allgather_object(dict(facts), name="check_ranks_agree")
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        found = list(differences(reference, theirs))
        if found:
            raise RankMismatchError(_mismatch(rank, found, hints or {}))


def _mismatch(rank: int, found: list[tuple[str, Any, Any]], hints: Mapping[str, str]) -> str:
    """The message for rank `rank`'s differences from rank 0: the first, the others
    of its section (what else that rank resolved otherwise), and the section's hint."""
    path, ours, other = found[0]
    section = _section(path)
    also = [
        f"{where} ({_short(a, 40)} against {_short(b, 40)})"
        for where, a, b in found[1:4]
        if _section(where) == section
    ]
    return (
        f"the ranks disagree before training: rank {rank} differs from rank 0 in "
        f"{path} (rank 0: {_short(ours)}, rank {rank}: {_short(other)})"
        + (f"; also in {', '.join(also)}" if also else "")
        + f". {hints.get(section, AGREEMENT_HINT)}"
    )


def _section(path: str) -> str:
    """The top-level key of a path from `differences` ("resolved.dtype_policy": "resolved")."""
    return path.split(".")[0].split("[")[0].split(" ")[0]


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """(key path, a's value, b's value) of the first place where `a` and `b`
    differ, or None. Dicts compare key by key, lists item by item."""
    return next(differences(a, b, path), None)


def differences(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(key path, a's value, b's value) of every place where `a` and `b` differ,
    in order: dicts key by key (sorted), lists item by item (a list of another
    length differs once, in its length)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                yield where, a.get(key, "<missing>"), b.get(key, "<missing>")
            else:
                yield from differences(a[key], b[key], where)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            yield f"{path} (length)", len(a), len(b)
            return
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from differences(x, y, f"{path}[{index}]")
    elif a != b:
        yield path, a, b


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
