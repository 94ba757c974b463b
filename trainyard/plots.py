"""PNG plots for asset metadata: one way to render a matplotlib figure and to embed it.

matplotlib is imported only when a plot is drawn (the Agg backend: no display),
so importing the core stays light.
"""

from __future__ import annotations

import base64
import io
from typing import Any


def pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_png(fig: Any) -> bytes:
    """The figure as PNG bytes (80 dpi, tight), then closed so figures never pile up in a long process."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    pyplot().close(fig)
    return buf.getvalue()


def markdown_image(png: bytes, alt: str) -> str:
    """Markdown embedding a PNG, which the Dagster UI renders in asset metadata."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"
