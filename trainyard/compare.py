"""Side-by-side comparison of trials or registered versions, differences first and marked."""

from __future__ import annotations

import csv
import io
from typing import Any, Iterable

from trainyard.lineage import PREFIX, PROMOTION_REASON_TAG, TRIAL_KEY_TAG, flatten

DIFF_MARK = "≠ "


def version_rows(registry: Any, name: str, versions: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """One row per registered version: its lineage tags and metrics (prefix `trainyard.` dropped)."""
    wanted = set(versions) if versions else None
    rows = []
    for v in registry.list_versions(name):
        if wanted is not None and v.version not in wanted:
            continue
        row: dict[str, Any] = {"version": v.version, "aliases": ",".join(sorted(v.aliases))}
        for k, value in sorted(v.tags.items()):
            if k.startswith(PREFIX) and k != TRIAL_KEY_TAG and not k.startswith(PROMOTION_REASON_TAG):
                row[k[len(PREFIX):]] = value
        rows.append(row)
    return rows


def study_of_result(uri: str) -> str:
    """The study of a trial's `result.json` (`<runs>/<team>/<pipeline>/<study>/<trial>/result.json`)."""
    parts = uri.replace("\\", "/").rstrip("/").split("/")
    return parts[-3] if len(parts) >= 3 else ""


def trial_rows(results: Iterable[dict[str, Any]], studies: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """One row per trial result (result.json): its study, metrics, lineage, throughput.

    Args:
        studies: The study of each result, in order (`study_of_result` of its URI): trials of
            different studies share labels (`trial-0000`), the study column tells them apart.
    """
    rows = []
    names = list(studies) if studies is not None else None
    for i, r in enumerate(results):
        row: dict[str, Any] = {"trial": r["trial_id"]}
        if names is not None:
            row["study"] = names[i]
        row.update({f"metric.{k}": round(v, 6) for k, v in sorted(r["metrics"].items())})
        row.update({k: v for k, v in flatten(r.get("lineage", {})).items()})
        row["epochs"] = r["epochs"]
        row["samples_per_second"] = round(r["samples_per_second"], 1)
        row["device_hours"] = round(r["device_hours"], 6)
        rows.append(row)
    return rows


KEY_COLUMNS = ("trial", "study", "version", "aliases")
"""Columns that name a row: they stay first, in this order, differing or not."""


def columns(rows: list[dict[str, Any]]) -> tuple[list[str], set[str]]:
    """All columns, the differing ones first (after the row's key: trial and study, or version), and which differ."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    differing = {k for k in keys if len({str(r.get(k, "")) for r in rows}) > 1}
    named = [k for k in keys[:2] if k in KEY_COLUMNS] or keys[:1]
    head, rest = named, [k for k in keys if k not in named]
    return head + [k for k in rest if k in differing] + [k for k in rest if k not in differing], differing


CELL_WIDTH = 40
"""A terminal table's widest cell; a longer value is cut with `…` (whole with `wide`, and in markdown and CSV)."""
CUT_MARK = "…"


def render(rows: list[dict[str, Any]], fmt: str = "table", only_differences: bool = False, wide: bool = False) -> str:
    """The rows as a terminal table (one column per row), markdown or CSV; differing fields first and marked.

    Markdown and CSV always hold whole values. The terminal table cuts a value
    longer than `CELL_WIDTH` with `…` and says so below it, unless `wide`.

    Raises:
        ValueError: `fmt` is not one of table, markdown, csv.
    """
    if not rows:
        return "(nothing to compare)"
    cols, differing = columns(rows)
    keep = len([c for c in cols[:2] if c in KEY_COLUMNS]) or 1
    if only_differences:
        cols = cols[:keep] + [c for c in cols[keep:] if c in differing]
    header = [DIFF_MARK + c if c in differing else c for c in cols]
    body = [[str(r.get(c, "")) for c in cols] for r in rows]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(header)
        writer.writerows(body)
        return out.getvalue()
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    if fmt != "table":
        raise ValueError(f"format {fmt!r} is not one of table, markdown, csv")
    # Terminal: one column per row (rows are few, fields are many), differing fields first and marked.
    label_width = max(len(h) for h in header)
    limit = None if wide else CELL_WIDTH
    cut = False

    def cell(text: str) -> str:
        nonlocal cut
        if limit is not None and len(text) > limit:
            cut = True
            return text[: limit - 1] + CUT_MARK
        return text

    table = [[cell(c) for c in cells] for cells in body]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(cols))]
    lines = [
        h.ljust(label_width) + "  " + "  ".join(cells[i].ljust(widths[i]) for cells in table)
        for i, h in enumerate(header)
    ]
    if cut:
        lines.append(
            f"(values longer than {CELL_WIDTH} characters are cut with {CUT_MARK}; --wide, --format markdown or csv "
            "show them whole)"
        )
    return "\n".join(line.rstrip() for line in lines)
