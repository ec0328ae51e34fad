"""One command that proves the GPU paths on this machine (`make gpu-check`).

    python benchmarks/gpu_check.py [--small] [--rows 100000] [--embedding_dim 128]
        [--batch_size 65536] [--steps 50] [--json benchmarks/gpu_check.json] [--dir DIR]

On one process, with synthetic data generated once, it checks:

- the default model (26 tables x 100,000 rows x 128, bottom 512-256-128, top
  1024-1024-512-256-1, SGD, batch 65536) trained `--steps` steps in each of
  fp32 (TF32 on Ampere and later), `--amp`, `--xla` and `--amp --xla`: that
  the run exits 0 with every progress loss finite, that the loss falls (the
  mean of the last losses, `LOSS_WINDOW`, below the first step's), with its
  samples/s (the median of the progress records after the first, as
  `common.progress_rate` reads them) and its peak memory (the run's summary:
  the GPU allocator's peak, or the process's peak RSS without a GPU);
- the same fp32 steps on the CPU (`CUDA_VISIBLE_DEVICES=-1`) from the same
  seed on the same data: every array of the two final checkpoints within
  `weights_tolerance` of each other. Without a GPU, the `--xla` run against the
  fp32 one instead (another code path at the same precision);
- the small DLRM-DCNv2 (`mlperf_dcnv2_small.flags`) on its synthetic dataset:
  its test AUC above `Sizes.dcnv2_min_auc`;
- a SavedModel exported from the fp32 run (`--mode export`) and scored on the
  CPU in a fresh process over the test split: its AUC within
  `EXPORT_AUC_TOLERANCE` of the run's own final evaluation;
- the plain TensorFlow loop (`benchmarks/plain_tf.py`) beside ours, fp32 and
  `--amp`: their ratio (reported, not checked; the plain loop's `--amp` is
  bfloat16 everywhere, ours float16 on GPUs).

Prints one table and writes the figures as JSON (`--json`). Without a GPU the
same checks run on the CPU path, which the table's first line and the JSON
(`"gpu": false`) say. `--small` shrinks everything to a CI's size (26 x 1,000
x 16, small MLPs, batch 1024, 20 steps; about 2 minutes on 2 cores). Exits 1
when any check fails (the table still printed, the failing check marked FAIL).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.common import (
    LEARNING_RATES,
    REPO,
    TIMEOUT_S,
    VARIANTS,
    child_env,
    cpu_model,
    integers,
    last_json_line,
    parser_for,
    plain_rate,
    save,
    variant_flags,
    work_directory,
)
from dlrm.app.records import read_records

SEED = 7
NO_GPU_LINE = "no GPU seen: these are the CPU path's checks"
# The loss falls: the mean of the last LOSS_WINDOW progress losses (a quarter of
# them when fewer than 40) below the first step's, which is the initial model's.
LOSS_WINDOW = 10

# Unit roundoff: half an ulp of 1 with a p-bit significand, 2^-p.
TF32_UNIT_ROUNDOFF = 2.0**-11  # 10 stored mantissa bits: matmul inputs rounded to 11 bits
FP32_UNIT_ROUNDOFF = 2.0**-24  # 23 stored bits


def weights_tolerance(longest_dot: int, unit_roundoff: float) -> float:
    """The largest relative difference, ||a - b|| / ||b|| over each array of two
    checkpoints, allowed between two runs of the same steps that round differently.

    A dot product of K terms whose factors are rounded with unit roundoff u (TF32:
    each input to 11 bits, relative error <= 2^-11, the product then exact and
    summed in float32; fp32 against fp32 in another order: 2^-24 per addition)
    has an error of about sqrt(K) * u of its size: K independent errors of at
    most u each add up as a random walk (Higham's probabilistic bound; the
    worst case, K * u, needs every error of one sign). Each step's gradient is
    such products chained through the layers, so each step's update is off by
    about that share of itself, and the S steps' updates, summed into the
    weights, by that share of the total update, which is smaller than the weights
    themselves: ||a - b|| / ||b|| <= sqrt(K) * u, K the model's longest dot
    product (its widest layer input). The weight gradients' sums over the batch
    are longer, but are means of per-sample terms whose errors are independent:
    the mean's error shrinks with the mean, about u of it. The default model
    (K = 1024, the top MLP's) gets 32 * 2^-11 = 1/64 under TF32, 32 * 2^-24 =
    1.9e-6 in fp32; the small one (K = 367, the interaction's output) 19.2 *
    2^-24 = 1.1e-6 (--xla against fp32 measured 1.5e-7 on an AMD EPYC). The norm
    over an array, not each element: a weight near zero has no relative
    precision, and a ReLU input within rounding of zero that switches sides moves
    one unit's weights far; the norm takes both as the small share of the array
    they are.
    """
    return math.sqrt(longest_dot) * unit_roundoff


# The exported model scored on the CPU in float32 against the run's own final
# evaluation (the same weights; on a GPU, computed in TF32). The AUC moves only
# by the (positive, negative) pairs whose order flips: two predictions closer
# than their error d. With the logits spread over a few units (their density of
# pairwise differences at 0 about 0.3 per unit), about 0.6 * d of the pairs lie
# that close, and of those the flips go either way. TF32: the logits' rms error
# is about u * sqrt(layers) ~ 2^-11 * 3 of logits of a few units: d ~ 3e-3, so
# 2e-3 bounds the AUC's move; fp32 (a CPU's run, other kernels): d ~ 1e-6, and
# 1e-5 allows a few flipped pairs of a small test split's (~3 million pairs).
EXPORT_AUC_TOLERANCE = {"gpu": 2e-3, "cpu": 1e-5}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The model, data and run lengths of a check."""

    tables: int = 26
    rows: int = 100_000
    embedding_dim: int = 128
    bottom: tuple[int, ...] = (512, 256, 128)
    top: tuple[int, ...] = (1024, 1024, 512, 256, 1)
    batch_size: int = 65536
    steps: int = 50
    test_rows: int = 65536
    dcnv2_train_rows: int = 400_000  # the flagfile's dataset: 97 steps of 4096
    dcnv2_test_rows: int = 50_000
    # The flagfile reached 0.835 on its dataset (its teacher's AUC is 0.854).
    dcnv2_min_auc: float = 0.8

    @property
    def longest_dot(self) -> int:
        """The widest input of any dense layer: the longest dot product of a step."""
        tables = self.tables
        interaction = self.embedding_dim + (tables + 1) * tables // 2
        return max(13, *self.bottom[:-1], interaction, *self.top[:-1])

    def model_flags(self) -> list[str]:
        return [
            f"--embedding_dim={self.embedding_dim}",
            f"--bottom_mlp_dims={','.join(map(str, self.bottom))}",
            f"--top_mlp_dims={','.join(map(str, self.top))}",
        ]


# A CI's size: the whole check in about 95 s on 2 cores. DLRM-DCNv2 on 100,000
# rows (24 steps, about 10 s) reached test AUC 0.765, 0.791 and 0.790 with seeds 1,
# 2 and 7 (60,000 rows: 0.713 and 0.723); 0.7 leaves room for other CPUs' rounding.
SMALL = Sizes(
    rows=1000,
    embedding_dim=16,
    bottom=(64, 32, 16),
    top=(256, 128, 1),
    batch_size=1024,
    steps=20,
    test_rows=4096,
    dcnv2_train_rows=100_000,
    dcnv2_test_rows=20_000,
    dcnv2_min_auc=0.7,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = parser_for(__doc__)
    parser.add_argument("--small", action="store_true", help="a CI's size (see above)")
    parser.add_argument("--rows", type=int, help="rows per table (default 100000)")
    parser.add_argument("--embedding_dim", type=int, help="embedding width (default 128)")
    parser.add_argument("--bottom", type=integers, help="bottom MLP (default 512,256,128)")
    parser.add_argument("--top", type=integers, help="top MLP (default 1024,1024,512,256,1)")
    parser.add_argument("--batch_size", type=int, help="default 65536")
    parser.add_argument("--steps", type=int, help="training steps per variant (default 50)")
    parser.add_argument("--dir", type=Path, help="where to work (default: a temporary directory)")
    parser.add_argument(
        "--json",
        type=Path,
        default=REPO / "benchmarks" / "gpu_check.json",
        help="where to write the figures (default benchmarks/gpu_check.json)",
    )
    parser.add_argument("--worker_score", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = SMALL if args.small else Sizes()
    changes: dict[str, Any] = {
        name: tuple(value) if isinstance(value, list) else value
        for name in ("rows", "embedding_dim", "bottom", "top", "batch_size", "steps")
        if (value := getattr(args, name)) is not None
    }
    args.sizes = dataclasses.replace(sizes, **changes)
    if args.sizes.steps < 2 or args.sizes.batch_size < 1 or args.sizes.rows < 1:
        parser.error("--steps: expected at least 2; --batch_size, --rows: at least 1")
    if args.sizes.embedding_dim != args.sizes.bottom[-1]:
        parser.error("--bottom: the last width must equal --embedding_dim (dot interaction)")
    return args


# ------------------------------------------------------------------ the device


def gpu_seen() -> bool:
    """Whether TensorFlow sees a GPU (it allocates nothing on it to say so)."""
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def device_name(gpu: bool) -> str:
    """The GPU as nvidia-smi names it (with its memory), else the CPU's model."""
    if gpu and shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True, timeout=60)
        if done.returncode == 0 and done.stdout.strip():
            return "; ".join(line.strip() for line in done.stdout.strip().splitlines())
    model = cpu_model()
    return f"{model} ({os.cpu_count()} CPUs)" if model else f"{os.cpu_count()} CPUs"


# ------------------------------------------------------------------ the runs


@dataclasses.dataclass
class Check:
    """One pass/fail line of the table."""

    name: str
    passed: bool
    value: str
    limit: str
    detail: str = ""


def run_main(
    work: Path, name: str, flags: Sequence[str], env: dict[str, str] | None = None
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`main.py FLAGS` with its metrics log in `work`; (the log, the finished process)."""
    log = work / f"{name}.jsonl"
    command = [sys.executable, "main.py", f"--log_path={log}", *flags]
    print(f"{name}: main.py {' '.join(flags)}", flush=True)
    done = subprocess.run(
        command,
        cwd=REPO,
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if done.returncode != 0:
        print(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}", flush=True)
    return log, done


def training_figures(log: Path, returncode: int) -> dict[str, Any]:
    """What one training run shows: exit code, samples/s, peak memory, losses, AUC."""
    progress = read_records(log, "train")
    losses = [float(r["loss"]) for r in progress]
    summaries = read_records(log, "summary")
    summary = summaries[-1] if summaries else {}
    window = min(LOSS_WINDOW, max(1, len(losses) // 4))
    rates = [r["samples_per_second"] for r in progress][1:]
    return {
        "returncode": returncode,
        "steps": summary.get("steps", len(losses)),
        "samples_per_second": statistics.median(rates) if rates else 0.0,
        "peak_memory_bytes": summary.get("peak_memory_bytes"),
        "peak_memory_of": summary.get("peak_memory_of"),
        "first_loss": losses[0] if losses else math.nan,
        "last_loss_mean": statistics.fmean(losses[-window:]) if losses else math.nan,
        "loss_window": window,
        "finite": bool(losses) and all(math.isfinite(x) for x in losses),
        "auc": summary.get("auc"),
        "logloss": summary.get("logloss"),
        "checkpoint": summary.get("checkpoint"),
    }


def train_variant(
    sizes: Sizes,
    dataset: Path,
    work: Path,
    name: str,
    variant: str,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`steps` steps of the model in `variant`, from the same seed on the same
    data every time; a checkpoint of the last for fp32 and --xla (compared,
    exported)."""
    flags = [f"--dataset_path={dataset}", f"--batch_size={sizes.batch_size}"]
    flags += [f"--max_steps={sizes.steps}", "--print_freq=1", f"--seed={SEED}"]
    flags += ["--optimizer=sgd", f"--learning_rate={LEARNING_RATES['sgd']}"]
    flags += ["--warmup_steps=0", "--decay_start_step=0", *sizes.model_flags()]
    if not VARIANTS[variant][0]:  # the full model's checkpoint is 1.3 GB; amp's is unused
        flags += [f"--save_checkpoint_path={work / ('checkpoints_' + name)}"]
    log, done = run_main(work, name, [*flags, *variant_flags(variant)], env)
    return {"variant": variant} | training_figures(log, done.returncode)


def variant_checks(name: str, figures: dict[str, Any], steps: int) -> list[Check]:
    exited = figures["returncode"] == 0 and figures["steps"] == steps
    first, last = figures["first_loss"], figures["last_loss_mean"]
    return [
        Check(
            f"{name}: trains, every loss finite",
            exited and figures["finite"],
            f"exit {figures['returncode']}, {figures['steps']} steps",
            f"exit 0, {steps} steps, finite",
        ),
        Check(
            f"{name}: loss falls",
            exited and last < first,
            f"{first:.4f} -> {last:.4f}",
            f"mean of last {figures['loss_window']} < first",
        ),
    ]


def relative_differences(actual: str, expected: str) -> dict[str, float]:
    """||a - b|| / ||b|| for every array two checkpoints hold (weights and
    optimizer state), by name."""
    import numpy as np

    from dlrm.checkpoint.reader import Checkpoint
    from harness.checkpoints import checkpoint_arrays

    ours, theirs = checkpoint_arrays(Checkpoint(actual)), checkpoint_arrays(Checkpoint(expected))
    if sorted(ours) != sorted(theirs):
        raise ValueError(f"{actual} and {expected} hold different arrays")
    differences = {}
    for name, b in theirs.items():
        a = ours[name].astype(np.float64)
        b = b.astype(np.float64)
        norm = float(np.linalg.norm(b))
        difference = float(np.linalg.norm(a - b))
        differences[name] = difference / norm if norm else difference
    return differences


def compare_weights(
    name: str, actual: dict[str, Any], expected: dict[str, Any], tolerance: float
) -> tuple[dict[str, Any], Check]:
    figures: dict[str, Any] = {"tolerance": tolerance}
    if not (actual["checkpoint"] and expected["checkpoint"]):
        figures["error"] = "a run wrote no checkpoint"
        return figures, Check(name, False, "no checkpoint", f"<= {tolerance:.3g}")
    differences = relative_differences(actual["checkpoint"], expected["checkpoint"])
    worst = max(differences, key=lambda k: differences[k])
    figures |= {"max_relative_difference": differences[worst], "worst_array": worst}
    figures["auc_difference"] = abs((actual["auc"] or 0.0) - (expected["auc"] or 0.0))
    passed = differences[worst] <= tolerance
    value = f"{differences[worst]:.3g} ({worst})"
    return figures, Check(name, passed, value, f"<= {tolerance:.3g}", "||a-b||/||b|| per array")


def train_dcnv2(sizes: Sizes, work: Path) -> tuple[dict[str, Any], Check]:
    """The small DLRM-DCNv2 flagfile on its synthetic dataset: its test AUC."""
    from dataloading.synthetic import SHAPES, generate_split_binary

    cardinalities, hotness = SHAPES["mlperf_dcnv2_small"]
    rows = {"train": sizes.dcnv2_train_rows, "test": sizes.dcnv2_test_rows}
    print(f"generating the DLRM-DCNv2 dataset ({rows}) ...", flush=True)
    dataset = work / "dcnv2_data"
    generate_split_binary(dataset, cardinalities, hotness=hotness, rows=rows, seed=0)
    flags = ["--flagfile=mlperf_dcnv2_small.flags", f"--dataset_path={dataset}"]
    flags += ["--evals_per_epoch=1", f"--seed={SEED}"]
    log, done = run_main(work, "dcnv2", flags)
    figures = training_figures(log, done.returncode)
    auc = figures["auc"] or 0.0
    check = Check(
        "DLRM-DCNv2 (small): test AUC",
        done.returncode == 0 and figures["finite"] and auc > sizes.dcnv2_min_auc,
        f"{auc:.4f}",
        f"> {sizes.dcnv2_min_auc}",
    )
    return figures, check


def export_and_score(
    work: Path, dataset: Path, fp32: dict[str, Any], device: str
) -> tuple[dict[str, Any], Check]:
    """The fp32 run's checkpoint exported, then scored on the CPU in a fresh process."""
    tolerance = EXPORT_AUC_TOLERANCE[device]
    name = f"export: CPU score of the {device.upper()} run"
    figures: dict[str, Any] = {"tolerance": tolerance, "run_auc": fp32["auc"]}
    saved_model = work / "saved_model"
    flags = ["--mode=export", f"--restore_checkpoint_path={fp32['checkpoint']}"]
    flags += [f"--saved_model_output_path={saved_model}"]
    _, exported = run_main(work, "export", flags)
    if exported.returncode != 0 or not fp32["checkpoint"]:
        figures["error"] = f"export failed ({exported.returncode})"
        return figures, Check(name, False, "export failed", f"|AUC diff| <= {tolerance:g}")
    command = [sys.executable, __file__, "--worker_score", str(saved_model), str(dataset)]
    done = subprocess.run(
        command,
        cwd=REPO,
        env=child_env({"CUDA_VISIBLE_DEVICES": "-1"}),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if done.returncode != 0:
        figures["error"] = f"scoring failed ({done.returncode}): {done.stderr[-2000:]}"
        return figures, Check(name, False, "scoring failed", f"|AUC diff| <= {tolerance:g}")
    scored = last_json_line(done.stdout)
    difference = abs(scored["auc"] - (fp32["auc"] or 0.0))
    figures |= {"cpu_auc": scored["auc"], "cpu_logloss": scored["logloss"]}
    figures |= {"samples": scored["samples"], "auc_difference": difference}
    value = f"{scored['auc']:.5f} vs {fp32['auc'] or 0.0:.5f}"
    return figures, Check(name, difference <= tolerance, value, f"|diff| <= {tolerance:g}")


def score_worker(saved_model: Path, dataset: Path) -> None:
    """Prints the SavedModel's AUC and logloss over the test split (run in a
    fresh process, on the CPU: `CUDA_VISIBLE_DEVICES=-1`)."""
    import numpy as np
    import tensorflow as tf

    from dataloading.split_binary import LastBatch, ShardSpec, SplitBinaryDataset
    from dlrm.evaluation.metrics import evaluate
    from dlrm.model.export import serving_inputs
    from feature_spec import FeatureSpec

    spec = FeatureSpec.load(dataset / "feature_spec.yaml")
    test = SplitBinaryDataset(spec, "test", ShardSpec(8192), last_batch=LastBatch.PAD)
    serve = tf.saved_model.load(str(saved_model)).signatures["serving_default"]
    labels, probabilities = [], []
    for index in range(test.num_batches):
        batch = test.read_batch(index)
        inputs = {"numerical": np.asarray(batch.numerical, np.float32)}
        inputs |= serving_inputs(batch.categorical, spec.cardinalities)
        served = serve(**{k: tf.constant(v) for k, v in inputs.items()})["probability"].numpy()
        real = np.asarray(batch.weight).reshape(-1) > 0
        labels.append(np.asarray(batch.label).reshape(-1)[real])
        probabilities.append(served.reshape(-1)[real])
    result = evaluate(np.concatenate(labels), np.concatenate(probabilities))
    print(json.dumps({"auc": result.auc, "logloss": result.logloss, "samples": result.samples}))


def plain_beside_ours(
    sizes: Sizes, variants: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The plain loop, fp32 and --amp, at the same sizes: samples/s and ours / plain."""
    figures = {}
    for variant in ("fp32", "amp"):
        flags = [f"--batch_size={sizes.batch_size}", f"--steps={sizes.steps - 1}", "--warmup=1"]
        flags += [f"--tables={sizes.tables}", f"--rows={sizes.rows}"]
        flags += [f"--embedding_dim={sizes.embedding_dim}"]
        flags += [f"--bottom={','.join(map(str, sizes.bottom))}"]
        flags += [f"--top={','.join(map(str, sizes.top))}"]
        print(f"plain TensorFlow loop {variant} ...", flush=True)
        try:
            plain = plain_rate(*flags, *variant_flags(variant, plain=True))
        except RuntimeError as error:
            figures[variant] = {"error": str(error)[-2000:]}
            continue
        ours = variants[variant]["samples_per_second"]
        figures[variant] = plain | {"ratio": ours / plain["samples_per_second"]}
    return figures


# ------------------------------------------------------------------ the report


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def table(results: dict[str, Any]) -> str:
    """The variants' figures, then every check with its limit and PASS or FAIL."""
    lines = [f"gpu-check on {results['device_name']} ({results['device']})"]
    if not results["gpu"]:
        lines.append(NO_GPU_LINE)
    sizes = results["sizes"]
    lines.append(
        f"model: {sizes['tables']} tables x {sizes['rows']:,} x {sizes['embedding_dim']}, "
        f"bottom {sizes['bottom']}, top {sizes['top']}, batch {sizes['batch_size']:,}, "
        f"{sizes['steps']} steps"
    )
    header = f"{'variant':<9} {'samples/s':>12} {'plain':>12} {'ratio':>6} "
    header += f"{'peak memory':>18} {'loss first -> last':>20} {'test AUC':>9}"
    lines += ["", header, "-" * len(header)]
    for name, row in results["variants"].items():
        plain = results["plain"].get(name, {})
        plain_rate_text = f"{plain['samples_per_second']:,.0f}" if "ratio" in plain else "-"
        ratio = f"{plain['ratio']:.2f}" if "ratio" in plain else "-"
        memory = gib(row["peak_memory_bytes"])
        if row["peak_memory_of"]:
            memory += " " + ("GPU" if row["peak_memory_of"] == "gpu" else "RSS")
        losses = f"{row['first_loss']:.4f} -> {row['last_loss_mean']:.4f}"
        auc = f"{row['auc']:.4f}" if row["auc"] is not None else "-"
        lines.append(
            f"{name:<9} {row['samples_per_second']:>12,.0f} {plain_rate_text:>12} {ratio:>6} "
            f"{memory:>18} {losses:>20} {auc:>9}"
        )
    for name, plain in results["plain"].items():
        if "error" in plain:
            lines.append(f"the plain loop {name} failed: {plain['error'].splitlines()[-1]}")
    lines += ["", f"comparison: {results['comparison']['what']}", ""]
    width = max(len(c["name"]) for c in results["checks"])
    for check in results["checks"]:
        mark = "PASS" if check["passed"] else "FAIL"
        lines.append(
            f"{mark}  {check['name']:<{width}}  {check['value']}  ({check['limit']})"
            + (f"  {check['detail']}" if check["detail"] else "")
        )
    failed = [c["name"] for c in results["checks"] if not c["passed"]]
    lines.append("")
    lines.append(f"FAILED: {', '.join(failed)}" if failed else "all checks passed")
    return "\n".join(lines)


def finish(results: dict[str, Any], checks: list[Check], output: Path) -> int:
    """Writes the JSON, prints the table; 1 when any check failed, else 0."""
    results["checks"] = [dataclasses.asdict(c) for c in checks]
    results["passed"] = all(c.passed for c in checks)
    save(results, output)
    print(table(results), flush=True)
    print(f"figures: {output}", flush=True)
    return 0 if results["passed"] else 1


def compare_devices(
    sizes: Sizes, dataset: Path, work: Path, results: dict[str, Any], checks: list[Check]
) -> None:
    """The final weights of two runs of the same steps: on a GPU, fp32 there
    against fp32 on the CPU; without one, --xla against fp32."""
    variants = results["variants"]
    if results["gpu"]:
        cpu = train_variant(sizes, dataset, work, "cpu", "fp32", {"CUDA_VISIBLE_DEVICES": "-1"})
        results["cpu_fp32"] = cpu
        checks += variant_checks("fp32 on the CPU", cpu, sizes.steps)
        what = "fp32 on the GPU (TF32) against fp32 on the CPU, same seed and data"
        name = "final weights: GPU fp32 vs CPU fp32"
        tolerance = weights_tolerance(sizes.longest_dot, TF32_UNIT_ROUNDOFF)
        compared, expected = variants["fp32"], cpu
    else:
        what = "--xla against fp32 on the CPU (other code paths, same precision)"
        name = "final weights: --xla vs fp32"
        tolerance = weights_tolerance(sizes.longest_dot, FP32_UNIT_ROUNDOFF)
        compared, expected = variants["xla"], variants["fp32"]
    comparison, weights_check = compare_weights(name, compared, expected, tolerance)
    results["comparison"] = {"what": what, "longest_dot": sizes.longest_dot} | comparison
    checks.append(weights_check)


def check(args: argparse.Namespace, work: Path) -> int:
    """Every check in turn; the figures to `args.json`, the table to stdout."""
    from dataloading.synthetic import generate_split_binary

    sizes: Sizes = args.sizes
    gpu = gpu_seen()
    device = "gpu" if gpu else "cpu"
    results: dict[str, Any] = {"device": device, "gpu": gpu, "device_name": device_name(gpu)}
    if not gpu:
        results["note"] = NO_GPU_LINE
        print(NO_GPU_LINE, flush=True)
    results["sizes"] = dataclasses.asdict(sizes) | {"seed": SEED}
    seconds = results["seconds"] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[stage] = round(now - clock, 1)
        clock = now

    rows = {"train": sizes.batch_size * sizes.steps, "test": sizes.test_rows}
    print(f"generating {rows} synthetic rows ...", flush=True)
    dataset = work / "data"
    generate_split_binary(dataset, [sizes.rows] * sizes.tables, rows=rows, seed=0)
    lap("data")
    checks: list[Check] = []
    variants = results["variants"] = {}
    for name in VARIANTS:
        variants[name] = train_variant(sizes, dataset, work, name, name)
        checks += variant_checks(name, variants[name], sizes.steps)
        lap(name)
    compare_devices(sizes, dataset, work, results, checks)
    lap("comparison")
    results["dcnv2"], dcnv2_check = train_dcnv2(sizes, work)
    checks.append(dcnv2_check)
    lap("dcnv2")
    results["export"], export_check = export_and_score(work, dataset, variants["fp32"], device)
    checks.append(export_check)
    lap("export")
    results["plain"] = plain_beside_ours(sizes, variants)
    lap("plain")
    return finish(results, checks, args.json)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_score:
        score_worker(Path(args.worker_score[0]), Path(args.worker_score[1]))
        return 0
    with work_directory("gpu_check_", args.dir) as work:
        return check(args, work)


if __name__ == "__main__":
    sys.exit(main())
