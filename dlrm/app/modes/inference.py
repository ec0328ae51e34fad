"""`--mode inference`: prediction throughput and latency over the test split."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from dataloading.split_binary import (
    LastBatch,
    SplitBinaryDataset,
    raise_dataset_errors,
)
from dlrm.app.assembly import AssembledRun
from dlrm.app.restore import restore_weights
from feature_spec import TEST_MAPPING


def run_inference(run: AssembledRun) -> dict[str, Any]:
    """Prediction throughput and latency over the test split, batch by batch."""
    config = run.config
    if config.restore_checkpoint_path:
        restore_weights(run, config.restore_checkpoint_path)
    test = SplitBinaryDataset(
        run.spec,
        TEST_MAPPING,
        run.shard(config.eval_batch_size),
        last_batch=LastBatch.PAD,
        check_batch_ids=config.check_ids,
    )
    steps = config.max_steps if config.max_steps > 0 else test.num_batches
    warmup = config.benchmark_warmup_steps
    latencies = []
    dataset = raise_dataset_errors(test.to_tf_dataset().repeat())
    for index, batch in enumerate(itertools.islice(dataset, steps + warmup)):
        start = time.perf_counter()
        run.predictor.predict(batch.numerical, batch.categorical).numpy()
        if index >= warmup:
            latencies.append(time.perf_counter() - start)
        if index % config.print_freq == 0:
            run.log.print(f"inference batch {index:,}/{steps + warmup:,}")
    seconds = np.asarray(latencies)
    return {
        "mode": "inference",
        "batch_size": config.eval_batch_size,
        "steps": len(latencies),
        "samples_per_second": config.eval_batch_size / float(seconds.mean()),
        "latency_mean_ms": 1000 * float(seconds.mean()),
        "latency_p50_ms": 1000 * float(np.percentile(seconds, 50)),
        "latency_p90_ms": 1000 * float(np.percentile(seconds, 90)),
        "latency_p99_ms": 1000 * float(np.percentile(seconds, 99)),
    }
