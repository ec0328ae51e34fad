"""MLPerf's DLRM-DCNv2 and NVIDIA's DLRM projected onto GPU and CPU clusters by
`dlrm-plan`'s dry run: per-rank memory, step time split by term, samples/s.

    python benchmarks/projection.py [--output projection.json]

Each row is one dry run (`dlrm.planning.dry_run`), its model and world made from
`dlrm-plan`'s own flags by `dlrm.planning.cli`'s functions, as the command makes
them; nothing is trained and nothing is measured. Configurations:

- `dcnv2`: `dlrm/flagfiles/mlperf_dcnv2.flags` (batch 65,536, Adagrad) on Criteo
  1TB multi-hot (`feature_spec.criteo`: the 40M-capped cardinalities and MLPerf's
  ids per row);
- `dlrm`: NVIDIA's DLRM (DeepLearningExamples, TensorFlow2/Recommendation/
  DLRM_and_DCNv2, `dlrm.py`'s defaults: dot interaction, width 128, bottom
  512-256-128, top 1024-1024-512-256-1, SGD, batch 65,536) on its Criteo 1TB
  tables at frequency threshold 3, the "large" model of its README that it
  recommends for multi-GPU runs (84.9 GiB of tables, one id per row).

Worlds: 1, 8, 16, 64 and 128 GPUs of A100-80GB-SXM and H100-80GB-SXM (8 a host;
1 GPU is a host of one), with `--amp` as the published runs use; 2 to 64 hosts of
cpu-64core with one rank a host (one process using the host's cores, float32: the
EPYC it models has no bfloat16 matmul instructions). Beside them, the conditions
of published figures: `dcnv2` at `--input_mode data_parallel` on 64 and 128 H100s
(the ids' alltoall, which the default model-parallel input does without), at
MLPerf's batch sizes (55,296 on 8 GPUs, 135,168 on 64 and 128; on 64 and 128 H100s
also without the links' latencies, `0us`, to show their part of the step), and
`dlrm` with NVIDIA's other table sizes (threshold 15, "small", on 1 A100;
threshold 0, "extra large", on 8 A100s and on one CPU host) and in TF32 (without
`--amp`).

Prints one table: the configuration, device, world, whether it fits (else the
fewest GPUs or hosts that do), the most loaded rank's peak GiB, the slowest
rank's step, samples/s, the scaling efficiency against one host of the same
ranks at the same global batch, and each term's share of the step: dense
compute, lookups and update, alltoall of ids, alltoall of vectors and gradients,
dense allreduce, replicated tables' gradients. A world that does not fit is
timed with the plan it would make regardless of memory. `--output` writes the
figures as JSON, with each world's device, the slowest rank's step and the most
loaded rank's memory term by term.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags

from benchmarks.common import parser_for, save
from dlrm.app.config import ConfigError
from dlrm.app.flags import resolve_flagfiles
from dlrm.embedding.planner.types import PlanError
from dlrm.planning import cli
from dlrm.planning.devices import GIB
from dlrm.planning.dry_run import DryRun, Model, dry_run
from dlrm.planning.errors import DryRunError
from dlrm.planning.world import World
from feature_spec import FeatureSpecError
from feature_spec.criteo import CRITEO_1TB_MLPERF_CARDINALITIES, MLPERF_DCNV2_MULTI_HOT_SIZES
from harness.processes import REPO

FLAGS = flags.FLAGS

A100, H100, CPU = "A100-80GB-SXM", "H100-80GB-SXM", "cpu-64core"
GPUS = (1, 8, 16, 64, 128)
GPUS_PER_HOST = 8
CPU_HOSTS = (2, 4, 8, 16, 32, 64)

# NVIDIA's Criteo 1TB tables by frequency threshold (ids seen fewer times share one
# row): DeepLearningExamples, TensorFlow2/Recommendation/DLRM_and_DCNv2/dataloading/
# generate_feature_spec.py, variants criteo_t15/t3/t0_synthetic (16, 85 and 421 GiB
# of float32 tables at width 128), one id per row.
NVIDIA_CARDINALITIES = {
    15: (
        7912889, 33823, 17139, 7339, 20046, 4, 7105, 1382, 63, 5554114, 582469, 245828, 11,
        2209, 10667, 104, 4, 968, 15, 8165896, 2675940, 7156453, 302516, 12022, 97, 35,
    ),
    3: (
        45833188, 36747, 1572176, 345139, 11, 2209, 11268, 128, 4, 975, 15, 48937457, 17246,
        11316796, 40094537, 452104, 12607, 105, 36, 7414, 20244, 4, 7115, 1442, 63, 29275261,
    ),
    0: (
        227605432, 39061, 3067956, 405283, 11, 2209, 11939, 155, 4, 977, 15, 292775614, 17296,
        40790948, 187188510, 590152, 12974, 109, 37, 7425, 20266, 4, 7123, 1544, 64, 130229467,
    ),
}  # fmt: skip

# NVIDIA's DLRM, as `dlrm.py` of DLRM_and_DCNv2 defines its flags (the learning-rate
# schedule does not change a step's time; given for completeness).
NVIDIA_DLRM_FLAGS = (
    "--interaction=dot",
    "--embedding_dim=128",
    "--bottom_mlp_dims=512,256,128",
    "--top_mlp_dims=1024,1024,512,256,1",
    "--optimizer=sgd",
    "--learning_rate=24",
    "--warmup_steps=8000",
    "--decay_start_step=48000",
    "--decay_steps=24000",
    "--batch_size=65536",
)
DCNV2_FLAGS = (f"--flagfile={REPO / 'dlrm' / 'flagfiles' / 'mlperf_dcnv2.flags'}",)

# MLPerf's global batches in NVIDIA's DLRM-DCNv2 submissions (config_DGXH100_1x8x6912.sh,
# _8x8x2112.sh and _16x8x1056.sh, rounds v3.0 to v4.1).
MLPERF_BATCH = {8: 55296, 64: 135168, 128: 135168}


def _joined(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


@dataclasses.dataclass(frozen=True)
class Configuration:
    """A model on its tables: `dlrm-plan`'s model flags and `--cardinalities`."""

    name: str
    flags: tuple[str, ...]
    cardinalities: tuple[int, ...]
    hotness: tuple[int, ...] | None = None

    def argv(self) -> list[str]:
        tables = [f"--cardinalities={_joined(self.cardinalities)}"]
        if self.hotness is not None:
            tables.append(f"--hotness={_joined(self.hotness)}")
        return [*self.flags, *tables]


DCNV2 = Configuration(
    "dcnv2", DCNV2_FLAGS, CRITEO_1TB_MLPERF_CARDINALITIES, MLPERF_DCNV2_MULTI_HOT_SIZES
)
DLRM = Configuration("dlrm", NVIDIA_DLRM_FLAGS, NVIDIA_CARDINALITIES[3])


@dataclasses.dataclass(frozen=True)
class Case:
    """One dry run: a configuration on a world, with extra flags and a label."""

    configuration: Configuration
    device: str
    hosts: int
    ranks_per_host: int
    extra: tuple[str, ...] = ()
    label: str = ""

    @property
    def name(self) -> str:
        return f"{self.configuration.name}{' ' + self.label if self.label else ''}"

    def argv(self) -> list[str]:
        world = [f"--hosts={self.hosts}", f"--ranks_per_host={self.ranks_per_host}"]
        return [*self.configuration.argv(), *world, f"--device={self.device}", *self.extra]


def gpu_world(gpus: int) -> tuple[int, int]:
    """(hosts, ranks per host) of `gpus` GPUs: one host of up to 8."""
    return (1, gpus) if gpus <= GPUS_PER_HOST else (gpus // GPUS_PER_HOST, GPUS_PER_HOST)


def projection_cases() -> list[Case]:
    """Both configurations at every GPU count of both GPUs, and on every CPU cluster."""
    found = [
        Case(configuration, device, *gpu_world(gpus), ("--amp",))
        for configuration in (DCNV2, DLRM)
        for device in (A100, H100)
        for gpus in GPUS
    ]
    return found + [Case(c, CPU, hosts, 1) for c in (DCNV2, DLRM) for hosts in CPU_HOSTS]


def published_condition_cases() -> list[Case]:
    """Data-parallel input at scale, and the conditions of the published figures."""
    data_parallel = ("--amp", "--input_mode=data_parallel")
    found = [Case(DCNV2, H100, *gpu_world(g), data_parallel, "dp input") for g in (64, 128)]
    for gpus, batch in MLPERF_BATCH.items():
        mlperf = ("--amp", f"--batch_size={batch}")
        found += [Case(DCNV2, d, *gpu_world(gpus), mlperf, f"batch {batch}") for d in (A100, H100)]
    no_latency = ("--intra_host_latency_us=0", "--inter_host_latency_us=0")
    for gpus in (64, 128):
        batch = MLPERF_BATCH[gpus]
        flags = ("--amp", f"--batch_size={batch}", *no_latency)
        found.append(Case(DCNV2, H100, *gpu_world(gpus), flags, f"batch {batch} 0us"))
    small = dataclasses.replace(DLRM, name="dlrm T15", cardinalities=NVIDIA_CARDINALITIES[15])
    huge = dataclasses.replace(DLRM, name="dlrm T0", cardinalities=NVIDIA_CARDINALITIES[0])
    return [
        *found,
        Case(small, A100, 1, 1, ("--amp",)),
        Case(small, A100, 1, 1, (), "tf32"),
        Case(DLRM, A100, 1, 8, (), "tf32"),
        Case(huge, A100, 1, 8, ("--amp",)),
        Case(huge, A100, 1, 8, (), "tf32"),
        Case(huge, CPU, 1, 1),
    ]


def plan(argv: Sequence[str]) -> DryRun:
    """The dry run of `dlrm-plan` with `argv` (its flags), as its `main` makes it."""
    FLAGS.unparse_flags()
    FLAGS(["projection", *resolve_flagfiles(argv)])
    config = cli.run_config()
    spec = cli.feature_spec_of(config)
    world = World(FLAGS.hosts, FLAGS.ranks_per_host, cli.device_of_flags())
    from dlrm.app.assembly import model_config_for  # imports TensorFlow

    return dry_run(Model(config, model_config_for(spec, config), spec), world, FLAGS.max_hosts)


# Columns of the step's split: heading -> the StepTime terms summed into it.
SHARES = {
    "compute": ("dense_compute",),
    "lookups": ("lookups_update",),
    "ids": ("alltoall_ids",),
    "vec+grad": ("alltoall_vectors", "alltoall_gradients"),
    "allreduce": ("dense_allreduce",),
    "repl.": ("replicated_gradients",),
}


def row(case: Case, result: DryRun) -> dict[str, Any]:
    """The table's figures of one dry run (and the case that made it)."""
    step = result.step
    misfit = result.misfit
    fewest = None
    if misfit is not None and misfit.smallest_hosts is not None:
        fewest = misfit.smallest_hosts * case.ranks_per_host
    return {
        "configuration": case.name,
        "device": case.device,
        "hosts": case.hosts,
        "ranks_per_host": case.ranks_per_host,
        "flags": case.argv(),
        "global_batch_size": result.model.config.batch_size,
        "fits": result.placement.fits,
        "fewest_ranks_that_fit": fewest,
        "peak_gib": max(m.peak for m in result.placement.memory) / GIB,
        "step_ms": step.total * 1e3,
        "samples_per_second": result.samples_per_second,
        "scaling_efficiency": result.scaling.efficiency_same_global_batch,
        "shares": {
            heading: sum(getattr(step, term) for term in terms) / step.total
            for heading, terms in SHARES.items()
        },
        "dry_run": _summary(result),
    }


# The dry run's figures kept in the JSON (its plan and every rank's are left out).
_KEPT = ("world", "embedding_memory_budget_gib", "planner_error", "misfit", "scaling")


def _summary(result: DryRun) -> dict[str, Any]:
    """The dry run's figures for the world, the slowest rank's step and the most
    loaded rank's memory."""
    data = result.to_dict()
    return {
        **{key: data[key] for key in _KEPT},
        "slowest_rank_step": data["step_time_per_rank"][data["slowest_rank"]],
        "most_loaded_rank_memory": data["memory_per_rank"][data["most_loaded_rank"]],
    }


def _fit_cell(found: dict[str, Any]) -> str:
    if found["fits"]:
        return "yes"
    fewest = found["fewest_ranks_that_fit"]
    return f"no ({fewest})" if fewest else "no"


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'configuration':<22} {'device':<14} {'ranks':>9} {'fits':>9} {'peak GiB':>8} "
        f"{'step ms':>8} {'samples/s':>11} {'eff.':>5} "
        + " ".join(f"{heading:>9}" for heading in SHARES)
    )
    print(header)
    for found in rows:
        ranks = found["hosts"] * found["ranks_per_host"]
        world = f"{ranks} ({found['hosts']}x{found['ranks_per_host']})"
        shares = " ".join(f"{found['shares'][h]:>9.1%}" for h in SHARES)
        print(
            f"{found['configuration']:<22} {found['device']:<14} {world:>9} "
            f"{_fit_cell(found):>9} {found['peak_gib']:>8.1f} {found['step_ms']:>8.2f} "
            f"{found['samples_per_second']:>11,.0f} {found['scaling_efficiency']:>5.0%} {shares}"
        )
    print(
        "ranks: GPUs or hosts (hosts x ranks per host); fits: no (the fewest ranks, in hosts "
        "of the same ranks, that fit); eff.: against one host of the same ranks at the same "
        "global batch; shares of the slowest rank's step"
    )


def main() -> int:
    parser = parser_for(__doc__)
    parser.add_argument("--output", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    from dlrm.app.tensorflow_import import quiet_logs

    quiet_logs(False)
    rows = []
    for case in [*projection_cases(), *published_condition_cases()]:
        try:
            rows.append(row(case, plan(case.argv())))
        except (ConfigError, DryRunError, FeatureSpecError, PlanError) as error:
            print(f"projection: {case.name} on {case.device}: {error}", file=sys.stderr)
            return 1
    print_table(rows)
    if args.output:
        save({"rows": rows}, args.output)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
