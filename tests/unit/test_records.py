"""The metrics log read back (`dlrm.app.records`) as `MetricsLog` writes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrm.app.records import last_record, read_records
from dlrm.app.reporting import MetricsLog


def test_records_come_back_in_order_by_event(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(path, None)
    log.write("train", step=5, loss=0.5)
    log.write("eval", step=5, auc=0.75)
    log.write("train", step=10, loss=0.25)
    log.close()
    assert [r["event"] for r in read_records(path)] == ["train", "eval", "train"]
    assert [r["loss"] for r in read_records(path, "train")] == [0.5, 0.25]
    assert last_record(path, "eval")["auc"] == 0.75
    assert read_records(tmp_path / "none.jsonl") == []


def test_a_line_being_written_is_left_out_and_a_broken_one_named(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "train", "step": 1}\n{"event": "tra')
    assert read_records(path) == [{"event": "train", "step": 1}]
    path.write_text('{"event": "train"}\nnot json\n{"event": "summary"}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        read_records(path)
    path.write_text('{"event": "train"}\n')
    with pytest.raises(ValueError, match=r"no 'summary' record \(it has \['train'\]\)"):
        last_record(path, "summary")
