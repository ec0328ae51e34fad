"""The suite's targets (issue 34): each figure set against its goal from a
suite's results, and what is not measured said so, not counted as met."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.targets import cpu_flags, evaluate, print_targets


def results(bf16_hardware: list[str]) -> dict[str, Any]:
    def training(
        variant: str, batch: int, ranks: int, ours: float, plain: float | None
    ) -> dict[str, Any]:
        row: dict[str, Any] = {
            "variant": variant,
            "batch_size": batch,
            "ranks": ranks,
            "ours": {"samples_per_second": ours},
        }
        if plain:
            row |= {"plain": {"samples_per_second": plain}, "ratio": ours / plain}
        return row

    def optimizer(name: str, variant: str, ranks: int, rate: float) -> dict[str, Any]:
        return {
            "optimizer": name,
            "variant": variant,
            "batch_size": 8192,
            "ranks": ranks,
            "samples_per_second": rate,
        }

    return {
        "peaks": {
            "float32": {"peak": 100.0},
            "bfloat16": {"peak": 400.0},
            "bf16_hardware": bf16_hardware,
        },
        "mflop_per_sample": 10.0,
        "training": [
            training("fp32", 8192, 1, 8000.0, 5000.0),  # 80 GFLOP/s of 100
            training("fp32", 8192, 2, 7000.0, None),
            training("amp", 8192, 1, 16000.0, 14000.0),  # 160 of 400
            training("fp32", 65536, 1, 7000.0, 6000.0),
        ],
        "optimizers": [
            optimizer("adagrad", "fp32", 1, 6000.0),
            optimizer("adam", "fp32", 1, 7200.0),
            optimizer("adagrad", "fp32", 2, 5700.0),
        ],
        "dcnv2": {
            "fp32": {
                "ours": {"samples_per_second": 30000.0},
                "plain": {"samples_per_second": 12000.0},
                "ratio": 2.5,
            }
        },
    }


def by_name(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["target"]: row for row in rows}


def test_each_figure_is_set_against_its_goal() -> None:
    rows = by_name(evaluate(results(["avx512_bf16"])))
    share = rows["float32 share of the matmul peak, batch 8192"]
    assert share["figure"] == pytest.approx(0.8) and share["met"] is True
    assert "80 of 100" in share["detail"]
    assert rows["float32 share of the matmul peak, batch 65536"]["figure"] == pytest.approx(0.7)
    assert rows["float32 share of the matmul peak, batch 65536"]["met"] is False
    bf16 = rows["bfloat16 share of the matmul peak, batch 8192"]
    assert bf16["figure"] == pytest.approx(0.4) and bf16["met"] is False
    adagrad = rows["adagrad of SGD's samples/s, fp32"]
    assert adagrad["figure"] == pytest.approx(0.75) and adagrad["met"] is False
    assert rows["adam of SGD's samples/s, fp32"]["figure"] == pytest.approx(0.9)
    assert rows["adam of SGD's samples/s, fp32"]["met"] is True
    two = rows["2 ranks of 1 rank's samples/s, fp32, sgd"]
    assert two["figure"] == pytest.approx(7000 / 8000) and two["met"] is False
    assert rows["2 ranks of 1 rank's samples/s, fp32, adagrad"]["figure"] == pytest.approx(0.95)
    assert rows["DLRM-DCNv2 (small), ours over plain, fp32"]["met"] is True
    assert rows["default model, batch 8192, ours over plain, fp32"]["figure"] == pytest.approx(1.6)
    assert rows["default model, batch 65536, ours over plain, fp32"]["met"] is False


def test_what_was_not_measured_is_neither_met_nor_failed() -> None:
    rows = by_name(evaluate(results([])))
    bf16 = rows["bfloat16 share of the matmul peak, batch 8192"]
    assert bf16["met"] is None and "no bfloat16 hardware" in bf16["detail"]
    for name in (
        "adagrad of SGD's samples/s, amp",
        "2 ranks of 1 rank's samples/s, amp, sgd",
        "DLRM-DCNv2 (small), ours over plain, amp",
        "16 cores over 2 cores, batch 65536, fp32",
    ):
        assert rows[name]["met"] is None and rows[name]["figure"] is None, name


def test_the_printout_names_the_peak_and_each_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    data = results([])
    print_targets(evaluate(data), data["peaks"])
    out = capsys.readouterr().out
    assert "float32 100 GFLOP/s, bfloat16 400 GFLOP/s" in out
    assert "bfloat16 hardware: none" in out
    line = next(x for x in out.splitlines() if "adagrad of SGD's samples/s, fp32" in x)
    assert "0.75 (goal 0.85) NOT MET" in line and "6,000 / 8,000" in line


def test_cpu_flags_reads_the_first_cpu(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nflags\t\t: other\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()


def test_the_cores_speedup_is_16_cores_over_2_at_batch_65536() -> None:
    data = results([])

    def row(variant: str, batch: int, cores: int, rate: float) -> dict[str, Any]:
        return {
            "variant": variant,
            "batch_size": batch,
            "cores": cores,
            "ours": {"samples_per_second": rate},
        }

    data["cores"] = {
        "rows": [
            row("fp32", 65536, 2, 10_000.0),
            row("fp32", 65536, 16, 61_000.0),
            row("amp", 65536, 2, 20_000.0),
            row("amp", 65536, 16, 110_000.0),
            row("amp", 8192, 16, 500_000.0),  # another batch: not this target's
        ]
    }
    rows = by_name(evaluate(data))
    fp32 = rows["16 cores over 2 cores, batch 65536, fp32"]
    assert fp32["figure"] == pytest.approx(6.1) and fp32["met"] is True
    assert "61,000 / 10,000" in fp32["detail"]
    amp = rows["16 cores over 2 cores, batch 65536, amp"]
    assert amp["figure"] == pytest.approx(5.5) and amp["met"] is False
