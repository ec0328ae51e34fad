"""Importing TensorFlow with only what a user can act on: its Python loggers at
error level, the notices its C++ code prints while loading filtered out, and
pandas kept from Keras (which imports it for `fit()` on DataFrames)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator


def quiet_logs(verbose: bool) -> None:
    """Sets how much TensorFlow logs; must precede its import. By default only
    errors: none of its C++ start-up lines, no absl pre-init notice, none of the
    INFO lines that TensorFlow's Python code logs through absl (a SavedModel's
    saving, for one). `--verbosity 0` or higher (absl's flag), or
    TF_CPP_MIN_LOG_LEVEL in the environment for the C++ part, brings them back. The
    notices TensorFlow prints as it loads, which TF_CPP_MIN_LOG_LEVEL does not reach,
    are filtered out of its import unless that is 0. TensorFlow is imported here,
    at any verbosity, without pandas for Keras (`keras_without_pandas`)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if verbose else "2")
    if not verbose:
        import logging

        from absl import logging as absl_logging

        logging.getLogger("tensorflow").setLevel(logging.ERROR)
        absl_logging.set_verbosity(absl_logging.ERROR)
    with keras_without_pandas():
        if not verbose and os.environ["TF_CPP_MIN_LOG_LEVEL"] != "0":
            import_tensorflow_without_notices()
        else:
            import tensorflow  # noqa: F401


@contextlib.contextmanager
def keras_without_pandas() -> Iterator[None]:
    """Within: `import pandas` fails unless pandas is imported already. Keras
    imports pandas with TensorFlow whenever it is installed, for `fit()` on
    DataFrames, which training never calls; pandas is here for Spark's
    preprocessing. Without it TensorFlow starts 0.2-0.3 s of CPU sooner, in
    every rank."""
    hidden = "pandas" not in sys.modules
    if hidden:
        sys.modules["pandas"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if hidden and sys.modules.get("pandas", "") is None:
            del sys.modules["pandas"]


# What TensorFlow's C++ code writes to stderr while it loads, before its logging
# reads TF_CPP_MIN_LOG_LEVEL: absl's notice that its logging is not set up yet, and,
# on CPUs where oneDNN's ops are on by default (AVX-512 VNNI or BF16, AMX), a line
# saying so. Neither asks anything of the user.
IMPORT_NOTICES = re.compile(
    rb"All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|\] oneDNN custom operations are on\. "
)


def import_tensorflow_without_notices() -> None:
    """Imports TensorFlow with stderr passed through a filter that drops the
    `IMPORT_NOTICES` lines; every other line it writes (an error, say) comes out as
    it is written. TensorFlow writes them from C++ (`sys.stderr` cannot catch them),
    so file descriptor 2 itself points at a pipe during the import."""
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    stderr = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                if not IMPORT_NOTICES.search(line):
                    os.write(stderr, line)

    forwarder = threading.Thread(target=forward, name="stderr-filter", daemon=True)
    forwarder.start()
    try:
        import tensorflow  # noqa: F401
    finally:
        sys.stderr.flush()
        os.dup2(stderr, 2)  # the pipe's last writer closed: the forwarder reads to the end
        forwarder.join()
        os.close(stderr)
