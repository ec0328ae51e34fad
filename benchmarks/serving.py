"""Serving latency of a float32 and an int8 SavedModel (`--mode export --quantize`).

    python benchmarks/serving.py [--float32 DIR --int8 DIR] [--batches 1,64,2048]
        [--calls 200] [--warmup 20] [--train_batch 4096] [--dir PARENT] [--json PATH]

Without --float32/--int8, builds both from the default model (26 tables of 100,000
rows, width 128, the default MLPs): a synthetic dataset (`default_dataset`), two
training steps of `main.py` (latency does not depend on what the weights learned)
and `main.py --mode export` with and without `--quantize int8`.

Both models are loaded in this process and served through their
`serving_default` signature, the way a client calls them, on random inputs: ids
uniform over each table's rows (read from the SavedModel's variables), numerical
features normal. For each batch size, each model answers `--warmup` untimed calls,
then `--calls` timed calls alternating with the other model's (which goes first
alternates too), so that both see the same machine state; a call's time includes
fetching its result. Prints a table of p50 and p99 per model and batch size, and
writes the figures as JSON (--json, else serving.json in the work directory's
parent when --dir is given).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from benchmarks.common import (
    add_output_flags,
    cpu_model,
    default_dataset,
    integers,
    main_py,
    parser_for,
    save,
    work_directory,
)
from harness.export import export_checkpoint

MODELS = ("float32", "int8")


def build_models(work: Path, train_batch: int) -> dict[str, Path]:
    """The default model trained two steps on synthetic data, exported as float32
    and as int8 SavedModels in `work`."""
    dataset = default_dataset(work, train_batch, steps=2)
    checkpoints = work / "checkpoints"
    print("training 2 steps of the default model ...", flush=True)
    flags = [f"--batch_size={train_batch}", "--max_steps=2", "--evals_per_epoch=0"]
    main_py(dataset, work, 1, *flags, f"--save_checkpoint_path={checkpoints}")
    paths = {"float32": work / "float32", "int8": work / "int8"}
    for name, path in paths.items():
        quantize = "none" if name == "float32" else name
        summary = export_checkpoint(checkpoints, path, f"--quantize={quantize}", timeout=1800)
        print(f"exported {name}: {summary['table_bytes'] / 1e6:.1f} MB of tables", flush=True)
    return paths


def table_rows(model_dir: Path) -> list[int]:
    """Each table's rows, from the SavedModel's variables (`tables/<t>/...`)."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(model_dir / "variables" / "variables"))
    rows: dict[int, int] = {}
    for name, shape in reader.get_variable_to_shape_map().items():
        if name.startswith("tables/"):
            table = int(name.split("/")[1])
            rows[table] = min(rows.get(table, shape[0]), shape[0])
    return [rows[t] for t in sorted(rows)]


def random_inputs(serve: Any, rows: list[int], batch: int, seed: int) -> dict[str, Any]:
    """Inputs of `batch` rows for the signature `serve`: numerical normal, ids
    uniform over each table's rows (one column per table when the model is one-hot,
    else over the smallest table's), one id per variable-length table and row."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    specs = serve.structured_input_signature[1]
    numerical = specs["numerical"].shape[1]
    columns = specs["categorical"].shape[1]
    id_dtype = specs["categorical"].dtype.as_numpy_dtype
    highs = rows if columns == len(rows) else [min(rows)] * columns
    inputs = {
        "numerical": rng.normal(0, 1, (batch, numerical)).astype(np.float32),
        "categorical": np.stack([rng.integers(0, h, batch) for h in highs], 1).astype(id_dtype),
    }
    if "multi_hot_lengths" in specs:
        variable = specs["multi_hot_lengths"].shape[1]
        inputs["multi_hot_lengths"] = np.ones((batch, variable), np.int64)
        inputs["multi_hot_values"] = rng.integers(0, min(rows), batch * variable).astype(id_dtype)
    return {name: tf.constant(value) for name, value in inputs.items()}


def measure(
    models: dict[str, Path], batches: list[int], calls: int, warmup: int
) -> list[dict[str, Any]]:
    """p50 and p99 latency (ms) of each model at each batch size, calls alternating."""
    import tensorflow as tf

    serves = {
        name: tf.saved_model.load(str(path)).signatures["serving_default"]
        for name, path in models.items()
    }
    rows = table_rows(models["float32"])
    results = []
    for batch in batches:
        inputs = random_inputs(serves["float32"], rows, batch, seed=batch)
        for serve in serves.values():
            for _ in range(warmup):
                serve(**inputs)["probability"].numpy()
        times: dict[str, list[float]] = {name: [] for name in serves}
        for call in range(calls):
            order = list(serves) if call % 2 == 0 else list(reversed(serves))
            for name in order:
                start = time.perf_counter()
                serves[name](**inputs)["probability"].numpy()
                times[name].append(time.perf_counter() - start)
        row: dict[str, Any] = {"batch": batch, "calls": calls}
        for name, seconds in times.items():
            milliseconds = 1e3 * np.asarray(seconds)
            row[f"{name}_p50_ms"] = float(np.percentile(milliseconds, 50))
            row[f"{name}_p99_ms"] = float(np.percentile(milliseconds, 99))
        results.append(row)
        print_row(row)
    return results


def print_header() -> None:
    print(
        f"{'batch':>6} | {'float32 p50':>11} {'p99':>8} | {'int8 p50':>9} {'p99':>8} | "
        f"{'int8/float32 p50':>16}   (ms)",
        flush=True,
    )


def print_row(row: dict[str, Any]) -> None:
    ratio = row["int8_p50_ms"] / row["float32_p50_ms"]
    print(
        f"{row['batch']:>6} | {row['float32_p50_ms']:>11.2f} {row['float32_p99_ms']:>8.2f} | "
        f"{row['int8_p50_ms']:>9.2f} {row['int8_p99_ms']:>8.2f} | {ratio:>16.2f}",
        flush=True,
    )


def main() -> int:
    parser = parser_for(__doc__)
    parser.add_argument("--float32", type=Path, help="the float32 SavedModel")
    parser.add_argument("--int8", type=Path, help="the int8 SavedModel (--quantize int8)")
    parser.add_argument("--batches", type=integers, default=[1, 64, 2048])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per model and batch")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls first")
    parser.add_argument("--train_batch", type=int, default=4096)
    add_output_flags(parser)
    args = parser.parse_args()
    if (args.float32 is None) != (args.int8 is None):
        parser.error("--float32 and --int8: give both, or neither (to build them)")

    with work_directory("serving_", args.dir) as work:
        if args.float32 is None:
            models = build_models(work, args.train_batch)
        else:
            models = {"float32": args.float32, "int8": args.int8}
        import tensorflow as tf

        cpu = cpu_model() or platform.processor() or "unknown"
        print(f"CPU: {cpu}, {os.cpu_count()} CPUs, TensorFlow {tf.__version__}")
        print_header()
        results = measure(models, args.batches, args.calls, args.warmup)
    figures = {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "tensorflow": tf.__version__,
        "models": "built: the default model"
        if args.float32 is None
        else {name: str(path) for name, path in models.items()},
        "latency": results,
    }
    output = args.json or (args.dir / "serving.json" if args.dir else None)
    if output is not None:
        save(figures, output)
        print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
