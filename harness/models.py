"""The small models that several test modules train with `main.py`, as flags, and
the tables of the synthetic datasets they train on."""

from __future__ import annotations

# Eight tables of 7 to 5,000 rows.
EIGHT_TABLES = (50, 200, 1000, 30, 5000, 7, 400, 90)
# Adam on widths 8, which learns the synthetic datasets' teacher in one process or
# on several ranks. Flags given after these win.
ADAM_FLAGS = [
    "--batch_size=1024", "--optimizer=adam", "--learning_rate=0.01", "--warmup_steps=0",
    "--decay_start_step=0", "--embedding_dim=8", "--bottom_mlp_dims=32,8", "--top_mlp_dims=32,1",
    "--print_freq=20",
]  # fmt: skip
# Adagrad on widths 8, with a mixed plan on several ranks (tables of at most 2,000
# elements replicated, the others model-parallel): the model whose checkpoints are
# compared across world sizes (harness/checkpoints.py's CROSS_WORLD). Flags
# given after these win.
MIXED_PLAN_FLAGS = [
    "--batch_size=1024", "--optimizer=adagrad", "--learning_rate=0.05", "--warmup_steps=0",
    "--decay_start_step=0", "--embedding_dim=8", "--bottom_mlp_dims=32,8", "--top_mlp_dims=32,1",
    "--print_freq=10", "--evals_per_epoch=0", "--data_parallel_threshold=2000",
]  # fmt: skip

# Six tables for a 2-rank job of `JOB_STEPS` steps (the `slurm/` scripts', the
# training image's): the two smallest replicated, the others (more than 500 elements)
# model-parallel, with alltoalls between the ranks.
JOB_TABLES = (23, 200, 1000, 7, 5000, 90)
JOB_STEPS = 20
JOB_FLAGS = [
    "--batch_size=512", "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1",
    f"--max_steps={JOB_STEPS}", "--learning_rate=0.1", "--warmup_steps=0", "--decay_start_step=0",
    "--print_freq=10", "--data_parallel_threshold=500",
]  # fmt: skip
