"""DLRM: bottom MLP, embeddings, dot or DCNv2 cross interaction, top MLP.

The model is written unsharded. It looks up categorical ids through an
`embeddings` layer given to it, so the hybrid-parallel implementation replaces
`LocalEmbeddings` without touching the model, the trainer or `main.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from dlrm.embedding.local import LocalEmbeddings
from dlrm.model.config import ModelConfig
from dlrm.model.interaction import BLOCK_ROWS, CrossInteraction, DotInteraction


def mlp(
    dims: Sequence[int],
    name: str,
    final_activation: str | None = "relu",
    dtype_policy: str = "float32",
) -> keras.Sequential:
    """Dense layers as NVIDIA initialises them: Glorot-normal kernels, biases
    normal with stddev sqrt(1 / width). Under a mixed policy the weights stay
    float32 and the matmuls run in the compute dtype."""
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
                dtype=dtype_policy,
            )
        )
    return keras.Sequential(layers, name=name)


class Dlrm(keras.Model):
    """logit = top_mlp(interaction(bottom_mlp(numerical), embeddings(ids))).

    The forward pass is two halves so the trainer can treat them differently:
    `embeddings` (sparse lookups; collectives when sharded) and `dense_forward`
    (bottom MLP, interaction, top MLP; what `--xla` compiles).

    Args:
        config: the architecture.
        embeddings: an `Embeddings` layer; `LocalEmbeddings` (every table here)
            by default, `ShardedEmbeddings` under horovodrun.
        dtype_policy: "float32", "mixed_bfloat16" or "mixed_float16" for the
            MLPs and interaction; the tables stay float32 whatever the policy.
            The default embeddings give their vectors in the compute dtype (one
            given by the caller should too: `output_dtype`, else the model casts
            them, holding both); under --amp they cross the alltoall in 16 bits.
        seed: seeds the default embeddings' initial values.
        use_xla: the dense part will be compiled by XLA (`--xla`): the dot
            interaction then runs its products over the whole batch, not in
            blocks (see `dlrm.model.interaction`).
        on_gpu: the model runs the GPU code path (on a GPU, or emulated on a
            CPU: `dlrm.distributed.devices.gpu_code_path`): the dot
            interaction's products run over the whole batch there too (its
            blocks are a CPU's cache tuning; a GPU wants large matrices).
        use_kernels: the project's CPU kernels (`dlrm.kernels`; the caller
            checks that they are built and that the model runs on CPUs): the
            dot interaction runs on its kernel (not under `use_xla`, which
            compiles TensorFlow's ops only), the default embeddings look one-hot
            ids up with one op (`LocalEmbeddings`; a given layer has its own
            `use_kernels`), and the trainer checks the gradients with
            `DlrmAllFinite`.
        table_dtype: what the default embeddings' tables store: "float32",
            "bfloat16" or "float16" (`Embeddings`; `--embedding_dtype`).
    """

    def __init__(
        self,
        config: ModelConfig,
        embeddings: keras.layers.Layer | None = None,
        dtype_policy: str = "float32",
        seed: int = 0,
        use_xla: bool = False,
        use_kernels: bool = False,
        on_gpu: bool = False,
        table_dtype: str = "float32",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.config = config
        self.dtype_policy_name = dtype_policy
        self.use_kernels = use_kernels
        self.bottom_mlp = mlp(config.bottom_mlp_dims, "bottom_mlp", dtype_policy=dtype_policy)
        self.embeddings = embeddings or LocalEmbeddings(
            config.cardinalities,
            config.embedding_dims,
            seed=seed,
            hotness=config.hotness,
            pooling=config.poolings,
            output_dtype=keras.DTypePolicy(dtype_policy).compute_dtype,
            use_kernels=use_kernels,
            table_dtype=table_dtype,
        )
        if tuple(self.embeddings.dims) != config.embedding_dims:
            raise ValueError(
                f"embeddings: the layer's widths {list(self.embeddings.dims)} are not the "
                f"model's {list(config.embedding_dims)}"
            )
        self.interaction: keras.layers.Layer
        if config.interaction == "cross":
            self.interaction = CrossInteraction(
                config.num_cross_layers,
                config.cross_layer_projection_dim,
                name="cross_interaction",
                dtype=dtype_policy,
            )
        else:
            block_rows = None if use_xla or on_gpu else BLOCK_ROWS
            self.interaction = DotInteraction(
                block_rows=block_rows, use_kernel=use_kernels and not use_xla, dtype=dtype_policy
            )
        self.top_mlp = mlp(
            config.top_mlp_dims, "top_mlp", final_activation=None, dtype_policy=dtype_policy
        )

    def build_all(self) -> None:
        """Creates every variable (Keras creates them lazily on first call)."""
        c = self.config
        numerical = tf.zeros([1, c.num_numerical], tf.float32)
        vectors = tf.zeros([1, sum(c.embedding_dims)], tf.float32)
        self.dense_forward(numerical, vectors)

    @property
    def dense_variables(self) -> list[Any]:
        """Weights of the data-parallel part (MLPs, cross layers), in a fixed order."""
        return [
            *self.bottom_mlp.trainable_variables,
            *self.interaction.trainable_variables,
            *self.top_mlp.trainable_variables,
        ]

    def dense_forward(self, numerical: tf.Tensor, vectors: tf.Tensor) -> tf.Tensor:
        """numerical [B, n_numerical] float32, vectors [B, sum of D_t] (the
        tables' vectors side by side) -> logits [B, 1] float32."""
        dense = self.bottom_mlp(numerical)
        interactions = self.interaction(dense, tf.cast(vectors, dense.dtype))
        return tf.cast(self.top_mlp(interactions), tf.float32)

    def call(self, numerical: tf.Tensor, categorical: Any) -> tf.Tensor:
        """numerical [B, n_numerical], ids as the embeddings take them -> logits [B, 1]."""
        return self.dense_forward(numerical, self.embeddings(categorical, tf.shape(numerical)[0]))
