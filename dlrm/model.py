"""DLRM: bottom MLP, embeddings, dot interaction, top MLP.

The model is written unsharded. It looks up categorical ids through an
`embeddings` layer given to it, so the hybrid-parallel implementation replaces
`LocalEmbeddings` without touching the model, the trainer or `main.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from dlrm.interaction import DotInteraction


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture. Table sizes come from the FeatureSpec, never from flags."""

    num_numerical: int
    cardinalities: tuple[int, ...]
    hotness: tuple[int, ...]
    embedding_dim: int = 128
    bottom_mlp_dims: tuple[int, ...] = (512, 256, 128)
    top_mlp_dims: tuple[int, ...] = (1024, 1024, 512, 256, 1)

    def __post_init__(self) -> None:
        if self.bottom_mlp_dims and self.bottom_mlp_dims[-1] != self.embedding_dim:
            raise ValueError(
                f"--bottom_mlp_dims: the last width must equal --embedding_dim "
                f"({self.embedding_dim}) for the dot interaction, got {self.bottom_mlp_dims[-1]}"
            )
        if not self.top_mlp_dims or self.top_mlp_dims[-1] != 1:
            raise ValueError(
                f"--top_mlp_dims: the last width must be 1 (the click logit), "
                f"got {list(self.top_mlp_dims)}"
            )
        if len(self.hotness) != len(self.cardinalities):
            raise ValueError(
                f"hotness: expected one value per table ({len(self.cardinalities)}), "
                f"got {len(self.hotness)}"
            )


def mlp(dims: Sequence[int], name: str, final_activation: str | None = "relu") -> keras.Sequential:
    """Dense layers as NVIDIA initialises them: Glorot-normal kernels, biases
    normal with stddev sqrt(1 / width)."""
    layers = []
    for index, width in enumerate(dims):
        last = index == len(dims) - 1
        layers.append(
            keras.layers.Dense(
                width,
                activation=final_activation if last else "relu",
                kernel_initializer=keras.initializers.GlorotNormal(),
                bias_initializer=keras.initializers.RandomNormal(stddev=math.sqrt(1.0 / width)),
                name=f"{name}_{index}",
            )
        )
    return keras.Sequential(layers, name=name)


class LocalEmbeddings(keras.layers.Layer):
    """Every table on this process: one variable [rows, D] each.

    Initialised uniform in +-sqrt(1 / rows), as the reference DLRM. Multi-hot
    rows are pooled by sum.

    Call with ids [B, T] int32 (all one-hot) or a sequence of T tensors
    [B, hotness_t]; returns [B, T, D].
    """

    def __init__(self, cardinalities: Sequence[int], dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cardinalities = tuple(cardinalities)
        self.dim = dim
        self.tables = []
        for index, rows in enumerate(self.cardinalities):
            limit = math.sqrt(1.0 / rows)
            self.tables.append(
                self.add_weight(
                    shape=(rows, dim),
                    initializer=keras.initializers.RandomUniform(-limit, limit),
                    name=f"table_{index}",
                    dtype="float32",
                )
            )

    def call(self, ids: Any) -> tf.Tensor:
        if isinstance(ids, (tuple, list)):
            vectors = [
                tf.reduce_sum(tf.gather(table, table_ids), axis=1)
                for table, table_ids in zip(self.tables, ids, strict=True)
            ]
        else:
            vectors = [tf.gather(table, ids[:, t]) for t, table in enumerate(self.tables)]
        return tf.stack(vectors, axis=1)


class Dlrm(keras.Model):
    """logit = top_mlp(interaction(bottom_mlp(numerical), embeddings(ids)))."""

    def __init__(
        self, config: ModelConfig, embeddings: keras.layers.Layer | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.config = config
        self.bottom_mlp = mlp(config.bottom_mlp_dims, "bottom_mlp")
        self.embeddings = embeddings or LocalEmbeddings(config.cardinalities, config.embedding_dim)
        self.interaction = DotInteraction()
        self.top_mlp = mlp(config.top_mlp_dims, "top_mlp", final_activation=None)

    def call(self, numerical: tf.Tensor, categorical: Any) -> tf.Tensor:
        """numerical [B, n_numerical], ids as `LocalEmbeddings` takes them -> logits [B, 1]."""
        dense = self.bottom_mlp(numerical)
        vectors = tf.cast(self.embeddings(categorical), dense.dtype)
        return self.top_mlp(self.interaction(dense, vectors))
