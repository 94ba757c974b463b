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


def trial_rows(results: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per trial result (result.json): metrics, lineage, throughput."""
    rows = []
    for r in results:
        row: dict[str, Any] = {"trial": r["trial_id"]}
        row.update({f"metric.{k}": round(v, 6) for k, v in sorted(r["metrics"].items())})
        row.update({k: v for k, v in flatten(r.get("lineage", {})).items()})
        row["epochs"] = r["epochs"]
        row["samples_per_second"] = round(r["samples_per_second"], 1)
        row["device_hours"] = round(r["device_hours"], 6)
        rows.append(row)
    return rows


def columns(rows: list[dict[str, Any]]) -> tuple[list[str], set[str]]:
    """All columns, the differing ones first (after the row key), and which differ."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    differing = {k for k in keys if len({str(r.get(k, "")) for r in rows}) > 1}
    head, rest = keys[:1], keys[1:]
    return head + [k for k in rest if k in differing] + [k for k in rest if k not in differing], differing


def render(rows: list[dict[str, Any]], fmt: str = "table", only_differences: bool = False) -> str:
    """The rows as a terminal table (one column per row), markdown or CSV; differing fields first and marked.

    Raises:
        ValueError: `fmt` is not one of table, markdown, csv.
    """
    if not rows:
        return "(nothing to compare)"
    cols, differing = columns(rows)
    if only_differences:
        cols = cols[:1] + [c for c in cols[1:] if c in differing]
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
    widths = [max(len(cells[i]) for cells in body) for i in range(len(cols))]
    lines = []
    for i, h in enumerate(header):
        lines.append(h.ljust(label_width) + "  " + "  ".join(cells[i].ljust(min(widths[i], 40))[:40] for cells in body))
    return "\n".join(lines)
