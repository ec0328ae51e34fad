"""`make demo` end to end at its full size (3 days of 340,000 generated rows), into a
temporary directory: every stage runs for real (click log, Spark local mode,
horovodrun -np 2, export), the outputs exist, the model learned, and what it prints
at default verbosity holds none of the known noise (TensorFlow's, Spark's, Horovod's
start-up lines). CI runs it here, as part of `make test`, rather than once more after."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import tensorflow as tf

from dlrm.app.records import last_record
from harness.processes import run
from harness.quiet import noise_in

DEMO_TEST_ROWS = 340_000  # the demo's default --rows_per_day: its test day


def test_make_demo_runs_every_stage_and_learns(tmp_path: Path) -> None:
    output = tmp_path / "demo"
    result = run(
        ["make", "--no-print-directory", "demo", f"DEMO_ARGS=--output_dir={output}"],
        timeout=900,
        env={"TF_CPP_MIN_LOG_LEVEL": None},  # as a user runs it: the product's own default
        check=True,
    )
    assert noise_in(result.stdout + result.stderr) == []
    for number in range(1, 5):
        assert f"=== [{number}/4]" in result.stdout
    summary = last_record(output / "run" / "metrics.jsonl", "summary")
    assert summary["world_size"] == 2
    assert summary["samples"] == DEMO_TEST_ROWS  # the whole test day was scored
    assert summary["auc"] > 0.6, summary
    shown = re.search(r"test AUC\s+(\d\.\d{4})", result.stdout)
    assert shown is not None and float(shown.group(1)) == round(summary["auc"], 4)
    plan = json.loads((output / "run" / "sharding_plan.json").read_text())
    assert plan["world_size"] == 2
    assert Path(summary["checkpoint"], "manifest.json").exists()
    serving = tf.saved_model.load(str(output / "saved_model")).signatures["serving_default"]
    assert set(serving.structured_outputs) == {"probability"}


def test_demo_refuses_a_directory_it_did_not_write(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("user data")
    result = run([sys.executable, "examples/demo.py", f"--output_dir={foreign}"], timeout=120)
    assert result.returncode == 1
    assert f"{foreign} exists and was not written by the demo" in result.stderr
    assert (foreign / "keep.txt").read_text() == "user data"
