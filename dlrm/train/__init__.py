"""What one training step is: the trainer, its learning-rate schedule, mixed
precision, and the trainer's state in a checkpoint."""
