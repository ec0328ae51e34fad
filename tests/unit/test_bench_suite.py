"""The benchmark suite's measurements: peak memory (a peak shorter than its 0.1 s
samples still counts), repeated runs of ours and the plain loop in turn, and how
preprocessing's rows/s changes with the log's size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.suite import (
    alternated,
    cost_in_rows,
    fixed_cost,
    plot,
    plot_packages,
    print_table,
    run_measured,
)
from harness.processes import REPO, run

SUITE, PLAIN = REPO / "benchmarks" / "suite.py", REPO / "benchmarks" / "plain_tf.py"

# Touches 400 MB for about 20 ms, frees it, then idles for 0.5 s: the samples
# are 0.1 s apart, so most runs would sample only the idle process.
BRIEF_PEAK = """
import time
block = bytearray(400 * 2**20)
for offset in range(0, len(block), 4096):
    block[offset] = 1
del block
time.sleep(0.5)
print("done")
"""

# What print_table needs beside the part each test looks at.
RESULTS = {
    "matmul_gflops": {"float32": 200.0, "bfloat16": 400.0},
    "mflop_per_sample": 14.75,
    "training": [],
}


def test_a_brief_peak_is_measured_exactly_and_not_the_parents() -> None:
    # The measuring process holds more than the child ever does: a child's
    # ru_maxrss would start at this (copied at fork, kept through exec).
    ballast = bytearray(800 * 2**20)
    for offset in range(0, len(ballast), 4096):
        ballast[offset] = 1
    stdout, peak = run_measured([sys.executable, "-c", BRIEF_PEAK])
    assert stdout.strip() == "done"
    assert peak >= 400 * 2**20
    assert peak < 400 * 2**20 + 200 * 2**20  # the interpreter's own few MB on top
    del ballast


def test_a_failing_command_raises_with_its_output() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)failed \(3\).*going down"):
        run_measured([sys.executable, "-c", "import sys; print('going down'); sys.exit(3)"])


def test_alternated_runs_in_turn_and_reports_medians() -> None:
    calls: list[str] = []
    ours_rates = iter([100.0, 130.0, 120.0])
    plain_rates = iter([100.0, 100.0, 50.0])

    def ours() -> dict[str, float]:
        calls.append("ours")
        return {"samples_per_second": next(ours_rates), "peak_rss_bytes": 10 + len(calls)}

    def plain() -> dict[str, float]:
        calls.append("plain")
        return {"samples_per_second": next(plain_rates), "peak_rss_bytes": 5}

    row = alternated(ours, plain, 3)
    assert calls == ["ours", "plain"] * 3
    assert row["ours"]["samples_per_second"] == 120.0
    assert row["ours"]["peak_rss_bytes"] == 15  # the largest of the three
    assert row["plain"]["samples_per_second"] == 100.0
    assert row["ratio"] == 1.3  # pairs 1.0, 1.3, 2.4: not 120 / 100
    assert row["ours"]["runs_samples_per_second"] == [100.0, 130.0, 120.0]


def test_alternated_without_a_plain_loop_and_with_no_runs() -> None:
    row = alternated(lambda: {"samples_per_second": 7.0, "peak_rss_bytes": 1}, None, 2)
    ours = {"samples_per_second": 7.0, "peak_rss_bytes": 1, "runs_samples_per_second": [7.0, 7.0]}
    assert row == {"ours": ours}
    with pytest.raises(ValueError, match="repeats: expected at least 1, got 0"):
        alternated(lambda: {}, None, 0)


def _run(rows_per_second: float, later: float | None = None) -> dict[str, object]:
    figures: dict[str, object] = {"rows_per_second": rows_per_second}
    if later is not None:
        figures["later_runs"] = [{"rows_per_second": later}]
    return figures


def test_cost_in_rows_compares_the_largest_log_with_the_smallest() -> None:
    # Keys are line counts as JSON keeps them: sorted as numbers, not as text.
    by_rows = {
        "3000000": _run(60_000.0, 50_000.0),
        "1000000": _run(40_000.0, 50_000.0),
        "200000": _run(30_000.0, 40_000.0),
    }
    assert cost_in_rows(by_rows) == {"first_run": 2.0, "later_run": 1.25}
    assert cost_in_rows({"1000": _run(10.0), "3000": _run(15.0)}) == {"first_run": 1.5}
    assert cost_in_rows({"1000": _run(10.0, 12.0)}) == {}


def _timed(lines: int, seconds: float) -> dict[str, object]:
    return {"rows": lines, "rows_per_second": lines / seconds}


def test_fixed_cost_splits_the_first_runs_and_gives_the_most_fixed_cost_allowed() -> None:
    # 4 s apart from the lines and 10 s per million lines; the middle size is ignored.
    # Keyed by the size asked for; the fit takes the lines each log has.
    by_rows = {
        "3000000": _timed(3_060_000, 4.0 + 30.6),
        "2000000": _timed(2_000_000, 99.0),
        "1000000": _timed(1_020_000, 4.0 + 10.2),
    }
    fit = fixed_cost(by_rows)
    assert fit["fixed_seconds"] == pytest.approx(4.0)
    assert fit["seconds_per_million_lines"] == pytest.approx(10.0)
    # With that much fixed cost, rows/s at 3.06M is exactly 1.1x rows/s at 1.02M.
    allowed = fit["allowed_fixed_seconds"]
    ratio = (3.06 / (allowed + 30.6)) / (1.02 / (allowed + 10.2))
    assert ratio == pytest.approx(1.10)
    assert 1.5 < allowed < 1.7
    # Sizes within 10 % of each other: no fixed cost breaks the target.
    assert "allowed_fixed_seconds" not in fixed_cost(
        {"1000": _timed(1000, 2.0), "1050": _timed(1050, 2.05)}
    )
    assert fixed_cost({"1000": _timed(1000, 2.0)}) == {}


def test_the_table_gives_the_fixed_cost_against_spark_s_first_jobs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    by_rows = {
        "1020000": {**_timed(1_020_000, 14.2), "peak_rss_bytes": 2**30, "stages": {}},
        "3060000": {**_timed(3_060_000, 34.6), "peak_rss_bytes": 2**30, "stages": {}},
    }
    floor = {"startup_seconds": 1.8, "tasks_per_job": 2, "job_seconds": [3.3, 0.2, 0.3, 0.25]}
    results = {
        **RESULTS,
        "preprocessing_by_rows": by_rows,
        "preprocessing_cost_in_rows": cost_in_rows(by_rows),
        "preprocessing_fixed_cost": fixed_cost(by_rows),
        "spark_floor": {"python": floor, "jvm": {**floor, "job_seconds": [1.9, 0.1]}},
    }
    print_table(results)
    out = capsys.readouterr().out
    assert (
        "preprocessing first runs: 4.0 s apart from the lines + 10.0 s per million lines; " in out
    )
    assert "within 10% needs at most 1.6 s of it" in out
    assert "first empty job of python tasks: 3.30 s, later ones 0.25 s (start-up 1.8 s" in out
    assert "first empty job of jvm tasks: 1.90 s, later ones 0.10 s" in out


@pytest.mark.parametrize("value", ["-5", "0,1000", "1e6"])
def test_bad_preproc_rows_are_a_parser_error(value: str) -> None:
    result = run([sys.executable, str(SUITE), f"--preproc_rows={value}"], timeout=60)
    assert result.returncode == 2
    assert "--preproc_rows" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_table_gives_each_optimizer_against_sgd(capsys: pytest.CaptureFixture[str]) -> None:
    results = {
        **RESULTS,
        "optimizers": [
            {"optimizer": "adam", "variant": "fp32", "batch_size": 8192}
            | {"samples_per_second": 9000.0, "peak_rss_bytes": 2**30, "of_sgd": 0.9},
            {"optimizer": "adagrad", "variant": "amp", "batch_size": 8192, "ranks": 2}
            | {"samples_per_second": 7000.0, "peak_rss_bytes": 2**30, "of_sgd": 0.95},
        ],
    }
    print_table(results)
    out = capsys.readouterr().out
    assert "adam fp32 batch 8192, one process: 9,000 samples/s, 0.90 of SGD's" in out
    assert "adagrad amp batch 8192, 2 ranks: 7,000 samples/s, 0.95 of SGD's" in out


def test_unknown_optimizers_are_a_parser_error() -> None:
    result = run([sys.executable, str(SUITE), "--optimizers=sgd,lamb"], timeout=60)
    assert result.returncode == 2
    assert "--optimizers: expected some of adagrad, adam, got 'sgd,lamb'" in result.stderr


def test_the_plain_loop_trains_the_small_dcnv2_shape() -> None:
    # Multi-hot tables (3 and 2 ids a row, one one-hot), cross layers, Adam.
    flags = ["--batch_size=64", "--steps=3", "--warmup=1", "--cardinalities=50,20,7"]
    flags += ["--hotness=3,2,1", "--embedding_dim=4", "--bottom=8,4", "--top=8,1"]
    flags += ["--interaction=cross", "--cross_layers=2", "--projection=3", "--optimizer=adam"]
    flags += ["--learning_rate=0.01"]
    result = run([sys.executable, str(PLAIN), *flags], timeout=300, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["samples_per_second"] > 0
    assert 0.0 < figures["loss"] < 2.0


def test_the_plain_loop_names_a_hotness_that_does_not_fit() -> None:
    result = run([sys.executable, str(PLAIN), "--cardinalities=50,20", "--hotness=3"], timeout=300)
    assert result.returncode == 2
    assert "--hotness: expected one count >= 1 per table (2), got [3]" in result.stderr


def test_the_plot_is_drawn_with_matplotlib_from_beside_the_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make install` puts matplotlib in <venv>/plot-packages, where `plot` finds it,
    and a process that imports TensorFlow does not load it (Keras would, from the
    venv's packages: 0.4 s more to start), nor scikit-learn (1.2 s)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # plot() appends to it
    assert (plot_packages() / "matplotlib").is_dir()
    rows = [
        {
            "variant": variant,
            "ranks": 1,
            "batch_size": batch,
            "ours": {"samples_per_second": 1000.0 * batch**0.5},
            "plain": {"samples_per_second": 600.0 * batch**0.5},
        }
        for variant in ("fp32", "amp")
        for batch in (1024, 8192, 65536)
    ]
    path = tmp_path / "plot.png"
    plot({"training": rows, "machine": "test"}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    imported = (
        "import sys, tensorflow; "
        "print(sorted(m for m in ('matplotlib', 'sklearn') if m in sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", imported], capture_output=True, text=True, timeout=120, check=True
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout
