"""One rank under horovodrun: the CPU share `HorovodCollectives` gave it, and
its CPU-only Horovod defaults.

    thread_share.py OUT_DIR [--nobind_cpus]

Writes rank<N>.json: the threads `share_cpus` set (or None), the intra-op
threads TensorFlow is configured with (0: its default), the CPUs the rank was
bound to (or None), the CPUs each of its threads may use once TensorFlow ran,
the ranks on this host and the Horovod cycle time hvd.init() read.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import tensorflow as tf

from dlrm.distributed.collectives import HorovodCollectives


def main() -> None:
    collectives = HorovodCollectives(bind_cpus="--nobind_cpus" not in sys.argv)
    tf.constant(1.0) + 1.0  # TensorFlow starts with its pools as set
    import horovod.tensorflow as hvd

    facts = {
        "set": collectives.intra_op_threads,
        "configured": tf.config.threading.get_intra_op_parallelism_threads(),
        "cpus": len(os.sched_getaffinity(0)),
        "bound": collectives.bound_cpus,
        "threads": sorted(
            {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
        ),
        "local_ranks": hvd.local_size(),
        "cycle_time": os.environ.get("HOROVOD_CYCLE_TIME"),
    }
    Path(sys.argv[1], f"rank{collectives.rank}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
