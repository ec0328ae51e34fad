"""The tf.Variable behind a Keras 3 variable.

Lookups, gradients and updates of the tables, the optimizers' raw training ops
and the checkpoints' row reads and writes all work on the tf.Variable itself:
a Keras 3 variable read as a tensor copies the whole table (see
`Embeddings.create_shard_variable`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def resource_variable(variable: Any) -> tf.Variable:
    """The tf.Variable behind a Keras 3 variable (or the variable itself)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def variable_name(variable: Any) -> str:
    """A stable name for checkpoints: the Keras path, else the tf.Variable name."""
    path = getattr(variable, "path", None)
    return str(path) if path else str(variable.name).split(":")[0]
