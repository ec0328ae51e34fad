"""`dlrm-plan`: `dlrm-train`'s dataset and model flags, and a world, to a dry run.

    dlrm-plan --flagfile mlperf_dcnv2.flags --cardinalities 39884406,... \\
        --hotness 3,2,... --hosts 8 --ranks_per_host 8 --device H100-80GB-SXM \\
        [--json plan.json]
    dlrm-plan --dataset_path DIR [model flags] --hosts 2 --ranks_per_host 2 --device local

The flags of `dlrm-train` are its own (`dlrm.app.flags`), made into a `RunConfig`
the way `dlrm-train` makes it; the dataset comes from `--dataset_path` (its
FeatureSpec; the data files need not exist) or from `--cardinalities` and
`--hotness`. Nothing is trained, no Horovod process is started, and TensorFlow
runs no op, except the matmul probe of `--device local`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from absl import app, flags

from dlrm.app import flags as train_flags
from dlrm.app.config import ConfigError, RunConfig
from dlrm.planning.devices import LOCAL_DEVICE, DeviceSpec, device_named, device_table
from dlrm.planning.errors import DryRunError
from dlrm.planning.world import World
from feature_spec import FeatureSpec, FeatureSpecError
from feature_spec.criteo import build_split_binary_spec

flags.DEFINE_list(
    "cardinalities",
    None,
    "Rows of each table, comma-separated: plan without a dataset (instead of --dataset_path).",
)
flags.DEFINE_list(
    "hotness", None, "Ids per sample of each table, with --cardinalities (default: 1 each)."
)
flags.DEFINE_integer("num_numerical", 13, "Numerical features, with --cardinalities (Criteo's 13).")
flags.DEFINE_integer("hosts", 1, "Hosts of the world planned for.")
flags.DEFINE_integer("ranks_per_host", 1, "Ranks (GPUs, or processes of a CPU server) per host.")
flags.DEFINE_string(
    "device",
    None,
    "A device of the table (A100-80GB-SXM, H100-80GB-SXM, H200-141GB, cpu-avx2-2core, "
    "cpu-64core, or one of --device_table), or 'local': this machine, probed.",
)
flags.DEFINE_string(
    "device_table",
    None,
    "A YAML or JSON file of devices (name: fields of dlrm.planning.devices.DeviceSpec), "
    "merged over the built-in ones.",
)
flags.DEFINE_float(
    "device_memory_gib", None, "Overrides the device's memory (a CPU server's: the host's)."
)
flags.DEFINE_float(
    "intra_host_gbps", None, "Overrides the link between ranks of a host, Gbit/s per direction."
)
flags.DEFINE_float(
    "inter_host_gbps",
    None,
    "Overrides a rank's link to other hosts, Gbit/s per direction (a CPU server's: the host's).",
)
flags.DEFINE_float("intra_host_latency_us", None, "Overrides one message's latency within a host.")
flags.DEFINE_float("inter_host_latency_us", None, "Overrides one message's latency between hosts.")
flags.DEFINE_float(
    "collective_overhead_us",
    None,
    "Overrides what a round of collectives costs beyond its bytes and latencies (Horovod's "
    "cycle and negotiation).",
)
flags.DEFINE_string("json", None, "Also write the dry run's figures to this JSON file.")
flags.DEFINE_integer(
    "max_hosts", 1024, "The most hosts tried when searching for a world that fits."
)

FLAGS = flags.FLAGS

# Flags of this command, beyond dlrm-train's, listed first by --help.
PLAN_FLAGS = (
    "cardinalities",
    "hotness",
    "num_numerical",
    "hosts",
    "ranks_per_host",
    "device",
    "device_table",
    "device_memory_gib",
    "intra_host_gbps",
    "inter_host_gbps",
    "intra_host_latency_us",
    "inter_host_latency_us",
    "collective_overhead_us",
    "json",
    "max_hosts",
)

# --dataset_path stands for the tables given as flags (RunConfig needs one to train).
TABLES_FROM_FLAGS = "(tables from --cardinalities)"

# Device overrides: flag -> DeviceSpec field.
_OVERRIDES = {
    "device_memory_gib": "memory_gib",
    "intra_host_gbps": "intra_host_gbit_s",
    "inter_host_gbps": "inter_host_gbit_s",
    "intra_host_latency_us": "intra_host_latency_us",
    "inter_host_latency_us": "inter_host_latency_us",
    "collective_overhead_us": "collective_overhead_us",
}


def _integers(flag: str, values: list[str], minimum: int) -> tuple[int, ...]:
    try:
        numbers = tuple(int(v) for v in values)
    except ValueError:
        numbers = ()
    if not numbers or min(numbers) < minimum:
        raise DryRunError(
            f"--{flag}: expected comma-separated integers >= {minimum}, got {','.join(values)!r}"
        )
    return numbers


def run_config() -> RunConfig:
    """`dlrm-train`'s `RunConfig` of these flags, in train mode (ConfigError naming
    a flag); `--dataset_path` or `--cardinalities`, one of them."""
    values = {field.name: getattr(FLAGS, field.name) for field in dataclasses.fields(RunConfig)}
    for flag in ("embedding_dim", "bottom_mlp_dims", "top_mlp_dims"):
        values[flag] = _integers(flag, values[flag], 1)
    given = [f"--{flag}" for flag in ("dataset_path", "cardinalities") if FLAGS[flag].value]
    if len(given) != 1:
        raise DryRunError(
            f"--dataset_path or --cardinalities: expected one of them, got "
            f"{' and '.join(given) or 'neither'}"
        )
    if FLAGS.hotness and not FLAGS.cardinalities:
        raise DryRunError("--hotness: needs --cardinalities (a FeatureSpec has its own)")
    values["mode"] = "train"
    values["dataset_path"] = values["dataset_path"] or TABLES_FROM_FLAGS
    return RunConfig(**values)


def feature_spec_of(config: RunConfig) -> FeatureSpec:
    """The FeatureSpec of `--dataset_path` (its files need not exist), or one made
    from `--cardinalities`, `--hotness` and `--num_numerical`."""
    if FLAGS.cardinalities:
        cardinalities = _integers("cardinalities", FLAGS.cardinalities, 1)
        hotness = _integers("hotness", FLAGS.hotness, 1) if FLAGS.hotness else None
        if hotness is not None and len(hotness) != len(cardinalities):
            raise DryRunError(
                f"--hotness: expected one value per table of --cardinalities "
                f"({len(cardinalities)}), got {len(hotness)}"
            )
        if FLAGS.num_numerical < 0:
            raise DryRunError(f"--num_numerical: expected >= 0, got {FLAGS.num_numerical}")
        return build_split_binary_spec(cardinalities, FLAGS.num_numerical, hotness)
    return FeatureSpec.load(config.feature_spec_path, check_files=False)


def device_of_flags() -> DeviceSpec:
    """`--device` from the table (or probed), with the flags' overrides."""
    if not FLAGS.device:
        names = ", ".join([*device_table(FLAGS.device_table), LOCAL_DEVICE])
        raise DryRunError(f"--device: required; expected one of {names}")
    if FLAGS.device == LOCAL_DEVICE:
        from dlrm.planning.probe import local_device

        device = local_device()
    else:
        device = device_named(FLAGS.device, device_table(FLAGS.device_table))
    overrides = {
        field: getattr(FLAGS, flag) for flag, field in _OVERRIDES.items() if FLAGS[flag].present
    }
    return dataclasses.replace(device, **overrides)


def main(argv: list[str]) -> int:
    """The command: 0, or 2 for a wrong flag, 1 for a model that cannot be planned."""
    if len(argv) > 1:
        print(f"dlrm-plan: unexpected arguments {argv[1:]}; every setting is a --flag")
        return 2
    from dlrm.app.tensorflow_import import quiet_logs

    try:  # every flag checked before TensorFlow's import (seconds)
        config = run_config()
        spec = feature_spec_of(config)
        probed = FLAGS.device == LOCAL_DEVICE  # the probe runs TensorFlow
        world = None if probed else World(FLAGS.hosts, FLAGS.ranks_per_host, device_of_flags())
        quiet_logs(bool(FLAGS["verbosity"].present) and FLAGS.verbosity >= 0)
        world = world or World(FLAGS.hosts, FLAGS.ranks_per_host, device_of_flags())
        from dlrm.app.assembly import model_config_for
        from dlrm.planning.dry_run import Model

        model = Model(config, model_config_for(spec, config), spec)
    except (ConfigError, DryRunError, FeatureSpecError) as error:
        print(f"dlrm-plan: invalid flags: {error}", file=sys.stderr)
        return 2
    from dlrm.embedding.planner.types import PlanError
    from dlrm.planning.dry_run import dry_run
    from dlrm.planning.report import format_dry_run, write_json

    try:
        result = dry_run(model, world, FLAGS.max_hosts)
    except PlanError as error:
        print(f"dlrm-plan: {error}", file=sys.stderr)
        return 1
    print(format_dry_run(result))
    if FLAGS.json:
        write_json(result, Path(FLAGS.json))
    return 0


def console_main() -> None:
    """The `dlrm-plan` command (and `python -m dlrm.planning`)."""
    for name in PLAN_FLAGS:
        FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])
    for flag in FLAGS.get_flags_for_module(train_flags.__name__):
        FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    argv = train_flags.resolve_flagfiles(sys.argv)
    app.run(lambda args: sys.exit(main(args)), argv=argv)
