"""Errors the Feast side reports as a JSON answer (exit code 2) instead of a traceback."""

from __future__ import annotations


class RetrievalRefused(Exception):
    """The request cannot be served as asked: the message says what is wrong and `kind` which rule it broke.

    Kinds: `repo` (no feature_store.yaml, a registry that cannot be read),
    `unknown_feature_view`, `unknown_feature`, `unknown_feature_service`,
    `entity_rows` (missing keys or event times, unparsable times), `request`
    (a malformed request).
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
