"""Test order for the whole suite.

`make test` runs the tests on two pytest-xdist workers, a file at a time (`--dist
loadfile`), handed out in collection order (`--no-loadscope-reorder`: xdist would
otherwise hand out the files with the most tests first). A file of several minutes
handed out last would keep one worker busy long after the other ran dry, so the
slowest files are collected first (measured on 2 cores, docs/testing.md). Within a
file the order is unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# The harness's assertion helpers report the values they compared, as a test's own do.
pytest.register_assert_rewrite("harness")

# Slowest first: each takes 1.5-8 minutes on 2 cores (setup included), measured by
# harness.suite_profile in a fresh clone's .ci/run (docs/testing.md#the-budget).
SLOW_FILES = (
    "test_container_images.py",
    "test_elastic.py",
    "test_hybrid_parallel.py",
    "test_large_table.py",
    "test_sharded_embeddings.py",
    "test_wheel_install.py",
    "test_slurm.py",
    "test_multi_host.py",
    "test_first_week.py",
    "test_demo.py",
    "test_spark_standalone.py",
    "test_incremental.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = Path(str(item.fspath)).name
        return SLOW_FILES.index(name) if name in SLOW_FILES else len(SLOW_FILES)

    items.sort(key=rank)  # stable: the order within a file is kept
