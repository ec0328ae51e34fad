"""The devices a dry run can plan for: one rank's memory, compute rates and
memory bandwidth, and the links between ranks within and between hosts.

Built-in entries (`BUILTIN_DEVICES`) give each figure with its source. A user's
table (`--device_table PATH`, YAML or JSON: a mapping of device names to fields in
the units of `DeviceSpec`) is merged over them: an entry with a built-in name
changes the fields it gives, a new name must give every field without a default.

Link rates are **per direction**: the times of `timing` divide the bytes a rank
sends by the rate of its link, while what it receives travels the other way at
the same time. A maker's "bidirectional" figure (NVLink: 600 GB/s on A100, 900 GB/s
on H100 and H200) is therefore halved here (300 and 450 GB/s). InfiniBand rates
(HDR 200 Gb/s, NDR 400 Gb/s) are per direction already.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dlrm.planning.errors import DryRunError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One rank's device and its links, in the units a user writes them in.

    Attributes:
        name: the `--device` value.
        memory_gib: memory one rank may use (a CPU host's whole memory when
            `shared_by_host_ranks`).
        fp32_tflops, tf32_tflops, fp16_tflops: dense peak rates in float32, in
            TF32 (the tensor cores' float32 matmuls, which TensorFlow uses for
            float32 by default on Ampere and later; None on CPUs) and in
            float16/bfloat16 (`--amp`).
        matmul_efficiency: the share of the peak the model's matmuls reach (1.0
            for figures measured with the matmul probe).
        memory_bandwidth_gb_s: GB/s (10^9 bytes) of memory bandwidth.
        intra_host_gbit_s, intra_host_latency_us: the link between two ranks of a
            host, per direction, and one message's latency.
        inter_host_gbit_s, inter_host_latency_us: a rank's link to other hosts.
        collective_overhead_us: what one round of collectives costs beyond its
            bytes and its links' latency: Horovod's background thread takes a
            submitted collective at its next cycle and negotiates it among the
            ranks before it runs.
        runtime_baseline_gib: what a rank holds before the model (TensorFlow,
            Horovod, the CUDA context): part of the measured peak on a CPU.
        shared_by_host_ranks: the figures are a host's (a CPU server): the ranks
            of a host share its memory, compute, bandwidth and network link, and
            run the CPU path (the dense part in chunks). False: a GPU.
        source: where the figures come from.
    """

    name: str
    memory_gib: float
    fp32_tflops: float
    fp16_tflops: float
    memory_bandwidth_gb_s: float
    intra_host_gbit_s: float
    inter_host_gbit_s: float
    tf32_tflops: float | None = None
    matmul_efficiency: float = 1.0
    intra_host_latency_us: float = 5.0
    inter_host_latency_us: float = 10.0
    collective_overhead_us: float = 0.0
    runtime_baseline_gib: float = 0.0
    shared_by_host_ranks: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("name", "source", "shared_by_host_ranks") or value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise DryRunError(
                    f"device {self.name!r}: {field.name}: expected a number, got {value!r}"
                )
            minimum_ok = value >= 0 if field.name.endswith(("_us", "_gib")) else value > 0
            if not minimum_ok or (field.name == "matmul_efficiency" and value > 1):
                raise DryRunError(
                    f"device {self.name!r}: {field.name}: expected a positive number "
                    f"(matmul_efficiency at most 1), got {value!r}"
                )

    def per_rank(self, ranks_per_host: int) -> DeviceSpec:
        """What one of `ranks_per_host` ranks of a host gets: the same device, or
        (`shared_by_host_ranks`) its share of a host's memory, compute, memory
        bandwidth and network link."""
        if not self.shared_by_host_ranks or ranks_per_host == 1:
            return self
        share = 1 / ranks_per_host
        return dataclasses.replace(
            self,
            memory_gib=self.memory_gib * share,
            fp32_tflops=self.fp32_tflops * share,
            fp16_tflops=self.fp16_tflops * share,
            tf32_tflops=None if self.tf32_tflops is None else self.tf32_tflops * share,
            memory_bandwidth_gb_s=self.memory_bandwidth_gb_s * share,
            inter_host_gbit_s=self.inter_host_gbit_s * share,
        )

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    def matmul_flops_per_s(self, use_amp: bool) -> float:
        """The rate the dense part runs at: float16/bfloat16 under `--amp`, else
        TF32 where the device has it (TensorFlow's float32 default), else float32;
        times `matmul_efficiency`."""
        if use_amp:
            peak = self.fp16_tflops
        else:
            peak = self.tf32_tflops if self.tf32_tflops is not None else self.fp32_tflops
        return peak * 1e12 * self.matmul_efficiency


# Assumed, not from a datasheet: a small message's latency (NCCL within a host over
# NVLink, and over InfiniBand between hosts), and the share of peak a DLRM's MLP
# matmuls reach on a GPU (widths 256 to 1024: far from the peak's large squares).
_GPU_INTRA_LATENCY_US = 5.0
_GPU_INTER_LATENCY_US = 10.0
_GPU_MATMUL_EFFICIENCY = 0.5
# Assumed: Horovod's default cycle on GPUs is 1 ms; a collective submitted waits for
# the next cycle, then for the ranks' negotiation, before NCCL runs it.
_GPU_COLLECTIVE_OVERHEAD_US = 1000.0
# Measured on the development machine (benchmarks/collective_round.py): a one-value
# allreduce and alltoall in a loop under horovodrun --gloo on 2 ranks, at the CPU
# path's 3 ms cycle (dlrm.distributed.collectives.CPU_DEFAULTS): 3.9 and 5.3 ms each
# in one run, 5.4 and 9.2 in another (docs/scaling.md).
_CPU_COLLECTIVE_OVERHEAD_US = 4600.0
# Assumed: what a GPU rank holds outside TensorFlow's allocator (CUDA context,
# cuBLAS/cuDNN workspaces, NCCL buffers).
_GPU_RUNTIME_GIB = 1.0
# Measured on the development machine: peak RSS of a process that imported
# TensorFlow 2.21 and Horovod 0.28.1 and ran one op (603,439,104 bytes).
_CPU_RUNTIME_GIB = 0.562

BUILTIN_DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec(
            name="A100-80GB-SXM",
            # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): 80 GB HBM2e
            # (81,920 MiB as nvidia-smi reports it), 2,039 GB/s; FP32 19.5, TF32
            # 156, FP16/BF16 312 TFLOPS dense (the datasheet's larger figures are
            # with sparsity); NVLink 600 GB/s bidirectional (300 per direction).
            # DGX A100 user guide: 8 ConnectX-6 HDR InfiniBand 200 Gb/s, one per GPU.
            memory_gib=80.0,
            fp32_tflops=19.5,
            tf32_tflops=156.0,
            fp16_tflops=312.0,
            matmul_efficiency=_GPU_MATMUL_EFFICIENCY,
            memory_bandwidth_gb_s=2039.0,
            intra_host_gbit_s=300 * 8,
            inter_host_gbit_s=200,
            intra_host_latency_us=_GPU_INTRA_LATENCY_US,
            inter_host_latency_us=_GPU_INTER_LATENCY_US,
            collective_overhead_us=_GPU_COLLECTIVE_OVERHEAD_US,
            runtime_baseline_gib=_GPU_RUNTIME_GIB,
            source="NVIDIA A100 datasheet; DGX A100 user guide (HDR 200 Gb/s per GPU)",
        ),
        DeviceSpec(
            name="H100-80GB-SXM",
            # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): 80 GB HBM3 (81,559
            # MiB in nvidia-smi), 3.35 TB/s; FP32 67, TF32 494.7, FP16/BF16 989.4
            # TFLOPS dense (989/1,979 with sparsity); NVLink 900 GB/s bidirectional
            # (450 per direction). DGX H100 user guide: 8 ConnectX-7 NDR InfiniBand
            # 400 Gb/s, one per GPU.
            memory_gib=81559 / 1024,
            fp32_tflops=66.9,
            tf32_tflops=494.7,
            fp16_tflops=989.4,
            matmul_efficiency=_GPU_MATMUL_EFFICIENCY,
            memory_bandwidth_gb_s=3350.0,
            intra_host_gbit_s=450 * 8,
            inter_host_gbit_s=400,
            intra_host_latency_us=_GPU_INTRA_LATENCY_US,
            inter_host_latency_us=_GPU_INTER_LATENCY_US,
            collective_overhead_us=_GPU_COLLECTIVE_OVERHEAD_US,
            runtime_baseline_gib=_GPU_RUNTIME_GIB,
            source="NVIDIA H100 datasheet; DGX H100 user guide (NDR 400 Gb/s per GPU)",
        ),
        DeviceSpec(
            name="H200-141GB",
            # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): 141 GB HBM3e
            # (143,771 MiB in nvidia-smi), 4.8 TB/s; the H100's compute (FP32 67,
            # TF32 494.7, FP16/BF16 989.4 TFLOPS dense); NVLink 900 GB/s
            # bidirectional. HGX H200 with NDR 400 Gb/s per GPU, as DGX H100.
            memory_gib=143771 / 1024,
            fp32_tflops=66.9,
            tf32_tflops=494.7,
            fp16_tflops=989.4,
            matmul_efficiency=_GPU_MATMUL_EFFICIENCY,
            memory_bandwidth_gb_s=4800.0,
            intra_host_gbit_s=450 * 8,
            inter_host_gbit_s=400,
            intra_host_latency_us=_GPU_INTRA_LATENCY_US,
            inter_host_latency_us=_GPU_INTER_LATENCY_US,
            collective_overhead_us=_GPU_COLLECTIVE_OVERHEAD_US,
            runtime_baseline_gib=_GPU_RUNTIME_GIB,
            source="NVIDIA H200 datasheet (NDR 400 Gb/s per GPU assumed, as DGX H100)",
        ),
        DeviceSpec(
            name="cpu-avx2-2core",
            # The development machine (2 cores of an AMD EPYC, AVX2 + FMA, 23 GiB),
            # measured: dlrm.train.precision.matmul_gflops 66 GFLOP/s in float32,
            # 53 in bfloat16; numpy copy 15.6 GB/s (read + write). Links assumed:
            # Horovod's gloo over loopback TCP within the host, 10 GbE between.
            memory_gib=23.0,
            fp32_tflops=0.066,
            fp16_tflops=0.053,
            memory_bandwidth_gb_s=15.6,
            intra_host_gbit_s=20.0,
            inter_host_gbit_s=10.0,
            intra_host_latency_us=20.0,
            inter_host_latency_us=50.0,
            collective_overhead_us=_CPU_COLLECTIVE_OVERHEAD_US,
            runtime_baseline_gib=_CPU_RUNTIME_GIB,
            shared_by_host_ranks=True,
            source="measured on the development machine (matmul and copy probes)",
        ),
        DeviceSpec(
            name="cpu-64core",
            # A generic 64-core server, after AMD's EPYC 7763 product page: 64 cores
            # at 2.45 GHz, AVX2 with two 256-bit FMA units (32 float32 FLOP per cycle
            # per core: 5.0 TFLOPS peak; no bfloat16 matmul instructions, so --amp
            # gains nothing), 8 channels of DDR4-3200 (204.8 GB/s); 512 GiB; 100 GbE.
            # Efficiency assumed: half the peak, as oneDNN reaches on DLRM's widths.
            memory_gib=512.0,
            fp32_tflops=5.02,
            fp16_tflops=5.02,
            matmul_efficiency=0.5,
            memory_bandwidth_gb_s=204.8,
            intra_host_gbit_s=200.0,
            inter_host_gbit_s=100.0,
            intra_host_latency_us=20.0,
            inter_host_latency_us=30.0,
            collective_overhead_us=_CPU_COLLECTIVE_OVERHEAD_US,
            runtime_baseline_gib=_CPU_RUNTIME_GIB,
            shared_by_host_ranks=True,
            source="AMD EPYC 7763 product page (cores, clock, DDR4-3200 x 8); 100 GbE",
        ),
    )
}

# `--device local`: this machine, probed (`dlrm.planning.probe`).
LOCAL_DEVICE = "local"


def device_table(path: str | os.PathLike[str] | None = None) -> dict[str, DeviceSpec]:
    """The built-in devices, with the entries of the YAML or JSON file at `path`
    merged over them (DryRunError naming the file and the entry)."""
    table = dict(BUILTIN_DEVICES)
    if path is None:
        return table
    try:
        text = Path(path).read_text()
        raw = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise DryRunError(f"--device_table {path}: cannot read it: {error}") from error
    if not isinstance(raw, Mapping):
        raise DryRunError(
            f"--device_table {path}: expected a mapping of device names to their fields, "
            f"got {type(raw).__name__}"
        )
    for name, fields in raw.items():
        table[str(name)] = _entry(str(name), fields, table.get(str(name)), path)
    return table


def _entry(
    name: str, fields: Any, base: DeviceSpec | None, path: str | os.PathLike[str]
) -> DeviceSpec:
    """Device `name` of a user's table: `fields` over the built-in `base`, if any."""
    known = {f.name for f in dataclasses.fields(DeviceSpec)} - {"name"}
    if not isinstance(fields, Mapping) or set(fields) - known:
        unknown = sorted(set(fields) - known) if isinstance(fields, Mapping) else fields
        raise DryRunError(
            f"--device_table {path}: device {name!r}: unknown fields {unknown}; "
            f"expected some of {sorted(known)}"
        )
    values = {**(dataclasses.asdict(base) if base else {}), **fields, "name": name}
    try:
        return DeviceSpec(**values)
    except TypeError as error:
        raise DryRunError(f"--device_table {path}: device {name!r}: {error}") from error


def device_named(name: str, table: Mapping[str, DeviceSpec]) -> DeviceSpec:
    """The entry `name` of `table`; DryRunError naming it and the valid choices."""
    if name not in table:
        choices = ", ".join([*table, LOCAL_DEVICE])
        raise DryRunError(f"--device: unknown device {name!r}; expected one of {choices}")
    return table[name]
