"""Core metadata into Dagster's metadata types, in one place."""

from __future__ import annotations

from typing import Any, Mapping

from dagster import MetadataValue

from trainyard.metadata import Markdown


def to_dagster(meta: Mapping[str, Any]) -> dict[str, Any]:
    """`meta` with every `Markdown` value rendered as Dagster markdown; other values unchanged.

    Example:
        >>> to_dagster({"plan": Markdown("**ddp**"), "rows": 3})["rows"]
        3
    """
    return {k: MetadataValue.md(str(v)) if isinstance(v, Markdown) else v for k, v in meta.items()}
