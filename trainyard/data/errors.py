"""The data engine's errors: the data itself is unusable as declared.

They are terminal: retrying reads the same data. Storage errors from the
object store pass through unchanged (some are retryable).
"""

from __future__ import annotations


class DataQualityError(Exception):
    """The data is unusable as declared. Terminal: retrying reads the same data."""


class MissingLandingData(DataQualityError):
    """No landing file matches the source's prefix and pattern."""


class MalformedLandingFile(DataQualityError):
    """A landing file cannot be parsed in the source's format."""


class SchemaMismatch(DataQualityError):
    """Columns differ between files, are missing, or cannot take their declared type."""


class SplitError(DataQualityError):
    """The rows cannot be split as the `SplitSpec` asks (fewer than three rows, or a class too rare to reach every
    part)."""


class QuarantineError(DataQualityError):
    """A quarantine entry does not exist, or cannot be released as asked."""
