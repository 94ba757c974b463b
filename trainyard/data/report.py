"""The validation report: suite and platform results of one data version, and their Markdown."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict

from trainyard.data.canonical import SAMPLE_VALUES, jsonable

SUITE_CHECK = "suite"
PLATFORM_CHECK = "platform"


class ValidationReport(BaseModel):
    """The outcome of the pipeline's suite and the platform checks on one data version.

    Attributes:
        success: Every expectation and platform check passed.
        evaluated: Number of expectations and checks run.
        failed: Number that did not pass (including those that raised).
        rows: Rows validated.
        results: One dict per expectation (suite order) then per platform
            check, with keys `expectation`, `column` (None for table-level
            ones), `kwargs`, `success`, `observed_value`, `unexpected_count`,
            `unexpected_values` and `unexpected_index_list` (up to five
            samples and their row positions), `exception` (the error message
            when the expectation could not be evaluated), `source`
            (`"suite"` or `"platform"`), `row_level` (whether failing rows can
            be told apart and set aside) and `sample_rows` (the failing rows
            themselves, when known).
        suite: The suite as Great Expectations JSON (without generated ids).
        missing: Per stored column, how many of its values are missing
            (null; a float NaN is not counted here, see the finite check).
            The cells ingest read as missing (`SourceSpec.missing_values`)
            are these nulls.
    """

    model_config = ConfigDict(frozen=True)

    success: bool
    evaluated: int
    failed: int
    results: list[dict[str, Any]]
    suite: dict[str, Any]
    rows: int = 0
    missing: dict[str, int] = {}

    def failures(self) -> list[dict[str, Any]]:
        """The results that did not pass."""
        return [r for r in self.results if not r["success"]]

    def to_markdown(self) -> str:
        """A Markdown summary and table of every expectation and check, for Dagster metadata."""
        head = "passed" if self.success else "FAILED"
        lines = [
            f"**{head}**: {self.evaluated - self.failed} of {self.evaluated} expectations passed",
            "",
            "| expectation | column | success | observed | unexpected | sample |",
            "|---|---|---|---|---|---|",
        ]
        for r in self.results:
            observed = r["exception"] if r["exception"] else r["observed_value"]
            cells = [
                r["expectation"],
                r["column"] if r["column"] is not None else "(table)",
                "yes" if r["success"] else "**no**",
                "" if observed is None else observed,
                "" if r["unexpected_count"] is None else r["unexpected_count"],
                ", ".join(repr(v) for v in r["unexpected_values"]),
            ]
            lines.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
        gaps = {c: n for c, n in self.missing.items() if n}
        if self.missing:
            lines += [
                "",
                "**missing values** per column (null cells): "
                + (", ".join(f"`{c}` {n} ({100.0 * n / max(1, self.rows):.1f} %)" for c, n in gaps.items()) or "none"),
            ]
        return "\n".join(lines) + "\n"

    def failing_rows_markdown(self, max_columns: int = 12) -> str:
        """For each failing expectation with known rows, a Markdown table of those rows."""
        parts = []
        for r in self.failures():
            rows = r.get("sample_rows") or []
            if not rows:
                continue
            where = f" on `{r['column']}`" if r["column"] else ""
            columns = [c for c in rows[0] if c != "_row"]
            if r["column"] in columns and len(columns) > max_columns:
                columns.remove(r["column"])
                columns = [r["column"], *columns]
            shown = columns[:max_columns]
            more = f" (first {max_columns} of {len(columns)} columns)" if len(columns) > max_columns else ""
            parts.append(f"**{r['expectation']}**{where}: {r['unexpected_count']} unexpected{more}")
            parts.append("")
            parts.append("| row | " + " | ".join(shown) + " |")
            parts.append("|---|" + "---|" * len(shown))
            for row in rows:
                parts.append("| " + " | ".join(md_cell(v) for v in [row["_row"], *(row.get(c) for c in shown)]) + " |")
            parts.append("")
        return "\n".join(parts) if parts else "no failing rows\n"


def md_cell(value: Any, width: int = 120) -> str:
    """`value` as one Markdown table cell: pipes escaped, one line, at most `width` characters."""
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def result_from_ge(result: Any, row_level: bool) -> dict[str, Any]:
    """A report result (see `ValidationReport.results`) from a GE `ExpectationValidationResult`."""
    config = result.expectation_config
    kwargs = {k: v for k, v in config.kwargs.items() if k != "batch_id"}
    body = result.result or {}
    return {
        "expectation": config.type,
        "column": kwargs.get("column"),
        "kwargs": jsonable(kwargs),
        "success": bool(result.success),
        "observed_value": jsonable(body.get("observed_value")),
        "unexpected_count": jsonable(body.get("unexpected_count")),
        "unexpected_values": jsonable(list(body.get("partial_unexpected_list") or [])[:SAMPLE_VALUES]),
        "unexpected_index_list": jsonable(list(body.get("partial_unexpected_index_list") or [])[:SAMPLE_VALUES]),
        "exception": _exception_message(result.exception_info),
        "source": SUITE_CHECK,
        "row_level": row_level and not _exception_message(result.exception_info),
        "sample_rows": [],
    }


def _exception_message(info: Any) -> Optional[str]:
    """The message of a raised expectation; GE nests it under metric ids when a metric failed."""
    if not isinstance(info, dict):
        return None
    entries = [info] if "raised_exception" in info else [v for v in info.values() if isinstance(v, dict)]
    messages = [str(e.get("exception_message")) for e in entries if e.get("raised_exception")]
    return "; ".join(messages) or None

