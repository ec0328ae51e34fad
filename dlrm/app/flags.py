"""The command line's flags: one per `RunConfig` field, named as in NVIDIA's TF2
DLRM where one exists, and the `RunConfig` they make. `--flagfile` also finds
the flagfiles that ship with the package (`dlrm/flagfiles/`) by name, e.g.
`--flagfile mlperf_dcnv2_small.flags`, from any directory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import flags

from dlrm.app.config import (
    EMBEDDING_DTYPES,
    INPUT_MODES,
    MODES,
    QUANTIZATIONS,
    SCHEDULE_FROM,
    RunConfig,
)
from dlrm.checkpoint.format import CheckpointError
from dlrm.checkpoint.reader import Checkpoint
from dlrm.distributed.preemption import EXIT_PREEMPTED
from dlrm.embedding.planner.types import STRATEGIES
from dlrm.model.config import INTERACTIONS, LEGACY_VALUES
from dlrm.optim.config import OPTIMIZERS
from dlrm.train.config import DEFAULT_CPU_DENSE_CHUNK_ROWS, MIN_PIPELINED_CHUNK_ROWS

_D = RunConfig.default


flags.DEFINE_enum("mode", _D("mode"), list(MODES), "What to run.")


flags.DEFINE_string("dataset_path", None, "Dataset directory (holds the FeatureSpec).")


flags.DEFINE_string(
    "feature_spec", _D("feature_spec"), "FeatureSpec file name inside --dataset_path."
)


flags.DEFINE_bool(
    "check_ids",
    _D("check_ids"),
    "Stop with an error naming the table, file and row when a categorical id is outside "
    "[0, cardinality) (checked per batch in the loader).",
)


flags.DEFINE_integer("batch_size", _D("batch_size"), "Global training batch size.")


flags.DEFINE_integer(
    "valid_batch_size",
    None,
    "Global batch size for evaluation and inference (default: --batch_size).",
)


flags.DEFINE_enum("optimizer", _D("optimizer"), list(OPTIMIZERS), "Optimizer.")


flags.DEFINE_float("learning_rate", _D("learning_rate"), "Peak learning rate.")


flags.DEFINE_integer("warmup_steps", _D("warmup_steps"), "Linear warmup steps.")


flags.DEFINE_integer(
    "decay_start_step",
    _D("decay_start_step"),
    "Step where the polynomial decay starts (0: no decay).",
)


flags.DEFINE_integer("decay_steps", _D("decay_steps"), "Length of the polynomial decay.")


flags.DEFINE_float("decay_power", _D("decay_power"), "Power of the polynomial decay.")


flags.DEFINE_float("decay_end_lr", _D("decay_end_lr"), "Learning rate after the decay.")


flags.DEFINE_integer("epochs", _D("epochs"), "Passes over the training split.")


flags.DEFINE_integer("max_steps", _D("max_steps"), "Stop after this many steps (-1: no limit).")


flags.DEFINE_integer("seed", _D("seed"), "Seed of the initial weights.")


flags.DEFINE_list(
    "embedding_dim",
    [str(d) for d in _D("embedding_dim")],
    "Embedding width: one for every table, or a comma-separated width per table "
    "(--interaction cross only).",
)


flags.DEFINE_enum(
    "embedding_dtype",
    _D("embedding_dtype"),
    list(EMBEDDING_DTYPES),
    "What the embedding tables store: float32, or bfloat16 or float16 at half the bytes "
    "(lookups widen, updates round stochastically; optimizer slots stay float32).",
)


flags.DEFINE_list(
    "bottom_mlp_dims",
    [str(d) for d in _D("bottom_mlp_dims")],
    "Bottom MLP widths; with --interaction dot the last equals --embedding_dim.",
)


flags.DEFINE_list(
    "top_mlp_dims", [str(d) for d in _D("top_mlp_dims")], "Top MLP widths; the last is 1."
)


flags.DEFINE_enum(
    "interaction",
    _D("interaction"),
    list(INTERACTIONS),
    "dot: DLRM's pairwise dot products; cross: a DCNv2 cross network over the bottom-MLP "
    "output and all embedding vectors.",
)


flags.DEFINE_integer(
    "num_cross_layers", _D("num_cross_layers"), "Cross layers of --interaction cross."
)


flags.DEFINE_integer(
    "cross_layer_projection_dim",
    _D("cross_layer_projection_dim"),
    "Rank of each cross layer's weight matrix (low-rank projection); 0: full rank.",
)


flags.DEFINE_list(
    "pooling",
    list(_D("pooling")),
    "How a multi-hot row's vectors are pooled, sum or mean: one for every table, or a "
    "comma-separated one per table.",
)


flags.DEFINE_enum(
    "sharding_strategy",
    _D("sharding_strategy"),
    list(STRATEGIES),
    "Embedding placement under horovodrun: cost-driven greedy, memory only, or round-robin.",
)


flags.DEFINE_integer(
    "data_parallel_threshold",
    _D("data_parallel_threshold"),
    "Tables of at most this many elements (rows x dim) are replicated on every rank.",
)


flags.DEFINE_integer(
    "column_slice_threshold",
    _D("column_slice_threshold"),
    "Larger tables are sliced by columns across ranks.",
)


flags.DEFINE_integer(
    "row_slice_threshold",
    _D("row_slice_threshold"),
    "Larger tables are split by rows across ranks.",
)


flags.DEFINE_float(
    "embedding_memory_budget_gib",
    _D("embedding_memory_budget_gib"),
    "Embedding memory (values + optimizer slots) per rank, GiB; 0: no limit.",
)


flags.DEFINE_enum(
    "input_mode",
    _D("input_mode"),
    list(INPUT_MODES),
    "model_parallel: a rank reads its tables' ids for the global batch; data_parallel: all "
    "ids of its local rows, exchanged by alltoall.",
)


flags.DEFINE_bool(
    "exchange_ids_ahead",
    _D("exchange_ids_ahead"),
    "With --input_mode data_parallel, the next batch's ids are exchanged during this "
    "step's dense part instead of at the start of their own step (the same results). "
    "--noexchange_ids_ahead: each step exchanges its own.",
)


flags.DEFINE_string(
    "sharding_plan",
    None,
    "A sharding plan JSON (e.g. sharding_plan.json of an earlier run) to use instead of "
    "planning; it must be for this world size and these tables.",
)


flags.DEFINE_bool(
    "bind_cpus",
    True,
    "Ranks that share a host each run on CPUs of their own (consecutive slices of the "
    "host's CPUs), unless a launcher or container already bound them. --nobind_cpus: "
    "they share every CPU, each with its share as intra-op threads.",
)


flags.DEFINE_bool("amp", False, "Mixed precision: bfloat16 on CPU, float16 + loss scaling on GPU.")


flags.DEFINE_bool("xla", False, "Compile the dense part (MLPs, interaction) with XLA.")


flags.DEFINE_bool(
    "use_kernels",
    True,
    "On CPUs, run the project's own kernels (built by make install, else on first use): "
    "the dot interaction (not under --xla), one-hot lookups, the finite check, SGD's updates. "
    "--nouse_kernels: TensorFlow's ops only.",
)


flags.DEFINE_integer(
    "dense_chunk_rows",
    None,
    "Run the dense part (MLPs, interaction, their gradients) over chunks of this many of "
    "a rank's rows, one after another, summing their gradients: the same step in less "
    "memory; on several ranks each chunk's vectors cross on their own, overlapping "
    f"another chunk's compute. Default on CPUs: {DEFAULT_CPU_DENSE_CHUNK_ROWS} on one "
    f"rank; on several, a quarter of a rank's rows within {MIN_PIPELINED_CHUNK_ROWS}-"
    f"{DEFAULT_CPU_DENSE_CHUNK_ROWS}. GPUs: the whole batch. 0: the whole batch.",
)


flags.DEFINE_integer("evals_per_epoch", _D("evals_per_epoch"), "Evaluations per epoch.")


flags.DEFINE_integer("print_freq", _D("print_freq"), "Steps between progress lines.")


flags.DEFINE_string(
    "log_path", None, "JSON-lines metrics log (default: metrics.jsonl in --save_checkpoint_path)."
)


flags.DEFINE_string(
    "tensorboard_dir",
    None,
    "TensorBoard directory (default: tensorboard/ in --save_checkpoint_path).",
)


flags.DEFINE_string("save_checkpoint_path", None, "Directory for checkpoints (step_* inside).")


flags.DEFINE_string(
    "restore_checkpoint_path",
    None,
    "Checkpoint to restore: a step_* directory, or a directory of them (the newest is used).",
)


flags.DEFINE_integer("keep_checkpoints", _D("keep_checkpoints"), "Checkpoints kept.")


flags.DEFINE_integer(
    "checkpoint_every_steps",
    _D("checkpoint_every_steps"),
    "Also write a checkpoint every this many steps (0: only after evaluations and at the end).",
)


flags.DEFINE_float(
    "checkpoint_every_seconds",
    _D("checkpoint_every_seconds"),
    "Also write a checkpoint when this many seconds passed since the last one (rank 0's "
    "clock; every rank writes at the same step). 0: never.",
)


flags.DEFINE_bool(
    "resume",
    _D("resume"),
    "Continue from the newest complete checkpoint in --save_checkpoint_path when it has "
    "one (else start as the other flags say): the same command starts and restarts a run.",
)


flags.DEFINE_bool(
    "warm_start",
    _D("warm_start"),
    "With --restore_checkpoint_path: start from its weights and optimizer state at step 0 "
    "of this run's data (the next day's data), not at its step. Its tables grow to this "
    "dataset's cardinalities when the dataset extends its vocabulary.",
)
flags.DEFINE_enum(
    "schedule_from",
    _D("schedule_from"),
    list(SCHEDULE_FROM),
    "Where a --warm_start's learning-rate schedule stands at its first step: checkpoint "
    "(where the checkpoint's was: warmup is not repeated, decay goes on) or zero (its start).",
)


flags.DEFINE_string(
    "preemption_signal",
    None,
    "A signal (e.g. USR1, as Slurm's --signal=B:USR1@120 sends) that, like SIGTERM, stops "
    f"training at the next step on every rank: a checkpoint, then exit {EXIT_PREEMPTED}.",
)


flags.DEFINE_string("saved_model_output_path", None, "Where --mode export writes the SavedModel.")


flags.DEFINE_enum(
    "quantize",
    _D("quantize"),
    list(QUANTIZATIONS),
    "--mode export only: none: the tables as trained, float32; int8: each table row-wise "
    "int8 with a float32 scale and offset per row (about a quarter of the bytes), "
    "dequantized inside the SavedModel's serving function; the same signature.",
)


flags.DEFINE_integer(
    "benchmark_warmup_steps", _D("benchmark_warmup_steps"), "Untimed first inference batches."
)


FLAGS = flags.FLAGS


def _widths(flag: str, values: list[str]) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in values)
    except ValueError:
        raise ValueError(
            f"--{flag}: expected comma-separated integers, got {','.join(values)!r}"
        ) from None


def config_from_flags() -> RunConfig:
    """The frozen, validated config (raises ConfigError/ValueError naming the flag).

    Every RunConfig field is the flag of the same name; MLP widths are parsed. In
    `--mode eval` and `inference`, the architecture flags not given come from the
    checkpoint's manifest (`architecture_from_checkpoint`)."""
    values = {field.name: getattr(FLAGS, field.name) for field in dataclasses.fields(RunConfig)}
    for flag in ("embedding_dim", "bottom_mlp_dims", "top_mlp_dims"):
        values[flag] = _widths(flag, values[flag])
    if values["mode"] in ("eval", "inference") and values["restore_checkpoint_path"]:
        given = {flag for flag in ARCHITECTURE_FLAGS if FLAGS[flag].present}
        values.update(architecture_from_checkpoint(values["restore_checkpoint_path"], given))
    return RunConfig(**values)


# The flags that describe the architecture, which every checkpoint's manifest records.
ARCHITECTURE_FLAGS = (
    "embedding_dim",
    "bottom_mlp_dims",
    "top_mlp_dims",
    "interaction",
    "num_cross_layers",
    "cross_layer_projection_dim",
    "pooling",
)


def architecture_from_checkpoint(path: str, given: set[str]) -> dict[str, Any]:
    """The architecture flags not in `given`, as the checkpoint at `path` records
    them (export reads the whole model from it the same way). Flags given stay as
    they are: a restore refuses those that contradict the checkpoint. An unreadable
    checkpoint gives nothing here; the restore names what is wrong with it."""
    try:
        saved = Checkpoint(path).manifest.get("model")
    except CheckpointError:
        return {}
    if not isinstance(saved, dict):
        return {}
    model = {**LEGACY_VALUES, **saved}
    found: dict[str, Any] = {}
    for flag in ARCHITECTURE_FLAGS:
        value = model.get(flag)
        if flag in given or value is None:
            continue
        found[flag] = tuple(value) if isinstance(value, list) else value
    if isinstance(found.get("embedding_dim"), int):
        found["embedding_dim"] = (found["embedding_dim"],)
    if isinstance(found.get("pooling"), str):
        found["pooling"] = (found["pooling"],)
    return found


# The flagfiles that ship with the package (MLPerf DLRM-DCNv2 and its scaled-down variant).
PACKAGED_FLAGFILES = Path(__file__).resolve().parents[1] / "flagfiles"


def resolve_flagfiles(argv: Sequence[str]) -> list[str]:
    """`argv` with each `--flagfile` that names no file but a packaged flagfile
    (by its name, or as `dlrm/flagfiles/NAME` from outside a checkout) pointed
    at the packaged one; every other argument unchanged."""
    out = list(argv)
    for index, arg in enumerate(out):
        if arg.startswith("--flagfile="):
            prefix, value = "--flagfile=", arg[len("--flagfile=") :]
        elif arg == "--flagfile" and index + 1 < len(out):
            prefix, value, index = "", out[index + 1], index + 1
        else:
            continue
        packaged = PACKAGED_FLAGFILES / Path(value).name
        if value and not Path(value).exists() and packaged.is_file():
            out[index] = prefix + str(packaged)
    return out
