"""The optimizers, as `--optimizer` names them, with the state each keeps per
parameter: the one registry. No TensorFlow: the flags, the planner's memory
estimate and the checkpoints read it; `dlrm.optim.optimizers` implements each
entry (`Optimizer.spec`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer's `--optimizer` name and its slots: values kept per parameter,
    by the names checkpoints store them under."""

    name: str
    slot_names: tuple[str, ...] = ()


SGD = OptimizerSpec("sgd")
ADAGRAD = OptimizerSpec("adagrad", ("accumulator",))
ADAM = OptimizerSpec("adam", ("m", "v"))
OPTIMIZER_SPECS = {spec.name: spec for spec in (SGD, ADAGRAD, ADAM)}
OPTIMIZERS = tuple(OPTIMIZER_SPECS)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The optimizer an `--optimizer` value names; ValueError naming the flag."""
    if name not in OPTIMIZER_SPECS:
        raise ValueError(f"--optimizer: expected one of {', '.join(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZER_SPECS[name]
