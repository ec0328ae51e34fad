"""The machine's own limit, and the suite's figures set against it (`make bench`).

    python benchmarks/targets.py     # the peaks of this machine alone

`machine_peaks` measures what this machine's matmuls reach: the best of 5 runs
at 2048^3 and at 4096^3, in TensorFlow and in NumPy (OpenBLAS), float32 and
bfloat16 (TensorFlow only: NumPy has no bfloat16 matmul). The best of all is
the peak, so that a slow TensorFlow kernel does not lower the bar. It also
says whether the CPU has bfloat16 hardware (AVX-512 BF16 or AMX), which the
bfloat16 target needs.

`evaluate` turns a suite's results into one row per performance target
(`docs/performance.md#targets`): the figure, the goal, met or not, or why it
was not measured (`met` None).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

SIZES = (2048, 4096)
REPEATS = 5
BF16_FLAGS = ("avx512_bf16", "amx_bf16")

# The goals, as shares or ratios.
FP32_OF_PEAK = 0.75
BF16_OF_PEAK = 0.50
OPTIMIZER_OF_SGD = 0.85
TWO_RANKS_OF_ONE = 0.90
OVER_PLAIN = 1.3
SIXTEEN_OVER_TWO_CORES = 6.0
CORES_BATCH = 65536
# Preprocessing: rows/s at 3M lines within this share of rows/s at 1M.
COST_IN_ROWS_TOLERANCE = 0.10


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo has none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _numpy_gflops(a: Any, b: Any) -> float:
    """Best GFLOP/s of NumPy's a @ b (square), after one untimed run."""
    import numpy as np

    np.matmul(a, b)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        np.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * a.shape[0] ** 3 / max(best, 1e-9) / 1e9


def machine_peaks() -> dict[str, Any]:
    """GFLOP/s per precision and library and size, the best of them (`peak`), and
    the CPU's bfloat16 hardware."""
    import numpy as np
    import tensorflow as tf

    from dlrm.train.precision import matmul_gflops

    measured: dict[str, dict[str, float]] = {"float32": {}, "bfloat16": {}}
    generator = np.random.default_rng(0)
    for size in SIZES:
        a, b = (generator.random((size, size), np.float32) for _ in range(2))
        measured["float32"][f"numpy_{size}"] = _numpy_gflops(a, b)
        for name, dtype in (("float32", tf.float32), ("bfloat16", tf.bfloat16)):
            measured[name][f"tensorflow_{size}"] = matmul_gflops(dtype, size, REPEATS)
    flags = cpu_flags()
    return {
        name: {"peak": max(by_run.values()), "runs": by_run} for name, by_run in measured.items()
    } | {"bf16_hardware": sorted(flags & set(BF16_FLAGS))}


def _row(target: str, figure: float | None, goal: float, detail: str, why: str = "") -> dict:
    return {
        "target": target,
        "figure": figure,
        "goal": goal,
        "met": None if figure is None else figure >= goal,
        "detail": detail if figure is not None else why,
    }


def _ratio_row(
    target: str, numerator: float | None, denominator: float | None, goal: float, why: str
) -> dict:
    """A target that is one samples/s over another; not measured where either is missing."""
    figure = numerator / denominator if numerator and denominator else None
    return _row(target, figure, goal, f"{numerator or 0:,.0f} / {denominator or 0:,.0f}", why)


def rate(
    results: dict[str, Any], variant: str, batch: int, ranks: int, optimizer: str = "sgd"
) -> float | None:
    """Our samples/s in the suite's `results` for one setting (None: not measured)."""
    if optimizer == "sgd":
        rows = [(r, r["ours"]) for r in results.get("training", [])]
    else:
        rows = [(r, r) for r in results.get("optimizers", []) if r["optimizer"] == optimizer]
    for row, figures in rows:
        if (row["variant"], row["batch_size"], row.get("ranks", 1)) == (variant, batch, ranks):
            return float(figures["samples_per_second"])
    return None


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target: `figure` against `goal` (`met`), with the numbers it
    comes from (`detail`), or `met` None and why, where the suite did not
    measure it."""
    batches = sorted({row["batch_size"] for row in results.get("training", [])})
    return [
        *shares_of_peak(results, batches),
        *optimizers_of_sgd(results, batches[0] if batches else 0),
        *two_ranks_of_one(results, batches[0] if batches else 0),
        *ours_over_plain(results, batches),
        *sixteen_over_two_cores(results),
    ]


def shares_of_peak(results: dict[str, Any], batches: list[int]) -> list[dict[str, Any]]:
    """fp32 and bf16 training at each batch, in GFLOP/s, against the matmul peak."""
    peaks, mflop = results["peaks"], results["mflop_per_sample"]
    rows = []
    for variant, precision, goal in (
        ("fp32", "float32", FP32_OF_PEAK),
        ("amp", "bfloat16", BF16_OF_PEAK),
    ):
        peak = peaks[precision]["peak"]
        for batch in batches:
            target = f"{precision} share of the matmul peak, batch {batch}"
            if precision == "bfloat16" and not peaks.get("bf16_hardware"):
                rows.append(_row(target, None, goal, "", "no bfloat16 hardware on this CPU"))
                continue
            ours = rate(results, variant, batch, 1)
            gflops = (ours or 0) * mflop / 1e3
            detail = f"{ours or 0:,.0f} samples/s x {mflop:.2f} MFLOP = {gflops:.0f} of {peak:.0f}"
            share = gflops / peak if ours else None
            rows.append(_row(target, share, goal, detail, f"no {variant} row on 1 rank"))
    return rows


def optimizers_of_sgd(results: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    return [
        _ratio_row(
            f"{optimizer} of SGD's samples/s, {variant}",
            rate(results, variant, batch, 1, optimizer),
            rate(results, variant, batch, 1),
            OPTIMIZER_OF_SGD,
            f"not measured ({variant}, batch {batch})",
        )
        for variant in ("fp32", "amp")
        for optimizer in ("adagrad", "adam")
    ]


def two_ranks_of_one(results: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    return [
        _ratio_row(
            f"2 ranks of 1 rank's samples/s, {variant}, {optimizer}",
            rate(results, variant, batch, 2, optimizer),
            rate(results, variant, batch, 1, optimizer),
            TWO_RANKS_OF_ONE,
            "not measured: run with --ranks 1,2",
        )
        for variant in ("fp32", "amp")
        for optimizer in ("sgd", "adagrad")
    ]


def ours_over_plain(results: dict[str, Any], batches: list[int]) -> list[dict[str, Any]]:
    """The small DLRM-DCNv2, then the default model at each batch, on one process."""
    rows = []
    for variant in ("fp32", "amp"):
        compared = [("DLRM-DCNv2 (small)", results.get("dcnv2", {}).get(variant))]
        one_rank = [r for r in results["training"] if (r["variant"], r["ranks"]) == (variant, 1)]
        measured = {r["batch_size"]: r for r in one_rank if "ratio" in r}
        compared += [(f"default model, batch {b}", measured.get(b)) for b in batches]
        for name, row in compared:
            detail = (
                f"{row['ours']['samples_per_second']:,.0f} / "
                f"{row['plain']['samples_per_second']:,.0f}"
                if row
                else ""
            )
            ratio = row["ratio"] if row else None
            target = f"{name}, ours over plain, {variant}"
            rows.append(_row(target, ratio, OVER_PLAIN, detail, "not measured"))
    return rows


def sixteen_over_two_cores(results: dict[str, Any]) -> list[dict[str, Any]]:
    """From `benchmarks/cores.py`, which the suite runs where 16 cores are available."""
    rows = []
    for variant in ("fp32", "amp"):
        by_cores = {
            row["cores"]: row["ours"]["samples_per_second"]
            for row in results.get("cores", {}).get("rows", [])
            if (row["variant"], row["batch_size"]) == (variant, CORES_BATCH)
        }
        rows.append(
            _ratio_row(
                f"16 cores over 2 cores, batch {CORES_BATCH}, {variant}",
                by_cores.get(16),
                by_cores.get(2),
                SIXTEEN_OVER_TWO_CORES,
                "not measured: needs 16 cores (benchmarks/cores.py)",
            )
        )
    return rows


def print_targets(rows: list[dict[str, Any]], peaks: dict[str, Any]) -> None:
    hardware = ", ".join(peaks.get("bf16_hardware", [])) or "none"
    print(
        f"\ntargets (docs/performance.md); this machine's matmul peak: float32 "
        f"{peaks['float32']['peak']:.0f} GFLOP/s, bfloat16 {peaks['bfloat16']['peak']:.0f} "
        f"GFLOP/s (best of TensorFlow and NumPy at {' and '.join(f'{s}^3' for s in SIZES)}); "
        f"bfloat16 hardware: {hardware}"
    )
    for row in rows:
        if row["met"] is None:
            verdict, figure = "n/a", "-"
        else:
            verdict = "met" if row["met"] else "NOT MET"
            figure = f"{row['figure']:.2f}"
        print(
            f"  {row['target']:<52}{figure:>6} (goal {row['goal']:.2f}) {verdict:<8}{row['detail']}"
        )


def main() -> int:
    print(json.dumps(machine_peaks(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
