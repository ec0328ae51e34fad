"""Run under horovodrun: each rank reads its shard of a dataset and checks it with
collectives against what rank 0 reads for the whole global batch.

Usage: read_shards.py DATASET_DIR OUT_DIR GLOBAL_BATCH
Writes OUT_DIR/rank<r>.npz with the rank's labels and ids.
"""

import sys
from pathlib import Path

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from dataloading.split_binary import InputMode, ShardSpec, SplitBinaryDataset
from feature_spec import FeatureSpec


def main() -> None:
    dataset_dir, out_dir, global_batch = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    spec = FeatureSpec.load(dataset_dir)
    tables = tuple(t for t in range(len(spec.categorical_features)) if t % size == rank)
    model_parallel = SplitBinaryDataset(
        spec, "train", ShardSpec(global_batch, rank, size, tables, InputMode.MODEL_PARALLEL)
    )
    data_parallel = SplitBinaryDataset(
        spec, "train", ShardSpec(global_batch, rank, size, input_mode=InputMode.DATA_PARALLEL)
    )
    whole_batches = SplitBinaryDataset(spec, "train", ShardSpec(global_batch))
    labels, ids = [], []
    for mp, dp in zip(model_parallel.to_tf_dataset(), data_parallel.to_tf_dataset(), strict=True):
        # The ranks' local labels, gathered in rank order, are the global batch's.
        gathered = hvd.allgather(mp.label)
        whole = whole_batches.read_batch(len(labels))
        np.testing.assert_array_equal(gathered.numpy(), whole.label)
        # Data-parallel ids of local rows, gathered, equal the global batch's ids.
        np.testing.assert_array_equal(hvd.allgather(dp.categorical).numpy(), whole.categorical)
        np.testing.assert_array_equal(mp.categorical.numpy(), whole.categorical[:, list(tables)])
        labels.append(mp.label.numpy())
        ids.append(mp.categorical.numpy())
    total = hvd.allreduce(tf.constant(float(len(labels))), op=hvd.Sum)
    np.savez(
        out_dir / f"rank{rank}.npz",
        labels=np.concatenate(labels),
        ids=np.concatenate(ids),
        tables=np.array(tables),
        batches_seen_by_all=total.numpy(),
    )


if __name__ == "__main__":
    main()
