"""Training speed against the number of cores: `main.py` confined (CPU
affinity, as `taskset` sets it) to the first 2 and the first 16 cores of the
machine, one process.

    python benchmarks/cores.py [--cores 2,16] [--batch_sizes 65536]
        [--variants fp32,amp] [--steps 5] [--plain] [--output cores.json]

For each core count: the matmul peak on those cores (`benchmarks/targets.py`
run pinned to them), and for each batch size and variant our samples/s (the
median of `main.py`'s progress records after the first, as in the suite), its
share of that peak, and with `--plain` the plain TensorFlow loop's samples/s on
the same cores. The cores are taken one per physical core first, so that "2
cores" are two cores and not one core's two hyperthreads. Prints each figure as
it is measured, then the speedup of the largest core count over the smallest,
and writes the whole as JSON after every run (a run cut short keeps what it
measured). `make bench` runs it itself where 16 cores are available
(`benchmarks/suite.py`); the target is a speedup of at least 6 from 2 to 16
cores at batch 65536 (`docs/performance.md#targets`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.common import (
    REPO,
    VARIANTS,
    default_dataset,
    integers,
    mflop_per_sample,
    on_cpus,
    parser_for,
    run_checked,
    save,
    train_ours,
    train_plain,
    variants,
    work_directory,
)


def cores_in_order(
    topology: Path = Path("/sys/devices/system/cpu"), allowed: Iterable[int] | None = None
) -> list[int]:
    """The CPUs this process may run on (or `allowed`), one per physical core
    first (the first hyperthread of every core, then the second ones); in number
    order where the topology is unknown."""
    allowed = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    seen: dict[tuple[str, str], int] = {}
    order: list[tuple[int, int]] = []
    for cpu in allowed:
        try:
            base = topology / f"cpu{cpu}" / "topology"
            core = ((base / "physical_package_id").read_text(), (base / "core_id").read_text())
        except OSError:
            core = ("", str(cpu))
        order.append((seen.get(core, 0), cpu))
        seen[core] = seen.get(core, 0) + 1
    return [cpu for _, cpu in sorted(order)]


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch and variant: samples/s on the most cores over that on the fewest."""
    result = []
    for batch, variant in dict.fromkeys((r["batch_size"], r["variant"]) for r in rows):
        same = sorted(
            (r for r in rows if (r["batch_size"], r["variant"]) == (batch, variant)),
            key=lambda r: r["cores"],
        )
        if len(same) > 1:
            low, high = same[0]["ours"], same[-1]["ours"]
            row = {"batch_size": batch, "variant": variant}
            row["cores"] = [same[0]["cores"], same[-1]["cores"]]
            result.append(row | {"speedup": high["samples_per_second"] / low["samples_per_second"]})
    return result


def measure(
    dataset: Path,
    work: Path,
    counts: Sequence[int],
    batches: Sequence[int],
    variants: Sequence[str],
    steps: int,
    plain: bool,
    mflop_per_sample: float,
    output: Path | None = None,
) -> dict[str, Any]:
    """Peaks, then every batch x variant x core count; see the module's text."""
    order = cores_in_order()
    if max(counts) > len(order):
        raise ValueError(f"--cores {max(counts)}: this process may use {len(order)} CPUs")
    sets = {count: sorted(order[:count]) for count in counts}
    results: dict[str, Any] = {
        "cpus_allowed": len(order),
        "core_sets": {str(count): cpus for count, cpus in sets.items()},
        "peaks": {},
        "rows": [],
    }
    for count, cpus in sets.items():
        results["peaks"][str(count)] = measure_peaks(count, cpus)
        if output:
            save(results, output)
    for batch in batches:
        for variant in variants:
            for count, cpus in sets.items():
                ours = train_ours(dataset, work, batch, variant, 1, steps, cpus=cpus)
                amp, _ = VARIANTS[variant]
                peak = results["peaks"][str(count)]["bfloat16" if amp else "float32"]["peak"]
                share = ours["samples_per_second"] * mflop_per_sample / 1e3 / peak
                row: dict[str, Any] = {"batch_size": batch, "variant": variant, "cores": count}
                row |= {"ours": ours, "share_of_peak": share}
                line = f"{variant} batch {batch} on {count} cores: "
                line += f"{ours['samples_per_second']:,.0f} samples/s, {share:.2f} of the peak"
                if plain:
                    row["plain"] = train_plain(batch, variant, steps, cpus=cpus)
                    row["ratio"] = ours["samples_per_second"] / row["plain"]["samples_per_second"]
                    line += f", {row['ratio']:.2f}x the plain loop"
                print(line, flush=True)
                results["rows"].append(row)
                results["speedups"] = speedups(results["rows"])
                if output:
                    save(results, output)
    print_speedups(results.get("speedups", []))
    return results


def measure_peaks(count: int, cpus: Sequence[int]) -> dict[str, Any]:
    """`benchmarks/targets.py`'s matmul peaks measured on `cpus` alone."""
    print(f"matmul peak on {count} cores ...", flush=True)
    command = [sys.executable, str(REPO / "benchmarks" / "targets.py")]
    peaks = json.loads(run_checked(on_cpus(cpus, command)))
    print(
        f"  float32 {peaks['float32']['peak']:.0f}, bfloat16 "
        f"{peaks['bfloat16']['peak']:.0f} GFLOP/s",
        flush=True,
    )
    return peaks


def print_speedups(entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        low, high = entry["cores"]
        print(
            f"{entry['variant']} batch {entry['batch_size']}: {high} cores "
            f"{entry['speedup']:.2f}x {low} cores",
            flush=True,
        )


def main() -> int:
    parser = parser_for(__doc__)
    parser.add_argument("--cores", type=integers, default="2,16", help="core counts")
    parser.add_argument("--batch_sizes", type=integers, default="65536", help="comma-separated")
    parser.add_argument(
        "--variants", type=variants, default="fp32,amp", help=f"some of {','.join(VARIANTS)}"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per run")
    parser.add_argument("--plain", action="store_true", help="the plain loop on each core set")
    parser.add_argument("--output", type=Path, default=Path("cores.json"))
    args = parser.parse_args()
    counts = sorted(set(args.cores))
    if not counts or not args.batch_sizes or min(*counts, *args.batch_sizes, args.steps) < 1:
        parser.error(
            "--cores, --batch_sizes, --steps: expected positive numbers, got "
            f"{args.cores}, {args.batch_sizes}, {args.steps}"
        )
    allowed = len(os.sched_getaffinity(0))
    if max(counts) > allowed:
        parser.error(f"--cores {max(counts)}: this process may use {allowed} CPUs")
    with work_directory("cores_") as work:
        dataset = default_dataset(work, max(args.batch_sizes), args.steps)
        sizes = (counts, args.batch_sizes, args.variants, args.steps)
        measure(dataset, work, *sizes, args.plain, mflop_per_sample(), args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
