"""What tests and benchmarks share, a module per concern: running things
(`processes`, `assembly`, `spark`, `documents`), their inputs (`datasets`, `models`,
`placements`), checks (`checkpoints`, `rank_weights`, `export`), and clusters on this
machine (`netns`, `elastic_job`, `slurm`, `podman`, with `system` installing what they
need). Metrics logs are read with `dlrm.app.records`."""
