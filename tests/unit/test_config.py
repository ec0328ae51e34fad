"""RunConfig validation and main.py's flags (including --flagfile)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from absl import flags

from dlrm.app.config import ConfigError, RunConfig, check_world_size
from dlrm.app.policies import eval_steps
from dlrm.distributed.preemption import parse_signal
from dlrm.train.config import DEFAULT_CPU_DENSE_CHUNK_ROWS
from harness.processes import REPO, run


def config(**overrides: Any) -> RunConfig:
    return RunConfig(**{"dataset_path": "/data", **overrides})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mode": "serve"}, r"--mode: expected one of train, eval, inference, export, got 'serve'"),
        ({"batch_size": 0}, r"--batch_size: expected > 0, got 0"),
        ({"optimizer": "lamb"}, r"--optimizer: expected one of sgd, adagrad, adam"),
        ({"bottom_mlp_dims": (64, 32)}, r"--bottom_mlp_dims: .*--embedding_dim \(128\) .*, got 32"),
        ({"top_mlp_dims": (64, 2)}, r"--top_mlp_dims: the last width must be 1"),
        ({"warmup_steps": 10, "decay_start_step": 5}, r"--decay_start_step: expected >= "),
        ({"max_steps": 0}, r"--max_steps: expected -1 \(no limit\) or >= 1, got 0"),
        ({"dataset_path": None}, r"--dataset_path: required for --mode train"),
        ({"mode": "export", "dataset_path": None}, r"--restore_checkpoint_path: required"),
        ({"interaction": "dcn"}, r"--interaction: expected one of dot, cross, got 'dcn'"),
        ({"embedding_dim": (128, 64)}, r"--embedding_dim: the dot interaction needs one width"),
        ({"embedding_dim": (128, 0)}, r"--embedding_dim: expected a comma-separated list"),
        ({"interaction": "cross", "num_cross_layers": 0}, r"--num_cross_layers: expected >= 1"),
        ({"pooling": ("sum", "max")}, r"--pooling: expected sum or mean, .* got 'sum,max'"),
        ({"dense_chunk_rows": -8}, r"--dense_chunk_rows: expected >= 0 \(0: the whole batch"),
        (
            {"interaction": "cross", "cross_layer_projection_dim": -1},
            r"--cross_layer_projection_dim: expected >= 0 \(0: full rank\), got -1",
        ),
        (
            {"checkpoint_every_steps": 100},
            r"--checkpoint_every_steps: needs --save_checkpoint_path",
        ),
        (
            {"checkpoint_every_seconds": -1.0, "save_checkpoint_path": "/c"},
            r"--checkpoint_every_seconds: expected >= 0 \(0: never\), got -1.0",
        ),
        ({"resume": True}, r"--resume: needs --save_checkpoint_path"),
        ({"preemption_signal": "USR9"}, r"--preemption_signal: expected a signal name .* 'USR9'"),
        ({"preemption_signal": "KILL"}, r"--preemption_signal: SIGKILL cannot be caught"),
    ],
)
def test_errors_name_the_flag(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(**overrides)


def test_preemption_signals_by_name_or_number() -> None:
    assert parse_signal("USR1") == parse_signal("sigusr1") == signal.SIGUSR1
    assert parse_signal(str(int(signal.SIGUSR2))) == signal.SIGUSR2
    assert config(preemption_signal="USR1").preemption_signal == "USR1"


def test_dense_chunks_default_to_cpus_only() -> None:
    assert config().dense_chunk_rows_for(on_gpu=False) == DEFAULT_CPU_DENSE_CHUNK_ROWS
    assert config().dense_chunk_rows_for(on_gpu=True) == 0  # GPUs: the whole batch
    assert config(dense_chunk_rows=0).dense_chunk_rows_for(on_gpu=False) == 0
    assert config(dense_chunk_rows=512).dense_chunk_rows_for(on_gpu=True) == 512
    # Several ranks on CPUs: at least 4 chunks of at least 1024 rows, at most 8192.
    assert config(batch_size=8192).dense_chunk_rows_for(False, world_size=2) == 1024
    assert config(batch_size=65536).dense_chunk_rows_for(False, world_size=2) == 8192
    assert config(batch_size=24576).dense_chunk_rows_for(False, world_size=3) == 2048
    assert config(batch_size=4096).dense_chunk_rows_for(False, world_size=2) == 1024
    assert config(batch_size=1000).dense_chunk_rows_for(False, world_size=2) == 1024
    assert config(batch_size=8192).dense_chunk_rows_for(True, world_size=2) == 0
    assert config(batch_size=8192, dense_chunk_rows=0).dense_chunk_rows_for(False, 2) == 0


def test_batch_must_divide_by_world_size() -> None:
    with pytest.raises(ConfigError, match=r"--batch_size: .*\(3\); got 1000 = 333 \* 3 \+ 1"):
        check_world_size(config(batch_size=1000), 3)
    check_world_size(config(batch_size=1002), 3)


def test_config_is_frozen_and_written(tmp_path: Path) -> None:
    c = config(bottom_mlp_dims=(64, 128))
    with pytest.raises(AttributeError):
        c.batch_size = 5  # type: ignore[misc]
    written = json.loads(c.write(tmp_path).read_text())
    assert written["bottom_mlp_dims"] == [64, 128] and written["dataset_path"] == "/data"
    assert c.metrics_log_path is None
    assert config(save_checkpoint_path="/ck").metrics_log_path == Path("/ck/metrics.jsonl")


def test_eval_steps_are_spread_over_each_epoch() -> None:
    assert eval_steps(10, 2, 2) == [5, 10, 15, 20]
    assert eval_steps(7, 1, 3) == [2, 5, 7]
    assert eval_steps(10, 1, 0) == []


def config_from_flagfile(flagfile: Path, text: str, *more_flags: str) -> RunConfig:
    """main.py's config of `--flagfile` (holding `text`) and `more_flags`."""
    from dlrm.app.flags import config_from_flags

    flagfile.write_text(text)
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["main.py", f"--flagfile={flagfile}", *more_flags])
    try:
        return config_from_flags()
    finally:
        flags.FLAGS.unparse_flags()


def test_flagfile_builds_the_config(tmp_path: Path) -> None:
    c = config_from_flagfile(
        tmp_path / "run.flags",
        "--dataset_path=/data/criteo\n--batch_size=8192\n--optimizer=adam\n"
        "--embedding_dim=16\n--bottom_mlp_dims=64,16\n--amp\n",
        "--learning_rate=0.5",
    )
    assert c.dataset_path == "/data/criteo" and c.batch_size == 8192
    assert c.optimizer == "adam" and c.amp and not c.xla
    assert c.bottom_mlp_dims == (64, 16) and c.embedding_dim == (16,)
    assert c.learning_rate == 0.5 and c.top_mlp_dims == (1024, 1024, 512, 256, 1)


def test_flagfile_of_a_cross_model_with_per_table_widths(tmp_path: Path) -> None:
    c = config_from_flagfile(
        tmp_path / "dcnv2.flags",
        "--dataset_path=/data\n--interaction=cross\n--embedding_dim=16,8,4\n"
        "--bottom_mlp_dims=64,32\n--num_cross_layers=2\n--cross_layer_projection_dim=0\n",
    )
    assert c.interaction == "cross" and c.embedding_dim == (16, 8, 4)
    assert c.num_cross_layers == 2 and c.cross_layer_projection_dim == 0
    assert c.to_dict()["embedding_dim"] == [16, 8, 4]


def test_the_mlperf_dcnv2_flagfiles(tmp_path: Path) -> None:
    full = config_from_flagfile(
        tmp_path / "empty.flags",
        "--flagfile=dlrm/flagfiles/mlperf_dcnv2.flags\n--dataset_path=/data\n",
    )
    assert full.interaction == "cross" and full.num_cross_layers == 3
    assert full.cross_layer_projection_dim == 512
    assert full.embedding_dim == (128,) and full.bottom_mlp_dims == (512, 256, 128)
    assert full.top_mlp_dims == (1024, 1024, 512, 256, 1)
    assert (full.optimizer, full.batch_size, full.epochs) == ("adagrad", 65536, 1)
    small = config_from_flagfile(
        tmp_path / "small.flags",
        "--flagfile=dlrm/flagfiles/mlperf_dcnv2_small.flags\n--dataset_path=/data\n",
    )
    # An eighth of every width.
    assert small.embedding_dim == (16,) and small.cross_layer_projection_dim == 64
    assert small.bottom_mlp_dims == tuple(d // 8 for d in full.bottom_mlp_dims)
    assert small.top_mlp_dims[:-1] == tuple(d // 8 for d in full.top_mlp_dims[:-1])


def test_pooling_flag_takes_one_value_or_one_per_table(tmp_path: Path) -> None:
    c = config_from_flagfile(tmp_path / "a.flags", "--dataset_path=/data\n--pooling=mean\n")
    assert c.pooling == ("mean",)
    c = config_from_flagfile(tmp_path / "b.flags", "--dataset_path=/data\n--pooling=sum,mean,sum\n")
    assert c.pooling == ("sum", "mean", "sum") and c.to_dict()["pooling"] == ["sum", "mean", "sum"]
    assert config().pooling == ("sum",)


def test_intra_op_threads_per_rank_share_the_cpus() -> None:
    from dlrm.distributed.devices import intra_op_threads_per_rank

    assert intra_op_threads_per_rank(2, 2) == 1
    assert intra_op_threads_per_rank(16, 2) == 8
    assert intra_op_threads_per_rank(16, 3) == 5
    assert intra_op_threads_per_rank(1, 8) == 1  # bound to one core: one thread each


def test_ranks_on_a_host_get_slices_of_its_cpus() -> None:
    from dlrm.distributed.devices import cpu_slice, format_cpus

    assert [cpu_slice([0, 1], 2, r) for r in range(2)] == [(0,), (1,)]
    assert [cpu_slice(range(16), 2, r) for r in range(2)] == [tuple(range(8)), tuple(range(8, 16))]
    # 16 over 3: the first rank one more; every CPU used once.
    slices = [cpu_slice(range(16), 3, r) for r in range(3)]
    assert [len(s) for s in slices] == [6, 5, 5]
    assert sorted(c for s in slices for c in s) == list(range(16))
    # More ranks than CPUs: they take turns.
    assert [cpu_slice([4, 6], 4, r) for r in range(4)] == [(4,), (6,), (4,), (6,)]
    # Not the first CPUs of the machine: slices of the ones given.
    assert cpu_slice([9, 3, 5, 7], 2, 1) == (7, 9)
    assert format_cpus((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    assert format_cpus((5,)) == "5"


def test_packaged_flagfiles_are_found_by_name_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlrm.app.flags import PACKAGED_FLAGFILES, resolve_flagfiles

    monkeypatch.chdir(tmp_path)
    packaged = str(PACKAGED_FLAGFILES / "mlperf_dcnv2_small.flags")
    by_name = ["--flagfile=mlperf_dcnv2_small.flags", "--batch_size=8"]
    by_path = ["--flagfile", "dlrm/flagfiles/mlperf_dcnv2_small.flags"]
    assert resolve_flagfiles(["dlrm-train", *by_name, *by_path]) == [
        "dlrm-train",
        f"--flagfile={packaged}",
        "--batch_size=8",
        "--flagfile",
        packaged,
    ]
    # A file of that name where the user is wins; an unknown name is left to absl's error.
    (tmp_path / "mlperf_dcnv2_small.flags").write_text("--batch_size=4\n")
    mine = ["dlrm-train", "--flagfile=mlperf_dcnv2_small.flags", "--flagfile=nothing.flags"]
    assert resolve_flagfiles(mine) == mine


def test_tensorflow_loads_without_its_notices_and_passes_every_other_line(tmp_path: Path) -> None:
    """At default verbosity the notices TensorFlow's C++ code writes to stderr as it
    loads are dropped (AVX-512 BF16 CPUs print the oneDNN one; AVX2-only ones do
    not, hence a stand-in `tensorflow` module that writes what TensorFlow 2.21
    writes, from the file descriptor as C++ does), and any other line passes."""
    (tmp_path / "tensorflow.py").write_text(
        "import os\n"
        "for line in (\n"
        "    'WARNING: All log messages before absl::InitializeLog() is called are written"
        " to STDERR',\n"
        "    'I0000 00:00:1795775947.321043    4509 port.cc:153] oneDNN custom operations"
        " are on. You may see slightly different numerical results',\n"
        "    'E0000 00:00:1795775947.321043    4509 a real error: kept',\n"
        "):\n"
        "    os.write(2, (line + '\\n').encode())\n"
    )
    program = (
        "from dlrm.app.tensorflow_import import import_tensorflow_without_notices\n"
        "import_tensorflow_without_notices()\nprint('imported')\n"
    )
    result = run(
        [sys.executable, "-c", program], 60, {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "imported\n"
    assert result.stderr == "E0000 00:00:1795775947.321043    4509 a real error: kept\n"


@pytest.mark.parametrize("verbose", [False, True])
def test_tensorflow_starts_for_training_without_pandas_which_stays_importable(
    verbose: bool,
) -> None:
    """Keras imports pandas with TensorFlow when it can; the training command's
    import of TensorFlow keeps it from doing so, and leaves pandas importable."""
    program = (
        "import sys\n"
        "from dlrm.app.tensorflow_import import quiet_logs\n"
        f"quiet_logs({verbose})\n"
        "import tensorflow as tf\n"
        "print('pandas' in sys.modules, float(tf.reduce_sum(tf.ones([3]))))\n"
        "import pandas\n"
        "print(pandas.DataFrame({'a': [1, 2]})['a'].sum())\n"
    )
    # This process's TensorFlow log level, not `run`'s default: `quiet_logs` keeps one set.
    level = {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL")}
    result = run([sys.executable, "-c", program], 120, level)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["False 3.0", "3"]


def test_help_lists_every_flag_of_the_command() -> None:
    """`--help` shows the main module's flags: those `dlrm.app.flags` defines.
    (absl exits 1 after printing the help.)"""
    result = run([sys.executable, "main.py", "--help"], 120)
    for flag in ("--dataset_path", "--batch_size", "--mode", "--save_checkpoint_path"):
        assert flag in result.stdout, result.stdout[-2000:]
