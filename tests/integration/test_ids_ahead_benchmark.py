"""The id-exchange benchmark at its smallest (2 hosts, one slow link, one small
batch, one pair of 2-step runs): both ways trained, and the dry run's figures for
both are there and say what the overlap may hide. Its speeds are not asserted:
they are the benchmark's to report (docs/scaling.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness.netns import install_reason
from harness.processes import run

pytestmark = pytest.mark.integration


def test_the_smallest_run_measures_both_ways_and_predicts_the_saving(tmp_path: Path) -> None:
    reason = install_reason()
    if reason is not None:
        pytest.skip(reason)
    output = tmp_path / "ids_ahead.json"
    command = [sys.executable, "benchmarks/ids_ahead.py", "--hosts=2", "--gbit=0.2"]
    command += ["--batch_size=1024", "--repeats=1", "--steps=2", "--warmup=1"]
    result = run([*command, f"--output={output}"], timeout=900, check=True)
    (row,) = json.loads(output.read_text())["runs"]

    assert (row["hosts"], row["gbit_s"]) == (2, 0.2)
    (pair,) = row["pairs"]
    for mode in ("ahead", "own"):
        assert pair[mode]["step_s"] > pair[mode]["exposed_s"] > 0, (mode, pair[mode])
    own, ahead = row["predicted"]["own"]["terms"], row["predicted"]["ahead"]["terms"]
    # The ids cross between the hosts; ahead, the dense part hides up to its length.
    assert own["alltoall_ids_s"] > 0 and own["alltoall_ids_hidden_s"] == 0, own
    hidden = min(own["alltoall_ids_s"], own["dense_compute_s"])
    assert ahead["alltoall_ids_hidden_s"] == pytest.approx(hidden)
    assert row["predicted_saving_s"] == pytest.approx(hidden)
    assert row["median_ratio"] == pytest.approx(pair["own"]["step_s"] / pair["ahead"]["step_s"])
    assert "own/ahead" in result.stdout and "median:" in result.stdout
