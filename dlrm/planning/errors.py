"""The dry run's error."""

from __future__ import annotations


class DryRunError(ValueError):
    """A dry run's input is wrong: a device name, a device table, a flag."""
