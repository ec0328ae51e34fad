"""The benchmark suite's peak memory: a peak shorter than its 0.1 s samples still counts."""

from __future__ import annotations

import sys

import pytest

from benchmarks.suite import run_measured

# Touches 400 MB for about 20 ms, frees it, then idles for 0.5 s: the samples
# are 0.1 s apart, so most runs would sample only the idle process.
BRIEF_PEAK = """
import time
block = bytearray(400 * 2**20)
for offset in range(0, len(block), 4096):
    block[offset] = 1
del block
time.sleep(0.5)
print("done")
"""


def test_a_brief_peak_is_measured_exactly() -> None:
    stdout, peak = run_measured([sys.executable, "-c", BRIEF_PEAK])
    assert stdout.strip() == "done"
    assert peak >= 400 * 2**20
    assert peak < 400 * 2**20 + 200 * 2**20  # the interpreter's own few MB on top


def test_a_failing_command_raises_with_its_output() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)failed \(3\).*going down"):
        run_measured([sys.executable, "-c", "import sys; print('going down'); sys.exit(3)"])
