"""`dlrm-plan`: a dry run of `dlrm-train` on a cluster that need not exist.

From the model flags and a FeatureSpec (or cardinalities and hotness given as
flags) and a world of hosts x ranks of a device (`devices`: a table of GPUs and
CPUs, extendable from a file, or this machine probed), it plans the tables with
the project's planner and predicts, without training and without Horovod:

- `memory`: each rank's peak memory, term by term, whether it fits, and where
  it does not, the first table that does not fit and the smallest world that fits;
- `timing`: a step's time, term by term, samples/s and the scaling efficiency
  against one host.

`dry_run` puts them together as one `DryRun` (console table and JSON); `cli` is
the command.
"""
