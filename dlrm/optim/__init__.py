"""The optimizers: dense updates for the MLPs, row updates for the embedding tables."""
