"""`make gpu-check`'s script at its CI size (`--small`) on this CPU-only machine:
the CPU path's checks all ran and passed, said as the CPU's, on the figures the
script wrote. And a failing check exits 1 with the table marking it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from harness.processes import run

VARIANTS = ("fp32", "amp", "xla", "amp+xla")


def test_the_small_check_passes_on_the_cpu_path(tmp_path: Path) -> None:
    output = tmp_path / "gpu_check.json"
    # 10 steps of --small's 20: enough for each variant's loss to fall, and the
    # --xla comparison's bound does not depend on the steps.
    command = [sys.executable, "benchmarks/gpu_check.py", "--small", "--steps=10"]
    command += [f"--json={output}"]
    result = run([*command, f"--dir={tmp_path / 'work'}"], timeout=900, check=True)
    figures = json.loads(output.read_text())

    assert figures["gpu"] is False and figures["device"] == "cpu"
    assert figures["note"] == gpu_check.NO_GPU_LINE
    assert result.stdout.splitlines().count(gpu_check.NO_GPU_LINE) >= 2  # first, and the table's
    assert figures["passed"] is True
    assert all(check["passed"] for check in figures["checks"]), figures["checks"]
    steps = figures["sizes"]["steps"]
    for name in VARIANTS:
        row = figures["variants"][name]
        assert row["returncode"] == 0 and row["steps"] == steps, (name, row)
        assert row["finite"] and row["last_loss_mean"] < row["first_loss"], (name, row)
        assert row["samples_per_second"] > 0, (name, row)
        assert row["peak_memory_of"] == "process_rss" and row["peak_memory_bytes"] > 2**20
    # --xla against fp32: within the fp32 bound, and not trivially (other code paths).
    comparison = figures["comparison"]
    assert comparison["longest_dot"] == gpu_check.SMALL.longest_dot == 16 + 26 * 27 // 2
    assert comparison["tolerance"] == pytest.approx(math.sqrt(367) * 2.0**-24)
    assert comparison["max_relative_difference"] <= comparison["tolerance"]
    assert figures["dcnv2"]["auc"] > 0.7
    export = figures["export"]
    assert export["samples"] == figures["sizes"]["test_rows"]
    assert export["auc_difference"] <= gpu_check.EXPORT_AUC_TOLERANCE["cpu"]
    assert math.isclose(export["run_auc"], figures["variants"]["fp32"]["auc"])
    for name in ("fp32", "amp"):
        assert figures["plain"][name]["ratio"] > 0, figures["plain"][name]


def test_a_failing_check_exits_1_and_is_marked(tmp_path: Path) -> None:
    results = {
        "device": "cpu",
        "gpu": False,
        "device_name": "a CPU",
        "sizes": {
            "tables": 2,
            "rows": 3,
            "embedding_dim": 4,
            "bottom": [4],
            "top": [1],
            "batch_size": 8,
            "steps": 2,
        },
        "variants": {},
        "plain": {"fp32": {"error": "RuntimeError: it broke"}},
        "comparison": {"what": "nothing"},
    }
    checks = [
        gpu_check.Check("fine", True, "1", "> 0"),
        gpu_check.Check("broken", False, "0", "> 0"),
    ]
    output = tmp_path / "figures.json"

    assert gpu_check.finish(results, checks, output) == 1

    written = json.loads(output.read_text())
    assert written["passed"] is False
    assert [c["passed"] for c in written["checks"]] == [True, False]
    text = gpu_check.table(written)
    assert "FAIL  broken" in text and "PASS  fine" in text
    assert "FAILED: broken" in text
    assert gpu_check.NO_GPU_LINE in text.splitlines()[:2]
