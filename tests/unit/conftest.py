"""Settings for the unit tests' process, applied before TensorFlow starts, and the
CPU kernels' library as a fixture."""

import os
from typing import Any

import pytest

# Simulated ranks (simulated_ranks.py) run in threads of this one process, and a
# collective waiting in a graph holds one of TensorFlow's inter-op threads, of
# which there are as many as cores by default. With 2 cores, one rank waiting in
# two collectives left the other rank no thread to reach them. Horovod's ops do
# not hold a thread while they wait, so this is the harness's need only.
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "16")


@pytest.fixture(scope="module")
def library() -> Any:
    """The loaded library of the CPU kernels (dlrm.kernels), which `make install` builds."""
    from dlrm import kernels  # imports TensorFlow: after the settings above

    module = kernels.load()
    assert module is not None, (
        f"the kernels are not built at {kernels.library_path()}: `make install` builds them"
    )
    return module
