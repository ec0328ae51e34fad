"""The error raised for an invalid FeatureSpec."""

from __future__ import annotations


class FeatureSpecError(ValueError):
    """A FeatureSpec is invalid. The message names the file (when known), the key
    path, the expected and the actual value."""

    def __init__(self, message: str, source: str | None = None) -> None:
        self.message = message
        self.source = source
        super().__init__(f"{source}: {message}" if source else message)

    def with_source(self, source: str) -> FeatureSpecError:
        """The same error, attributed to the file it came from."""
        return FeatureSpecError(self.message, source=self.source or source)
