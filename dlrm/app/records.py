"""The metrics log read back: one JSON object per line, each with its `event`
("start", "train", "eval", "checkpoint", "summary", ...) and `time`, as
`dlrm.app.reporting.MetricsLog` writes it. No TensorFlow: tests, benchmarks and
the demos read runs' logs with it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_records(path: str | os.PathLike[str], event: str | None = None) -> list[dict[str, Any]]:
    """The records of the metrics log at `path`, in order; only those of `event`
    when given. A missing file has none; a line cut short by a writer that is
    still running (the last one) is left out."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # being written
            raise ValueError(f"{path}:{number}: not a JSON record: {line[:120]!r}") from None
        if event is None or record.get("event") == event:
            records.append(record)
    return records


def last_record(path: str | os.PathLike[str], event: str) -> dict[str, Any]:
    """The last record of `event` in the metrics log at `path`; ValueError naming
    the file and the events it has when there is none."""
    found = read_records(path, event)
    if not found:
        seen = sorted({r.get("event", "?") for r in read_records(path)})
        raise ValueError(f"{path}: no {event!r} record (it has {seen or 'none'})")
    return found[-1]
