"""`--device local`: this machine's figures, measured. Matmul rates come from the
probe `--amp` uses (`dlrm.train.precision.matmul_gflops`, every CPU thread), memory
bandwidth from a numpy copy, and the runtime baseline from a child process that
imports TensorFlow and Horovod and runs one op (its peak RSS). Links cannot be
measured from one host: they are assumed (`LOCAL_LINKS`) unless given as flags."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from dlrm.planning.devices import BUILTIN_DEVICES, GIB, LOCAL_DEVICE, DeviceSpec
from dlrm.planning.errors import DryRunError

# Assumed: Horovod's gloo over loopback TCP within the host, 10 GbE between hosts;
# a collective round as measured on the development machine (`devices`).
LOCAL_LINKS = {
    "intra_host_gbit_s": 20.0,
    "intra_host_latency_us": 20.0,
    "inter_host_gbit_s": 10.0,
    "inter_host_latency_us": 50.0,
    "collective_overhead_us": BUILTIN_DEVICES["cpu-avx2-2core"].collective_overhead_us,
}

# Copied per timing: larger than the caches, small next to the tables.
COPY_BYTES = 256 * 2**20

# The child's peak is read from /proc (VmHWM: this process's own pages): its
# getrusage maxrss would start from the parent's RSS at the fork, which Linux
# carries across exec.
_BASELINE_SCRIPT = """
import re
import tensorflow as tf
try:
    import horovod.tensorflow  # noqa: F401
except ImportError:
    pass
(tf.constant([1.0]) + 1.0).numpy()
status = open("/proc/self/status").read()
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024)
"""


def memory_bandwidth_bytes_per_s(repeats: int = 5) -> float:
    """Best bytes/s of a numpy copy (each byte read once and written once)."""
    source = np.ones(COPY_BYTES // 8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / max(best, 1e-9)


def runtime_baseline_bytes() -> int:
    """Peak RSS of a fresh process that imported TensorFlow (and Horovod, where
    installed) and ran one op: what every rank holds before the model."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run(
        [sys.executable, "-c", _BASELINE_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    lines = result.stdout.split()
    if result.returncode != 0 or not lines:
        raise DryRunError(
            f"--device local: the runtime probe (import TensorFlow, run one op) failed: "
            f"{result.stderr.strip()[-500:]}"
        )
    return int(lines[-1])


def local_device() -> DeviceSpec:
    """This machine as a CPU server whose ranks share it."""
    import tensorflow as tf

    from dlrm.train.precision import matmul_gflops

    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    baseline = runtime_baseline_bytes()
    return DeviceSpec(
        name=LOCAL_DEVICE,
        memory_gib=pages / GIB,
        fp32_tflops=matmul_gflops(tf.float32) / 1e3,
        fp16_tflops=matmul_gflops(tf.bfloat16) / 1e3,
        memory_bandwidth_gb_s=memory_bandwidth_bytes_per_s() / 1e9,
        runtime_baseline_gib=baseline / GIB,
        shared_by_host_ranks=True,
        source=(
            "this machine, measured (matmul probe, numpy copy, the RSS of TensorFlow and "
            "Horovod); links assumed: gloo over loopback TCP, 10 GbE between hosts"
        ),
        **LOCAL_LINKS,
    )
