"""The error raised at the preprocessing boundary (flags, inputs, outputs)."""

from __future__ import annotations


class PreprocessingError(ValueError):
    """Preprocessing cannot go on. The message names the flag, file, line or field,
    what was expected and what was found; the command-line tools print it without a
    traceback and exit non-zero."""
