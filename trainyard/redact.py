"""Credentials never shown: URLs are redacted before they reach a message, a log or metadata.

Example:
    >>> redact_url("postgresql+psycopg2://optuna:s3cret@db:5432/optuna?sslmode=require")
    'postgresql+psycopg2://optuna:***@db:5432/optuna?sslmode=require'
"""

from __future__ import annotations

import re

# The password of `scheme://user:password@host` (a password holds no `/`: URL-encoded, it is `%2F`).
_CREDENTIALS_RE = re.compile(r"(://[^/:@\s]+:)[^/@\s]+@")


def redact_url(url: str) -> str:
    """`url` with the password of its authority replaced by `***` (user, host, path and query kept)."""
    return _CREDENTIALS_RE.sub(r"\1***@", url)
