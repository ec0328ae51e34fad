"""The embedding sharding planner: table sizes in, a `ShardingPlan` out.

Pure computation (the standard library, the shard types and `feature_spec.staged`;
importing it loads numpy and yaml, never TensorFlow or Horovod):
`placement.plan_sharding(tables, config)` decides for every table a kind and its
shards, and returns a frozen, JSON-serialisable `plan.ShardingPlan` that the
hybrid-parallel embedding layer, the input pipeline and the checkpoints read.
Kinds:

- `data_parallel`: replicated; one shard per rank, each the whole table.
- `table_wise`: one shard, the whole table, on one rank.
- `column_wise`: column slices over full rows, on distinct ranks.
- `row_wise`: row ranges over full columns, on distinct ranks.

Cost model (`cost`), per shard of `r` rows and `c` columns: memory is
`r * (c * dtype_bytes + 4 * (c * optimizer_slots + row_slots))` (a 16-bit
table's values take 2 bytes, its float32 slots 4; row-wise Adagrad keeps one
value a row); lookup traffic is
`hotness * c * dtype_bytes` per sample of the global batch (a row shard sends
`c` columns per sample too: it takes part in the reduction). Strategies place
the shards of model-parallel tables: `cost` (greedy on the larger of the memory
and lookup shares), `memory_balanced` (greedy on memory) and `basic` (round
robin, the baseline). `report` prints a plan. See docs/sharding.md for the
thresholds and their defaults.
"""
