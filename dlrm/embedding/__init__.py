"""Embedding tables behind one interface.

`shard.TableShard` and `shard.ShardingKind` describe a piece of a table, from the
plan to the layer to the checkpoint manifest. `planner.plan_sharding` places the
tables (pure Python); `local.LocalEmbeddings` holds every table on this process;
`sharded.ShardedEmbeddings` executes a `planner.ShardingPlan` across Horovod ranks.
Both layers implement `base.Embeddings` (a lookup in three steps, and the
`local_shards` view that checkpoints read), so the model, trainer and `main.py`
do not change when tables are sharded.

This package file imports nothing: the planner and the shard type are pure
Python, and importing them must not load TensorFlow or Horovod.
"""
