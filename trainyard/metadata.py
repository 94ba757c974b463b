"""Metadata as the core describes it, before the asset layer turns it into Dagster's types.

Core objects (the capacity plan, a promotion decision, a validation report)
return plain dictionaries for the asset that shows them. A value that is
markdown is marked with `Markdown` so the asset layer can render it as such
(`assets.metadata.to_dagster`) without the core importing Dagster.

Example:
    >>> meta = {"rows": 3, "table": Markdown("| a |\\n|---|\\n| 1 |")}
    >>> isinstance(meta["table"], str)
    True
"""

from __future__ import annotations


class Markdown(str):
    """A string to be shown as markdown in the Dagster UI."""

    __slots__ = ()
