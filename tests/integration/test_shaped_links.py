"""The shaped-link benchmark at its smallest (2 hosts, one slow link, one small
batch, 2 steps): the link the benchmark shapes carries no more than its rate, and
every figure it reports (the measured step and its split, the dry run's prediction
for the same world) is there and positive. Its speeds are not asserted: they are
the benchmark's to report (docs/scaling.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.shaped_links import COMPUTE_TERMS, EXCHANGE_TERMS
from harness.netns import install_reason
from harness.processes import run

pytestmark = pytest.mark.integration

GBIT_S = 0.2


def test_the_smallest_shaped_run_reports_every_figure(tmp_path: Path) -> None:
    reason = install_reason()
    if reason is not None:
        pytest.skip(reason)
    output = tmp_path / "shaped.json"
    command = [sys.executable, "benchmarks/shaped_links.py", "--hosts=2", f"--gbit={GBIT_S}"]
    command += ["--batch_sizes=1024", "--steps=2", "--warmup=1", f"--output={output}"]
    result = run(command, timeout=900, check=True)
    (row,) = json.loads(output.read_text())["runs"]

    assert (row["hosts"], row["batch_size"]) == (2, 1024)
    # tbf never lets more than its rate through (the 64 KiB burst is 0.1 % of 3 s).
    assert 0 < row["link"]["gbit_s"] <= GBIT_S * 1.01, row["link"]
    assert row["link"]["latency_us"] > 0
    measured, predicted = row["measured"], row["predicted"]
    # The exposed time is part of the traced steps it was measured in (the timed
    # steps ran apart: nearly all waiting at this rate, either may be the longer).
    assert measured["step_s"] > 0 and measured["exposed_s"] > 0, measured
    assert 0 < measured["exposed_share"] < 1, measured
    assert measured["executing_s"] > 0, measured
    terms = predicted["terms"]
    assert predicted["compute_s"] == pytest.approx(sum(terms[t] for t in COMPUTE_TERMS))
    assert predicted["exchange_s"] == pytest.approx(sum(terms[t] for t in EXCHANGE_TERMS))
    assert predicted["step_s"] == pytest.approx(predicted["compute_s"] + predicted["exchange_s"])
    # Two hosts: the dry run costs the vectors' exchange and the dense allreduce.
    assert terms["dense_allreduce_s"] > 0 and terms["alltoall_vectors_s"] > 0, terms
    for name, error in row["error"].items():
        assert error > -1, (name, error)
    assert "hosts  Gbit" in result.stdout
