"""The optimizers' names, as `--optimizer` takes them (no TensorFlow)."""

from __future__ import annotations

OPTIMIZERS = ("sgd", "adagrad", "adam")
