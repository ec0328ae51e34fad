"""The model's architecture as data (no TensorFlow): `ModelConfig`, the
choices it takes, and what an old checkpoint's manifest means by a field it lacks."""

from __future__ import annotations

import dataclasses
from typing import Any

INTERACTIONS = ("dot", "cross")
POOLINGS = ("sum", "mean")
# The architecture a run gets when its flags do not say (NVIDIA's DLRM for Criteo).
DEFAULT_EMBEDDING_DIM = 128
DEFAULT_BOTTOM_MLP_DIMS = (512, 256, 128)
DEFAULT_TOP_MLP_DIMS = (1024, 1024, 512, 256, 1)


# What a checkpoint manifest written before a field existed means by it.
LEGACY_VALUES: dict[str, Any] = {
    "interaction": "dot",
    "num_cross_layers": 0,
    "cross_layer_projection_dim": 0,
    "pooling": "sum",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture. Table sizes come from the FeatureSpec, never from flags.

    `embedding_dim` is one width for every table, or one per table (`cross`
    only; a tuple of equal widths is stored as the one width). The cross fields
    are 0 for the `dot` interaction, which has no cross layers;
    `cross_layer_projection_dim` 0 means full-rank cross layers. `hotness` is
    ids per row per table, 0 for a variable number; `pooling` ("sum" or "mean",
    one, or one per table) how a row's vectors are pooled.

    The settings' values are validated where they enter, as flags (`RunConfig`);
    here only what needs the dataset's tables: one value, or one per table.
    """

    num_numerical: int
    cardinalities: tuple[int, ...]
    hotness: tuple[int, ...]
    embedding_dim: int | tuple[int, ...] = DEFAULT_EMBEDDING_DIM
    bottom_mlp_dims: tuple[int, ...] = DEFAULT_BOTTOM_MLP_DIMS
    top_mlp_dims: tuple[int, ...] = DEFAULT_TOP_MLP_DIMS
    interaction: str = INTERACTIONS[0]
    num_cross_layers: int = 0
    cross_layer_projection_dim: int = 0
    pooling: str | tuple[str, ...] = POOLINGS[0]

    def __post_init__(self) -> None:
        pooling = self.pooling
        if isinstance(pooling, (tuple, list)):
            if len(pooling) not in (1, len(self.cardinalities)):
                raise ValueError(
                    f"--pooling: expected one value or one per table (the FeatureSpec has "
                    f"{len(self.cardinalities)} categorical features), got {len(pooling)}: "
                    f"{','.join(pooling)}"
                )
            pooling = pooling[0] if len(set(pooling)) == 1 else tuple(pooling)
            object.__setattr__(self, "pooling", pooling)
        dims = self.embedding_dim
        if isinstance(dims, (tuple, list)):
            if len(dims) not in (1, len(self.cardinalities)):
                raise ValueError(
                    f"--embedding_dim: expected one width or one per table (the FeatureSpec "
                    f"has {len(self.cardinalities)} categorical features), got {len(dims)}: "
                    f"{','.join(map(str, dims))}"
                )
            if len(set(dims)) == 1:
                object.__setattr__(self, "embedding_dim", int(dims[0]))
            else:
                object.__setattr__(self, "embedding_dim", tuple(int(d) for d in dims))
        if self.interaction == "dot" and (self.num_cross_layers or self.cross_layer_projection_dim):
            raise ValueError(
                "num_cross_layers, cross_layer_projection_dim: expected 0 for the dot "
                f"interaction, got {self.num_cross_layers} and {self.cross_layer_projection_dim}"
            )
        if len(self.hotness) != len(self.cardinalities):
            raise ValueError(
                f"hotness: expected one value per table ({len(self.cardinalities)}), "
                f"got {len(self.hotness)}"
            )

    @property
    def embedding_dims(self) -> tuple[int, ...]:
        """The width of each table."""
        if isinstance(self.embedding_dim, tuple):
            return self.embedding_dim
        return (self.embedding_dim,) * len(self.cardinalities)

    @property
    def poolings(self) -> tuple[str, ...]:
        """How each table pools a row's vectors."""
        if isinstance(self.pooling, tuple):
            return self.pooling
        return (self.pooling,) * len(self.cardinalities)

    @property
    def interaction_width(self) -> int:
        """Inputs of the top MLP."""
        dense = self.bottom_mlp_dims[-1] if self.bottom_mlp_dims else self.num_numerical
        if self.interaction == "cross":
            return dense + sum(self.embedding_dims)
        vectors = len(self.cardinalities) + 1
        return dense + vectors * (vectors - 1) // 2

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly (lists, not tuples), as stored in checkpoint manifests."""
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        converted: dict[str, Any] = {
            key: tuple(value) if isinstance(value, list) else value for key, value in values.items()
        }
        return cls(**converted)


def dense_training_flops(config: ModelConfig) -> float:
    """Floating-point operations per sample of one training step's dense part.

    Each dense layer costs 2 * fan_in * fan_out multiply-adds forward and twice
    that backward (gradients of inputs and of weights). The dot interaction's
    Gram matrix costs 2 * (T + 1)^2 * D forward; a cross layer over width d
    costs 2 * d * d at full rank, 2 * 2 * d * r at rank r; both likewise
    tripled. Lookups, activations and the optimizer are memory-bound and not
    counted.
    """
    forward = 0.0
    width = config.num_numerical
    for out in config.bottom_mlp_dims:
        forward += 2 * width * out
        width = out
    if config.interaction == "cross":
        d, r = config.interaction_width, config.cross_layer_projection_dim
        per_layer = 4 * d * r if 0 < r < d else 2 * d * d
        forward += config.num_cross_layers * per_layer
    else:
        vectors = len(config.cardinalities) + 1
        forward += 2 * vectors * vectors * config.embedding_dims[0]
    width = config.interaction_width
    for out in config.top_mlp_dims:
        forward += 2 * width * out
        width = out
    return 3 * forward
