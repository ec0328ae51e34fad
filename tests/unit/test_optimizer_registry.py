"""The optimizers' one registry (`dlrm.optim.config`): without TensorFlow, and
what each optimizer keeps is what the registry says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from dlrm.optim.config import OPTIMIZERS, optimizer_spec
from dlrm.optim.optimizers import create_optimizer

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_keeps_the_slots_its_registry_entry_names(name: str) -> None:
    optimizer = create_optimizer(name)
    variable = tf.Variable(tf.zeros([3, 2]), name="weights")
    optimizer.build([variable])
    assert optimizer.name == name
    assert tuple(optimizer.slots(variable)) == optimizer_spec(name).slot_names


def test_the_registry_and_the_run_config_load_no_tensorflow() -> None:
    program = (
        "import sys\n"
        "from dlrm.optim.config import optimizer_spec\n"
        "from dlrm.app.config import RunConfig\n"
        "print(len(optimizer_spec('adam').slot_names), 'tensorflow' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2", "False"]
