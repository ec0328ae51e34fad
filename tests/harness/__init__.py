"""What tests and benchmarks share: running the project's commands
(`processes`), comparing two runs' checkpoints (`checkpoints`), and the clusters
they start on this machine: network-namespace hosts (`netns`), a Horovod
Elastic job on them (`elastic_job`), Slurm (`slurm`) and podman (`podman`)."""
