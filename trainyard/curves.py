"""A trial's training curves: the per-epoch metrics its rank 0 reported, as rows, a table and a plot.

The pod sends one progress record per validated epoch (GBT: per reported
iteration) over Dagster Pipes: `{"type": "progress", "epoch", "max_epochs",
"step", "metrics": {...}}`. These functions turn such records into the numbers
an observation carries, the rows kept beside the result, a markdown table and
a PNG (matplotlib's Agg backend, no display). Nothing here knows Dagster.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

from trainyard.plots import figure_png, pyplot

CURVES_FILE = "curves.json"
PROGRESS = "progress"


def epoch_point(message: Any) -> Optional[dict[str, float]]:
    """The numbers of one progress record: `epoch`, `step` and each finite metric; None for any other message.

    Example:
        >>> epoch_point({"type": "progress", "epoch": 1, "step": 8, "metrics": {"val_acc": 0.5, "x": float("nan")}})
        {'epoch': 1, 'step': 8, 'val_acc': 0.5}
    """
    if not isinstance(message, dict) or message.get("type") != PROGRESS or not isinstance(message.get("epoch"), int):
        return None
    point: dict[str, float] = {"epoch": message["epoch"]}
    if isinstance(message.get("step"), int):
        point["step"] = message["step"]
    for name, value in sorted((message.get("metrics") or {}).items()):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            point[name] = float(value)
    return point


def epoch_rows(messages: Iterable[Any]) -> list[dict[str, float]]:
    """One row per epoch, in epoch order, from a trial's progress records (other messages are skipped).

    An epoch reported twice (a restarted attempt trains it again) keeps its
    last report: the one of the attempt whose weights the trial ends with.
    """
    by_epoch: dict[float, dict[str, float]] = {}
    for message in messages:
        point = epoch_point(message)
        if point is not None:
            by_epoch[point["epoch"]] = point
    return [by_epoch[e] for e in sorted(by_epoch)]


def metric_names(rows: Sequence[dict[str, float]]) -> list[str]:
    """The metrics of the rows (everything but `epoch` and `step`), in first-seen order."""
    names: dict[str, None] = {}
    for row in rows:
        names.update((k, None) for k in row if k not in ("epoch", "step"))
    return list(names)


def curves_markdown(rows: Sequence[dict[str, float]]) -> str:
    """A markdown table with one line per epoch: epoch, step and each metric (blank where an epoch lacks it)."""
    names = metric_names(rows)
    head = "| epoch | step | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 2) + "\n"

    def cell(row: dict[str, float], name: str) -> str:
        return f"{row[name]:.4g}" if name in row else ""

    return head + "\n".join(
        f"| {int(r['epoch'])} | {int(r['step']) if 'step' in r else ''} | "
        + " | ".join(cell(r, n) for n in names)
        + " |"
        for r in rows
    )


def curves_png(rows: Sequence[dict[str, float]], title: str) -> bytes:
    """Each metric against the epoch: losses on the left panel, every other metric on the right.

    Losses and scores live on different scales (a cross-entropy of 2.3 beside
    an accuracy of 0.9), so one shared axis would flatten one or the other.
    """
    plt = pyplot()
    names = metric_names(rows)
    panels = [[n for n in names if "loss" in n], [n for n in names if "loss" not in n]]
    panels = [p for p in panels if p] or [[]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for name in panel:
            points = [(r["epoch"], r[name]) for r in rows if name in r]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=name)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        if panel:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    return figure_png(fig)
