"""Training curves from a trial's progress records: points, rows, table and plot."""

from __future__ import annotations

from trainyard.curves import curves_markdown, curves_png, epoch_point, epoch_rows, metric_names


def progress(epoch: int, step: int, **metrics: float) -> dict:
    return {"type": "progress", "epoch": epoch, "max_epochs": 3, "step": step, "metrics": metrics}


def test_a_point_keeps_epoch_step_and_finite_numbers_only() -> None:
    point = epoch_point(progress(1, 8, val_acc=0.5, train_loss=float("nan"), val_loss=1.25))
    assert point == {"epoch": 1, "step": 8, "val_acc": 0.5, "val_loss": 1.25}
    assert epoch_point({"type": "other", "epoch": 1}) is None
    assert epoch_point("a log line") is None
    assert epoch_point({"type": "progress", "metrics": {}}) is None  # no epoch: nothing to plot against


def test_rows_are_in_epoch_order_and_a_repeated_epoch_keeps_its_last_report() -> None:
    """A restarted attempt trains an epoch again; the weights the trial ends with are the later attempt's."""
    messages = [
        progress(0, 4, val_acc=0.2),
        progress(1, 8, val_acc=0.4),
        {"type": "other"},
        progress(1, 8, val_acc=0.45),
        progress(2, 12, val_acc=0.6),
    ]
    rows = epoch_rows(messages)
    assert [(r["epoch"], r["val_acc"]) for r in rows] == [(0, 0.2), (1, 0.45), (2, 0.6)]


def test_table_has_one_line_per_epoch_and_blanks_for_missing_metrics() -> None:
    rows = [{"epoch": 0, "step": 4, "val_acc": 0.25}, {"epoch": 1, "step": 8, "val_acc": 0.5, "val_loss": 1.0}]
    assert metric_names(rows) == ["val_acc", "val_loss"]
    assert curves_markdown(rows) == (
        "| epoch | step | val_acc | val_loss |\n|---|---|---|---|\n"
        "| 0 | 4 | 0.25 |  |\n"
        "| 1 | 8 | 0.5 | 1 |"
    )


def test_plot_is_a_png_for_losses_and_scores_alike() -> None:
    rows = [{"epoch": e, "step": 4 * e, "val_acc": 0.2 * e, "train_loss": 2.0 - e} for e in range(3)]
    assert curves_png(rows, "t").startswith(b"\x89PNG\r\n\x1a\n")
    assert curves_png([{"epoch": 0, "val_acc": 0.1}], "only scores").startswith(b"\x89PNG")
