"""Embedding tables behind one interface.

`local.LocalEmbeddings` holds every table on this process;
`sharded.ShardedEmbeddings` executes a `planner.ShardingPlan` across Horovod
ranks with the same call (ids in, [B, T, D] vectors out) and the same
`table_slice`/`assign_table_slice` view for checkpoints, so the model, trainer
and `main.py` do not change when tables are sharded.

This package file imports nothing: the planner is pure Python, and importing it
(`dlrm.embedding.planner`) must not load TensorFlow or Horovod.
"""
