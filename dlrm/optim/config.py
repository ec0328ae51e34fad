"""The optimizers, as `--optimizer` names them, with the state each keeps per
parameter: the one registry. No TensorFlow: the flags, the planner's memory
estimate and the checkpoints read it; `dlrm.optim.optimizers` implements each
entry (`Optimizer.spec`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer's `--optimizer` name and its slots: values kept per parameter,
    by the names checkpoints store them under.

    Attributes:
        name: the `--optimizer` value.
        slot_names: every slot, in the order the kernel takes them.
        row_wise_slots: those of `slot_names` that an embedding table keeps one
            value of per row, [rows, 1], instead of one per element [rows, D]
            (row-wise Adagrad's accumulator). Dense weights keep every slot
            element-wise.
    """

    name: str
    slot_names: tuple[str, ...] = ()
    row_wise_slots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.row_wise_slots) - set(self.slot_names)
        if unknown:
            raise ValueError(
                f"optimizer {self.name!r}: row-wise slots {sorted(unknown)} are not among "
                f"its slots {list(self.slot_names)}"
            )

    @property
    def element_slot_count(self) -> int:
        """Slots a table keeps per element: [rows, D] each."""
        return len(self.slot_names) - len(self.row_wise_slots)

    @property
    def row_slot_count(self) -> int:
        """Slots a table keeps per row: [rows, 1] each."""
        return len(self.row_wise_slots)

    def table_slot_width(self, slot: str, width: int) -> int:
        """The width of `slot` of a table (or shard) `width` columns wide."""
        return 1 if slot in self.row_wise_slots else width


SGD = OptimizerSpec("sgd")
ADAGRAD = OptimizerSpec("adagrad", ("accumulator",))
ADAM = OptimizerSpec("adam", ("m", "v"))
ROWWISE_ADAGRAD = OptimizerSpec("rowwise_adagrad", ("accumulator",), ("accumulator",))
OPTIMIZER_SPECS = {spec.name: spec for spec in (SGD, ADAGRAD, ADAM, ROWWISE_ADAGRAD)}
OPTIMIZERS = tuple(OPTIMIZER_SPECS)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The optimizer an `--optimizer` value names; ValueError naming the flag."""
    if name not in OPTIMIZER_SPECS:
        raise ValueError(f"--optimizer: expected one of {', '.join(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZER_SPECS[name]
