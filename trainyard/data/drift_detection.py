"""Drift of a data version against the previous one: PSI per feature, KS for numerics.

`drift` compares two profiles (categories, or quantile bins of the numeric
samples); `psi` and `drift_report` are the same measure on in-memory series
and frames.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import pyarrow as pa

from trainyard.data.errors import SchemaMismatch
from trainyard.data.profile import CATEGORY_LIMIT
from trainyard.data.report import md_cell
from trainyard.spec import PipelineSpec

if TYPE_CHECKING:
    import pandas as pd

PSI_EPSILON = 1e-4
"""Share given to a bin that is empty on one side, so PSI stays finite."""

PSI_WARN = 0.1
"""PSI from which a feature is reported as a moderate shift (a warning, never blocking)."""

PSI_ALERT = 0.25
"""PSI above which a feature has drifted: the default of `PipelineSpec.max_drift_psi`."""

DISCRETE_VALUES = 32
"""A numeric feature with at most this many distinct reference values is binned per value, not by quantiles."""


def psi(prev: pd.Series, cur: pd.Series, bins: int = 10, categories: Optional[Sequence[Any]] = None) -> float:
    """Population stability index of `cur` against `prev`.

    PSI = sum over bins of (cur% - prev%) * ln(cur% / prev%). Numeric series
    are binned on `prev` with open ends (the first and last bin reach to
    -inf and +inf): a discrete one (at most `DISCRETE_VALUES` distinct
    values, e.g. pixel intensities 0..16) gets one bin per value, bounded
    halfway to the next value, so small noise stays in its value's bin; a
    continuous one gets up to `bins` quantile bins (fewer when quantiles
    coincide). Quantile edges on discrete data would fall on the values
    themselves, and noise would flip rows across them at random. Bool,
    text and other non-numeric series, or any series given `categories`,
    use one bin per category (values outside `categories` share one extra
    bin). Nulls get a bin of their own. An empty bin on either side counts
    as `PSI_EPSILON`. Rule of thumb: < 0.1 stable, 0.1-0.25 moderate shift
    (`PSI_WARN`), > 0.25 large shift (`PSI_ALERT`).

    Args:
        prev: The reference (previous) values.
        cur: The new values.
        bins: Number of quantile bins for numeric series.
        categories: The known categories (e.g. a column's domain).

    Raises:
        ValueError: `bins` < 1 or either series is empty.
    """
    import pandas as pd

    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if len(prev) == 0 or len(cur) == 0:
        raise ValueError(f"psi needs values on both sides; got {len(prev)} previous and {len(cur)} current")
    numeric = categories is None and all(
        pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s) for s in (prev, cur)
    )
    if numeric:
        p_counts, c_counts = _quantile_counts(prev, cur, bins)
    else:
        p_counts, c_counts = _category_counts(prev, cur, categories)
    return _psi_of_counts(p_counts, c_counts)


def _psi_of_counts(p_counts: np.ndarray, c_counts: np.ndarray) -> float:
    p = np.maximum(p_counts / p_counts.sum(), PSI_EPSILON)
    c = np.maximum(c_counts / c_counts.sum(), PSI_EPSILON)
    return float(np.sum((c - p) * np.log(c / p)))


def _quantile_counts(prev: pd.Series, cur: pd.Series, bins: int) -> tuple[np.ndarray, np.ndarray]:
    p_values = prev.dropna().to_numpy(dtype=float)
    c_values = cur.dropna().to_numpy(dtype=float)
    edges = numeric_edges(p_values, bins)

    def counts(values: np.ndarray, nulls: int) -> np.ndarray:
        # Bin i holds edges[i-1] < x <= edges[i]; the last bin is open above.
        idx = np.searchsorted(edges, values, side="left")
        return np.append(np.bincount(idx, minlength=len(edges) + 1), nulls).astype(float)

    return counts(p_values, int(prev.isna().sum())), counts(c_values, int(cur.isna().sum()))


def numeric_edges(reference: np.ndarray, bins: int) -> np.ndarray:
    """Inner bin edges for a numeric feature (see `psi`): halfway between distinct values, or quantiles."""
    finite = reference[np.isfinite(reference)]
    if not len(finite):
        return np.array([])
    distinct = np.unique(finite)
    if len(distinct) <= DISCRETE_VALUES:
        return (distinct[:-1] + distinct[1:]) / 2
    inner = np.linspace(0.0, 1.0, bins + 1)[1:-1]
    return np.unique(np.quantile(finite, inner))


def _category_counts(
    prev: pd.Series, cur: pd.Series, categories: Optional[Sequence[Any]]
) -> tuple[np.ndarray, np.ndarray]:
    p_freq = prev.dropna().value_counts()
    c_freq = cur.dropna().value_counts()
    known = list(dict.fromkeys([*p_freq.index, *c_freq.index])) if categories is None else list(dict.fromkeys(categories))

    def counts(freq: pd.Series, series: pd.Series) -> np.ndarray:
        inside = [int(freq.get(k, 0)) for k in known]
        other = int(series.notna().sum()) - sum(inside)
        return np.array([*inside, other, int(series.isna().sum())], dtype=float)

    return counts(p_freq, prev), counts(c_freq, cur)


def drift_report(prev_df: pd.DataFrame, cur_df: pd.DataFrame, spec: PipelineSpec) -> dict[str, float]:
    """PSI of every feature column of `cur_df` against `prev_df`, in declared order.

    Columns with a `domain` are compared by category over that domain; text
    and bool columns by observed category; other numeric columns by
    quantile bins of the previous data. The target is not included.

    Raises:
        SchemaMismatch: A feature column is missing from either frame.
    """
    report: dict[str, float] = {}
    for name in spec.features:
        for frame, label in ((prev_df, "previous"), (cur_df, "current")):
            if name not in frame.columns:
                raise SchemaMismatch(f"feature column {name!r} not found in the {label} data; it has {list(frame.columns)}")
        report[name] = psi(prev_df[name], cur_df[name], categories=spec.columns[name].domain)
    return report


def _categorical(spec: PipelineSpec, name: str) -> bool:
    column = spec.columns[name]
    return column.domain is not None or column.dtype in ("str", "bool")


def drift(
    prev_profile: dict[str, Any], prev_sample: pa.Table, cur_profile: dict[str, Any], cur_sample: pa.Table, spec: PipelineSpec
) -> list[dict[str, Any]]:
    """Per-feature drift of a validated version against the previous one, from their profiles.

    Categorical features (a `domain`, or text/bool) get PSI over their
    category counts, which profiles keep exactly. Numeric features get PSI
    over bins of the previous sample (per value for discrete features,
    quantiles for continuous ones; see `psi`) and the two-sample KS
    statistic (SciPy) over the finite sampled values; both samples are the
    whole data when it has at most `PROFILE_SAMPLE_ROWS` rows, so then the
    PSI equals `drift_report`'s.

    Returns:
        One dict per feature: `column`, `method`, `psi`, `ks`, `ks_pvalue`,
        `drifted` (PSI above `spec.max_drift_psi` or KS above
        `spec.max_drift_ks`), and `note` when a test was skipped.
    """
    from scipy.stats import ks_2samp

    rows = []
    for name in spec.features:
        row: dict[str, Any] = {"column": name, "psi": None, "ks": None, "ks_pvalue": None, "drifted": False, "note": ""}
        prev_st = prev_profile["columns"].get(name)
        cur_st = cur_profile["columns"].get(name)
        if prev_st is None or cur_st is None:
            row.update(method="none", note="column missing from the previous version")
            rows.append(row)
            continue
        if _categorical(spec, name):
            row["method"] = "psi-categories"
            if prev_st.get("counts") is None or cur_st.get("counts") is None:
                row["note"] = f"more than {CATEGORY_LIMIT} categories; not measured"
            else:
                row["psi"] = _psi_of_profile_counts(prev_st, prev_profile["rows"], cur_st, cur_profile["rows"], spec.columns[name].domain)
        else:
            p = prev_sample.column(name).to_pandas().astype(float)
            c = cur_sample.column(name).to_pandas().astype(float)
            discrete = p[np.isfinite(p)].nunique() <= DISCRETE_VALUES
            row["method"] = "psi-values+ks" if discrete else "psi-quantiles+ks"
            if len(p) and len(c):
                row["psi"] = psi(p, c)
                pf, cf = p[np.isfinite(p)], c[np.isfinite(c)]
                if len(pf) and len(cf):
                    with warnings.catch_warnings():
                        # SciPy falls back from the exact to the asymptotic p-value on ties, and says so.
                        warnings.simplefilter("ignore", RuntimeWarning)
                        test = ks_2samp(pf.to_numpy(), cf.to_numpy())
                    row["ks"], row["ks_pvalue"] = float(test.statistic), float(test.pvalue)
            else:
                row["note"] = "no rows to compare"
        row["drifted"] = bool(
            (spec.max_drift_psi is not None and row["psi"] is not None and row["psi"] > spec.max_drift_psi)
            or (spec.max_drift_ks is not None and row["ks"] is not None and row["ks"] > spec.max_drift_ks)
        )
        rows.append(row)
    return rows


def _psi_of_profile_counts(prev: dict[str, Any], prev_rows: int, cur: dict[str, Any], cur_rows: int, domain: Optional[list[Any]]) -> float:
    def freq(st: dict[str, Any]) -> dict[Any, int]:
        return {_category_key(k): n for k, n in st["counts"]}

    p_freq, c_freq = freq(prev), freq(cur)
    known = [_category_key(k) for k in domain] if domain is not None else list(dict.fromkeys([*p_freq, *c_freq]))
    known = list(dict.fromkeys(known))

    def counts(f: dict[Any, int], rows: int, nulls: int) -> np.ndarray:
        inside = [f.get(k, 0) for k in known]
        present = sum(f.values())
        return np.array([*inside, present - sum(inside), nulls], dtype=float)

    return _psi_of_counts(counts(p_freq, prev_rows, prev["nulls"]), counts(c_freq, cur_rows, cur["nulls"]))


def _category_key(value: Any) -> Any:
    # 1, 1.0 and True are one category, as in pandas' value_counts.
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def drift_verdict(rows: Sequence[dict[str, Any]], spec: PipelineSpec) -> dict[str, Any]:
    """The drift of a version in one word, with the largest PSI and the columns behind it.

    `level` is `none` (no previous version), `stable` (every PSI below
    `PSI_WARN`), `moderate` (some PSI at or above `PSI_WARN`, none drifted: a
    warning) or `drifted` (a feature above `spec.max_drift_psi` or
    `spec.max_drift_ks`: the `on_bad_data` policy applies).
    """
    if not rows:
        return {"level": "none", "max_psi": None, "column": None, "columns": [], "message": "first validated version: no drift to measure"}
    measured = [(float(r["psi"]), r["column"]) for r in rows if r["psi"] is not None]
    top, column = max(measured) if measured else (0.0, None)
    drifted = [r["column"] for r in rows if r["drifted"]]
    moderate = [c for p, c in measured if p >= PSI_WARN and c not in drifted]
    if drifted:
        level, columns = "drifted", drifted
        message = f"drifted: {drifted} beyond the thresholds (PSI > {spec.max_drift_psi}, KS > {spec.max_drift_ks}); max PSI {top:.3f} on {column!r}"
    elif moderate:
        level, columns = "moderate", moderate
        message = f"moderate shift (PSI >= {PSI_WARN}) in {moderate}; max PSI {top:.3f} on {column!r}, below the threshold {spec.max_drift_psi}"
    else:
        level, columns = "stable", []
        message = f"stable: max PSI {top:.3f}" + (f" on {column!r}" if column else "") + f", below {PSI_WARN}"
    return {"level": level, "max_psi": top if measured else None, "column": column, "columns": columns, "message": message}


def drift_summary(d: dict[str, Any]) -> str:
    """One line naming a drifted column and its PSI and KS."""
    parts = [f"PSI {d['psi']:.3f}" if d["psi"] is not None else "", f"KS {d['ks']:.3f}" if d["ks"] is not None else ""]
    return f"drift on {d['column']!r}: " + ", ".join(p for p in parts if p)


def drift_markdown(rows: Sequence[dict[str, Any]], spec: PipelineSpec) -> str:
    """A Markdown table of `drift` results with the thresholds."""
    if not rows:
        return "no previous validated version to compare with\n"
    lines = [
        f"thresholds: PSI > {spec.max_drift_psi}, KS > {spec.max_drift_ks}",
        "",
        f"**verdict**: {drift_verdict(rows, spec)['message']}",
        "",
        "| column | method | PSI | KS | KS p-value | drifted | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in rows:
        lines.append(
            f"| {d['column']} | {d['method']} | {_number(d['psi'])} | {_number(d['ks'])} | {_number(d['ks_pvalue'])} | "
            f"{'**yes**' if d['drifted'] else 'no'} | {md_cell(d['note'])} |"
        )
    return "\n".join(lines) + "\n"


def _number(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.4f}"
