"""The error raised for unreadable or inconsistent dataset files."""


class DatasetError(ValueError):
    """Dataset files do not match their FeatureSpec, or a read was asked for that
    cannot be served. The message names the file, the expected and the actual value."""
