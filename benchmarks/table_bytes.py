"""Bytes per table row, samples/s, peak RSS and test AUC of row-wise Adagrad, 16-bit
tables and int8 exports, each against float32 tables, on the same data and seeds.

    python benchmarks/table_bytes.py [--quick] [--repeats 1] [--work DIR] [--json PATH]

Three datasets, each trained on one process (`main.py`, the first `--seed`):

- `demo`: the click log of `examples/demo.py` (`dlrm-synthetic clicklog`, 3 days,
  preprocessed by `dlrm-preprocess` with Spark, the last day the test split), the
  demo's model flags with Adagrad (lr 0.5, batch 1024, 2 epochs; the demo itself
  trains with Adam);
- `byo`: a MovieLens-style CSV written here (user, movie, a list of 1-4 of 20
  genres, two numerical features; clicks drawn from a hidden teacher of user and
  movie latent factors and genre effects), transcoded by `dlrm-transcode` (the
  genres a `hotness: variable` list column), the demo's model with Adagrad (lr 0.5,
  batch 512, 3 epochs);
- `dcnv2`: `dlrm/flagfiles/mlperf_dcnv2_small.flags` on `dlrm-synthetic dataset
  --shape mlperf_dcnv2_small`, with the flagfile's Adam (lr 0.005), one evaluation.

Variants: `float32` (the dataset's optimizer, float32 tables), `rowwise_adagrad`
(float32 tables; Adagrad's lr, on DCNv2 0.1, the flagfile's best Adagrad rate),
`bfloat16` and `float16` (tables stored in 16 bits, the dataset's optimizer),
`rowwise_bfloat16` (both levers at once), and `int8`: the float32 run's checkpoint
exported with `--quantize int8`, scored on the whole test split against the same
checkpoint exported as float32.

Per variant: the training state's bytes per table row (the data bytes of the
checkpoint's embedding files, tables and optimizer slots, over the tables' rows),
the checkpoint's (the embeddings/ directory on disk over the rows), the SavedModel's
(the export summary's `table_bytes` over the rows; the float32 export for the
trained variants), training samples/s (the median of the progress records after
the first; the variants of a dataset run one after another, reversed order on odd
`--repeats`, median over repeats), peak RSS of the process tree, and the test AUC
of the training run's final evaluation (for int8: of the SavedModel).

Prints a table per dataset and writes the figures as JSON (--json; default
table_bytes.json in the work directory). Datasets are kept in the work directory
and reused by the next run of the same size.
"""

from __future__ import annotations

import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from benchmarks.common import (
    last_json_line,
    main_py,
    parser_for,
    progress_rate,
    run_checked,
    save,
)
from benchmarks.serving import cpu_model
from dlrm.app.records import last_record
from harness.export import export_checkpoint
from harness.processes import REPO

BIN = Path(sys.executable).parent
SEED = 0
ADAGRAD_LR = 0.5  # Adagrad's on the demo log and the BYO set, the best of a few probes
DCNV2_FLAGFILE = REPO / "dlrm" / "flagfiles" / "mlperf_dcnv2_small.flags"
TABLE_FILE = re.compile(r"^table_\d+\.rows_\d+_\d+\.cols_\d+_\d+\.npy$")

# name -> (optimizer, or None for the dataset's; embedding dtype)
TRAINED = {
    "float32": (None, "float32"),
    "rowwise_adagrad": ("rowwise_adagrad", "float32"),
    "bfloat16": (None, "bfloat16"),
    "float16": (None, "float16"),
    "rowwise_bfloat16": ("rowwise_adagrad", "bfloat16"),
}


def demo_model_flags() -> list[str]:
    """examples/demo.py's TRAIN_FLAGS (its model), without its optimizer."""
    spec = importlib.util.spec_from_file_location("demo", REPO / "examples" / "demo.py")
    if spec is None or spec.loader is None:
        raise RuntimeError("cannot load examples/demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    dropped = ("--optimizer", "--learning_rate", "--epochs", "--print_freq")
    return [f for f in demo.TRAIN_FLAGS if not f.startswith(dropped)]


@dataclass(frozen=True)
class Dataset:
    """A dataset of the comparison: how to build it and how to train on it."""

    name: str
    build: Callable[[Path], Path]  # a directory -> the split-binary dataset in it
    flags: tuple[str, ...]  # main.py's model and schedule flags
    optimizer: str
    learning_rate: float
    rowwise_learning_rate: float  # for --optimizer rowwise_adagrad
    batch: int
    epochs: int
    train_rows: int


def command(name: str, *args: str) -> list[str]:
    """An installed command of the venv (`make install`)."""
    return [str(BIN / name), *args]


def build_demo(directory: Path, rows_per_day: int) -> Path:
    """The demo's click log, 3 days, preprocessed as examples/demo.py does."""
    raw, dataset = directory / "raw", directory / "dataset"
    if not (dataset / "feature_spec.yaml").exists():
        print(f"demo click log: 3 days x {rows_per_day:,} rows, Spark preprocessing ...")
        clicklog = [f"--output_dir={raw}", "--days=3", f"--rows_per_day={rows_per_day}"]
        run_checked(command("dlrm-synthetic", "clicklog", *clicklog, "--overwrite"))
        preprocess = [f"--input_dir={raw}", f"--output_dir={dataset}", "--train_days=0-1"]
        preprocess += ["--test_days=2", "--frequency_threshold=3"]
        run_checked(command("dlrm-preprocess", *preprocess), timeout=3600)
    return dataset


BYO_SPEC = """\
channel_spec:
  label: [clicked]
  numerical: [user_age, movie_year]
  categorical: [user, movie, genres]
feature_spec:
  clicked: {dtype: bool}
  user_age: {dtype: float16}
  movie_year: {dtype: float16}
  user: {dtype: int32, cardinality: auto}
  movie: {dtype: int32, cardinality: auto}
  genres: {dtype: int32, cardinality: auto, hotness: variable}
metadata: {dataset: MovieLens-style clicks (benchmarks/table_bytes.py)}
source_spec:
  train:
  - {type: csv, features: [user, movie, genres, user_age, movie_year, clicked], files: [train.csv]}
  test:
  - {type: csv, features: [user, movie, genres, user_age, movie_year, clicked], files: [test.csv]}
"""


def write_movielens_csv(raw: Path, train_rows: int, test_rows: int) -> float:
    """train.csv and test.csv of MovieLens-style clicks; returns the teacher's test AUC.

    Users and movies are drawn with Zipf-like popularity; each has 8 latent factors,
    each movie 1-4 of 20 genres, each user a taste per genre. The click probability
    is the logistic of the factors' dot product, the user's taste for the movie's
    genres, a movie bias and the age and year effects."""
    from dlrm.evaluation.metrics import roc_auc

    rng = np.random.default_rng(SEED)
    users, movies, genres, factors = 6_000, 2_000, 20, 8
    user_factors = rng.normal(0, 1, (users, factors))
    movie_factors = rng.normal(0, 1, (movies, factors))
    taste = rng.normal(0, 0.7, (users, genres))
    movie_bias = rng.normal(0, 0.6, movies)
    counts = rng.integers(1, 5, movies)
    movie_genres = [rng.choice(genres, c, replace=False) for c in counts]
    ages = rng.integers(16, 70, users)
    years = rng.integers(1950, 2024, movies)
    rows = train_rows + test_rows
    user = np.minimum(rng.zipf(1.3, rows) - 1, users - 1)
    user = rng.permutation(users)[user]  # popular ids are not the small ones
    movie = rng.permutation(movies)[np.minimum(rng.zipf(1.2, rows) - 1, movies - 1)]
    affinity = np.einsum("rf,rf->r", user_factors[user], movie_factors[movie]) / np.sqrt(factors)
    genre_effect = np.array(
        [taste[u, movie_genres[m]].mean() for u, m in zip(user, movie, strict=True)]
    )
    logit = 1.2 * affinity + genre_effect + movie_bias[movie] - 1.0
    logit += 0.3 * (years[movie] > 2000) - 0.01 * (ages[user] - 40)
    probability = 1 / (1 + np.exp(-logit))
    clicked = rng.random(rows) < probability
    raw.mkdir(parents=True, exist_ok=True)
    lines = [
        f"u{u},m{m},{'|'.join(f'g{g}' for g in movie_genres[m])},{ages[u]},{years[m]},{int(c)}"
        for u, m, c in zip(user, movie, clicked, strict=True)
    ]
    (raw / "train.csv").write_text("\n".join(lines[:train_rows]) + "\n")
    (raw / "test.csv").write_text("\n".join(lines[train_rows:]) + "\n")
    (raw / "spec.yaml").write_text(BYO_SPEC)
    return roc_auc(clicked[train_rows:], probability[train_rows:])


def build_byo(directory: Path, train_rows: int, test_rows: int) -> Path:
    """The MovieLens-style CSV and spec.yaml, transcoded by dlrm-transcode."""
    raw, dataset = directory / "raw", directory / "dataset"
    if not (dataset / "feature_spec.yaml").exists():
        print(f"MovieLens-style CSV: {train_rows:,} + {test_rows:,} rows, dlrm-transcode ...")
        teacher_auc = write_movielens_csv(raw, train_rows, test_rows)
        (directory / "teacher_auc.txt").write_text(f"{teacher_auc}\n")
        transcode = [f"--feature_spec={raw / 'spec.yaml'}", f"--output_dir={dataset}"]
        transcode += ["--frequency_threshold=2", "--log_transform", "--spark_master=local[2]"]
        run_checked(command("dlrm-transcode", *transcode, "--overwrite"), timeout=3600)
    return dataset


def build_dcnv2(directory: Path, train_rows: int, test_rows: int) -> Path:
    """The flagfile's synthetic dataset (the command in its header)."""
    dataset = directory / "dataset"
    if not (dataset / "feature_spec.yaml").exists():
        print(f"DCNv2 synthetic dataset: {train_rows:,} + {test_rows:,} rows ...")
        rows = [f"--train_rows={train_rows}", f"--test_rows={test_rows}"]
        shape = ["--shape=mlperf_dcnv2_small", f"--output_dir={dataset}", "--overwrite"]
        run_checked(command("dlrm-synthetic", "dataset", *shape, *rows), timeout=3600)
    return dataset


def datasets(quick: bool) -> list[Dataset]:
    """The three datasets at full size, or smaller under --quick."""
    per_day = 120_000 if quick else 340_000
    byo_rows = (60_000, 15_000) if quick else (200_000, 50_000)
    dcnv2_rows = (100_000, 25_000) if quick else (400_000, 50_000)
    demo = tuple(demo_model_flags())
    return [
        Dataset(
            name="demo",
            build=lambda d: build_demo(d / f"demo_3x{per_day}", per_day),
            flags=demo,
            optimizer="adagrad",
            learning_rate=ADAGRAD_LR,
            rowwise_learning_rate=ADAGRAD_LR,
            batch=1024,
            epochs=2,
            train_rows=2 * per_day,
        ),
        Dataset(
            name="byo",
            build=lambda d: build_byo(d / f"byo_{byo_rows[0]}", *byo_rows),
            flags=demo,
            optimizer="adagrad",
            learning_rate=ADAGRAD_LR,
            rowwise_learning_rate=ADAGRAD_LR,
            batch=512,
            epochs=3,
            train_rows=byo_rows[0],
        ),
        Dataset(
            name="dcnv2",
            build=lambda d: build_dcnv2(d / f"dcnv2_{dcnv2_rows[0]}", *dcnv2_rows),
            flags=(f"--flagfile={DCNV2_FLAGFILE}", "--evals_per_epoch=1"),
            optimizer="adam",
            learning_rate=0.005,
            rowwise_learning_rate=0.1,  # the flagfile's best Adagrad rate (0.2 diverged)
            batch=4096,
            epochs=1,
            train_rows=dcnv2_rows[0],
        ),
    ]


def newest_checkpoint(root: Path) -> Path:
    steps = sorted(root.glob("step_*"))
    if not steps:
        raise RuntimeError(f"{root}: no checkpoint")
    return steps[-1]


def checkpoint_bytes(root: Path) -> dict[str, int]:
    """The newest checkpoint's table rows, the data bytes of its tables and their
    optimizer slots (the .npy payloads), and the bytes of its embeddings/ on disk."""
    embeddings = newest_checkpoint(root) / "embeddings"
    rows = state = on_disk = 0
    for path in sorted(embeddings.iterdir()):
        array = np.load(path, mmap_mode="r")
        state += array.nbytes
        on_disk += path.stat().st_size
        if TABLE_FILE.match(path.name):
            rows += array.shape[0]
    return {"table_rows": rows, "state_bytes": state, "checkpoint_bytes": on_disk}


def train(dataset: Dataset, data: Path, work: Path, variant: str) -> dict[str, Any]:
    """One training run of `variant` with a checkpoint at the end."""
    optimizer, dtype = TRAINED[variant]
    learning_rate = dataset.learning_rate if optimizer is None else dataset.rowwise_learning_rate
    steps = dataset.epochs * dataset.train_rows // dataset.batch
    checkpoints = work / "checkpoints"
    flags = [
        *dataset.flags,
        f"--optimizer={optimizer or dataset.optimizer}",
        f"--learning_rate={learning_rate}",
        f"--embedding_dtype={dtype}",
        f"--batch_size={dataset.batch}",
        f"--epochs={dataset.epochs}",
        f"--print_freq={max(1, steps // 10)}",
        f"--seed={SEED}",
        f"--save_checkpoint_path={checkpoints}",
    ]
    started = time.perf_counter()
    log, peak = main_py(data, work, 1, *flags)
    summary = last_record(log, "summary")
    return {
        "optimizer": optimizer or dataset.optimizer,
        "learning_rate": learning_rate,
        "embedding_dtype": dtype,
        **progress_rate(log, peak),
        "auc": float(summary["auc"]),
        "wall_s": time.perf_counter() - started,
        **checkpoint_bytes(checkpoints),
        "checkpoints": str(checkpoints),
    }


# Scores SavedModels on a dataset's whole test split (argv: dataset, models...);
# prints their AUCs (`dlrm.evaluation.metrics.roc_auc`) as a JSON list.
SCORER = """
import json, sys
import numpy as np, tensorflow as tf
from dataloading.split_binary import ShardSpec, SplitBinaryDataset
from dlrm.evaluation.metrics import roc_auc
from dlrm.model.export import serving_inputs
from feature_spec import FeatureSpec
dataset, models = sys.argv[1], sys.argv[2:]
spec = FeatureSpec.load(dataset + "/feature_spec.yaml")
data = SplitBinaryDataset(spec, "test", ShardSpec(8192), last_batch="pad")  # every row
serves = [tf.saved_model.load(m).signatures["serving_default"] for m in models]
labels, scores = [], [[] for _ in models]
for index in range(data.num_batches):
    batch = data.read_batch(index)
    keep = np.asarray(batch.weight).reshape(-1) > 0
    feeds = serving_inputs(batch.categorical, spec.cardinalities)
    feeds["numerical"] = np.asarray(batch.numerical)
    feeds = {name: tf.constant(value) for name, value in feeds.items()}
    labels.append(np.asarray(batch.label).reshape(-1)[keep])
    for found, serve in zip(scores, serves):
        found.append(serve(**feeds)["probability"].numpy().reshape(-1)[keep])
labels = np.concatenate(labels)
print(json.dumps([roc_auc(labels, np.concatenate(found)) for found in scores]))
"""


def exports(data: Path, float32_run: dict[str, Any], work: Path) -> dict[str, Any]:
    """The float32 run's checkpoint exported as float32 and int8, both scored."""
    checkpoints = Path(float32_run["checkpoints"])
    models, table_bytes = [], {}
    for quantize in ("none", "int8"):
        output = work / f"saved_model_{quantize}"
        summary = export_checkpoint(checkpoints, output, f"--quantize={quantize}", timeout=1800)
        models.append(str(output))
        table_bytes[quantize] = int(summary["table_bytes"])
    aucs = last_json_line(run_checked([sys.executable, "-c", SCORER, str(data), *models]))
    return {
        "float32_table_bytes": table_bytes["none"],
        "int8_table_bytes": table_bytes["int8"],
        "float32_saved_model_auc": aucs[0],
        "int8_saved_model_auc": aucs[1],
    }


def run_dataset(dataset: Dataset, work: Path, repeats: int) -> dict[str, Any]:
    """Every variant of `dataset`; the figures by variant."""
    data = dataset.build(work)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in TRAINED}
    for repeat in range(repeats):
        order = list(TRAINED) if repeat % 2 == 0 else list(reversed(TRAINED))
        for variant in order:
            run_dir = work / "runs" / dataset.name / f"{variant}_{repeat}"
            run_dir.mkdir(parents=True, exist_ok=True)
            print(f"  {dataset.name}: training {variant} (repeat {repeat + 1}/{repeats}) ...")
            runs[variant].append(train(dataset, data, run_dir, variant))
    figures = {name: dict(found[0]) for name, found in runs.items()}
    for name, found in runs.items():
        figures[name]["samples_per_second"] = statistics.median(
            r["samples_per_second"] for r in found
        )
        figures[name]["samples_per_second_runs"] = [r["samples_per_second"] for r in found]
        figures[name]["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in found)
    print(f"  {dataset.name}: exporting float32 and int8, scoring the test split ...")
    exported = exports(data, figures["float32"], work / "runs" / dataset.name)
    rows = figures["float32"]["table_rows"]
    for name in TRAINED:
        figures[name]["saved_model_bytes_per_row"] = exported["float32_table_bytes"] / rows
    figures["int8"] = {
        "saved_model_bytes_per_row": exported["int8_table_bytes"] / rows,
        "auc": exported["int8_saved_model_auc"],
        "float32_saved_model_auc": exported["float32_saved_model_auc"],
    }
    for trained in figures.values():
        if "state_bytes" in trained:
            trained["state_bytes_per_row"] = trained["state_bytes"] / trained["table_rows"]
            trained["checkpoint_bytes_per_row"] = (
                trained["checkpoint_bytes"] / trained["table_rows"]
            )
    info: dict[str, Any] = {"dataset": str(data), "table_rows": rows, "variants": figures}
    teacher = data.parent / "teacher_auc.txt"
    if teacher.exists():
        info["teacher_auc"] = float(teacher.read_text())
    return info


def print_table(name: str, info: dict[str, Any]) -> None:
    figures = info["variants"]
    base = figures["float32"]
    print(f"\n{name}: {info['table_rows']:,} table rows ({info['dataset']})")
    header = (
        f"{'variant':<17} {'optimizer':<16} {'state B/row':>11} {'ckpt B/row':>10} "
        f"{'SavedModel B/row':>16} {'samples/s':>10} {'x f32':>6} {'peak RSS':>9} "
        f"{'test AUC':>8} {'dAUC':>9}"
    )
    print(header)
    for variant, found in figures.items():
        if variant == "int8":
            reference = found["float32_saved_model_auc"]
            print(
                f"{'int8 (export)':<17} {'-':<16} {'-':>11} {'-':>10} "
                f"{found['saved_model_bytes_per_row']:>16.1f} {'-':>10} {'-':>6} {'-':>9} "
                f"{found['auc']:>8.4f} {found['auc'] - reference:>+9.5f}"
            )
            print(f"  (the float32 export scores {reference:.4f} on the same test split)")
            continue
        ratio = found["samples_per_second"] / base["samples_per_second"]
        print(
            f"{variant:<17} {found['optimizer']:<16} {found['state_bytes_per_row']:>11.1f} "
            f"{found['checkpoint_bytes_per_row']:>10.1f} "
            f"{found['saved_model_bytes_per_row']:>16.1f} {found['samples_per_second']:>10,.0f} "
            f"{ratio:>6.2f} {found['peak_rss_bytes'] / 2**20:>6.0f}MiB "
            f"{found['auc']:>8.4f} {found['auc'] - base['auc']:>+9.5f}"
        )


def main() -> int:
    parser = parser_for(__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller datasets (minutes)")
    parser.add_argument("--repeats", type=int, default=1, help="training runs per variant")
    parser.add_argument(
        "--datasets", default="demo,byo,dcnv2", help="comma-separated: demo, byo, dcnv2"
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "dlrm_table_bytes",
        help="datasets, runs and the JSON (kept; datasets reused)",
    )
    parser.add_argument("--json", type=Path, help="where to write the figures")
    args = parser.parse_args()
    chosen = [d for d in datasets(args.quick) if d.name in args.datasets.split(",")]
    if not chosen or args.repeats < 1:
        parser.error("--datasets: expected some of demo,byo,dcnv2; --repeats: at least 1")
    output = args.json or args.work / "table_bytes.json"
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "repeats": args.repeats,
        "seed": SEED,
        "datasets": {},
    }
    started = time.perf_counter()
    for dataset in chosen:
        print(f"== {dataset.name}", flush=True)
        results["datasets"][dataset.name] = run_dataset(dataset, args.work, args.repeats)
        results["wall_s"] = time.perf_counter() - started
        save(results, output)
    for name, info in results["datasets"].items():
        print_table(name, info)
    print(f"\n{time.perf_counter() - started:.0f} s; wrote {output}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RuntimeError, subprocess.SubprocessError) as error:
        print(f"table_bytes: {error}", file=sys.stderr)
        sys.exit(1)
