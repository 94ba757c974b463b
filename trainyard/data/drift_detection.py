"""Drift of a new delivery against the reference data: PSI per feature, KS for numerics.

`drift` compares two profiles (categories, or quantile bins of the numeric
samples) and reports a schema change (columns added, removed or retyped) as
its own event, never as a PSI; `delivery_drift` measures the rows a version
adds (its new landing files, together and one by one) against the reference
(the previous accepted version, or the champion's data), so one shifted file
is not diluted by everything delivered before it; `psi` and `drift_report`
are the same measure on in-memory series and frames.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import pyarrow as pa

from trainyard.data.errors import SchemaMismatch
from trainyard.data.profile import CATEGORY_LIMIT, Profiler
from trainyard.data.report import md_cell
from trainyard.spec import PipelineSpec
from trainyard.store import FileStore

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

DRIFT_MIN_ROWS = 200
"""Fewest rows a delivery (or one of its files) needs for its PSI to be judged.

PSI of a few rows against any reference is large by chance alone (for 10 bins
about 9/rows on average, twice that in one case in a hundred), so a smaller
delivery is measured and shown but never called drifted; one file of a
delivery below it is judged only as part of the whole delivery.
"""

NOT_MEASURED_DTYPES = ("date", "datetime")
"""Dtypes whose features are not drift-measured: each delivery brings new dates, so any calendar binning flags every
delivery."""


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
    known = (
        list(dict.fromkeys([*p_freq.index, *c_freq.index])) if categories is None else list(dict.fromkeys(categories))
    )

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
                raise SchemaMismatch(
                    f"feature column {name!r} not found in the {label} data; it has {list(frame.columns)}"
                )
        report[name] = psi(prev_df[name], cur_df[name], categories=spec.columns[name].domain)
    return report


def _categorical(spec: PipelineSpec, name: str) -> bool:
    column = spec.columns[name]
    return column.domain is not None or column.categorical or column.dtype == "bool"


def _row(name: str, **over: Any) -> dict[str, Any]:
    return {
        "column": name,
        "method": "none",
        "psi": None,
        "ks": None,
        "ks_pvalue": None,
        "drifted": False,
        "note": "",
        **over,
    }


def schema_changes(prev_profile: dict[str, Any], cur_profile: dict[str, Any]) -> list[dict[str, Any]]:
    """Columns added, removed or retyped between two profiles: one `method="schema"` row each, never a PSI.

    Every column of the profiles counts (features, target, ids, timestamps).
    The row's `note` says what changed (`added (string)`, `removed (was
    int64)`, `type int64 -> string`); such a column is not measured by PSI.
    """
    prev, cur = prev_profile["columns"], cur_profile["columns"]
    rows = []
    for name in [*cur, *(c for c in prev if c not in cur)]:
        if name not in prev:
            rows.append(_row(name, method="schema", note=f"added ({cur[name].get('type')})"))
        elif name not in cur:
            rows.append(_row(name, method="schema", note=f"removed (was {prev[name].get('type')})"))
        elif prev[name].get("type") != cur[name].get("type"):
            rows.append(_row(name, method="schema", note=f"type {prev[name].get('type')} -> {cur[name].get('type')}"))
    return rows


def schema_change_message(rows: Sequence[dict[str, Any]]) -> str:
    """`schema changed: ...` naming each added, removed or retyped column, or "" when the schema is the same."""
    changes = [f"{r['column']!r} {r['note']}" for r in rows if r.get("method") == "schema"]
    return "schema changed: " + "; ".join(changes) if changes else ""


def drift(
    prev_profile: dict[str, Any],
    prev_sample: pa.Table,
    cur_profile: dict[str, Any],
    cur_sample: pa.Table,
    spec: PipelineSpec,
) -> list[dict[str, Any]]:
    """Per-feature drift of a validated version against the previous one, from their profiles.

    Categorical features (a `domain`, or text/bool) get PSI over their
    category counts, which profiles keep exactly. Numeric features get PSI
    over bins of the previous sample (per value for discrete features,
    quantiles for continuous ones; see `psi`) and the two-sample KS
    statistic (SciPy) over the finite sampled values; both samples are the
    whole data when it has at most `PROFILE_SAMPLE_ROWS` rows, so then the
    PSI equals `drift_report`'s.

    A schema change between the two profiles (a column added, removed or
    retyped; `schema_changes`) comes first, as `method="schema"` rows; a
    feature it touches gets no PSI. Date and datetime features are not
    measured (`NOT_MEASURED_DTYPES`): a note says so.

    Returns:
        The schema rows, then one dict per feature: `column`, `method`, `psi`,
        `ks`, `ks_pvalue`, `drifted` (PSI above `spec.max_drift_psi` or KS
        above `spec.max_drift_ks`), and `note` when a test was skipped.
    """
    from scipy.stats import ks_2samp

    rows = schema_changes(prev_profile, cur_profile)
    changed = {r["column"] for r in rows}
    for name in spec.features:
        row = _row(name)
        prev_st = prev_profile["columns"].get(name)
        cur_st = cur_profile["columns"].get(name)
        if name in changed:
            row["note"] = "schema changed (see its schema row); not measured"
            rows.append(row)
            continue
        if prev_st is None or cur_st is None:
            row.update(method="none", note="column missing from the previous version")
            rows.append(row)
            continue
        if spec.columns[name].dtype in NOT_MEASURED_DTYPES:
            row["note"] = f"{spec.columns[name].dtype} column: not measured (every delivery brings new dates)"
            rows.append(row)
            continue
        if _categorical(spec, name):
            row["method"] = "psi-categories"
            if prev_st.get("counts") is None or cur_st.get("counts") is None:
                row["note"] = f"more than {CATEGORY_LIMIT} categories; not measured"
            else:
                row["psi"] = _psi_of_profile_counts(
                    prev_st, prev_profile["rows"], cur_st, cur_profile["rows"], spec.columns[name].domain
                )
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


def _psi_of_profile_counts(
    prev: dict[str, Any], prev_rows: int, cur: dict[str, Any], cur_rows: int, domain: Optional[list[Any]]
) -> float:
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
    `spec.max_drift_ks`: the `on_drift` policy applies). `scope` says which
    rows were measured (the new delivery, one of its files, or the whole
    version) against what; `schema` is `schema_change_message` (a schema
    change is its own event, never a PSI; "" when none).
    """
    if not rows:
        return {"level": "none", "max_psi": None, "column": None, "columns": [], "scope": "", "schema": "",
                "message": "first validated version: no drift to measure"}
    schema = schema_change_message(rows)
    measured = [(float(r["psi"]), r["column"]) for r in rows if r["psi"] is not None]
    top, column = max(measured) if measured else (0.0, None)
    drifted = [r["column"] for r in rows if r["drifted"]]
    unjudged = {r["column"] for r in rows if r.get("judged") is False}  # too few rows (DRIFT_MIN_ROWS)
    moderate = [c for p, c in measured if p >= PSI_WARN and c not in drifted and c not in unjudged]
    scope = next((r.get("scope", "") for r in rows if r["column"] == column and r.get("method") != "schema"), "")
    where = f" ({scope})" if scope else ""
    if drifted:
        level, columns = "drifted", drifted
        message = (
            f"drifted: {drifted} beyond the thresholds (PSI > {spec.max_drift_psi}, KS > {spec.max_drift_ks}); max "
            f"PSI {top:.3f} on {column!r}{where}"
        )
    elif moderate:
        level, columns = "moderate", moderate
        message = (
            f"moderate shift (PSI >= {PSI_WARN}) in {moderate}; max PSI {top:.3f} on {column!r}{where}, below the "
            f"threshold {spec.max_drift_psi}"
        )
    else:
        level, columns = "stable", []
        message = f"stable: max PSI {top:.3f}" + (f" on {column!r}" if column else "") + f", below {PSI_WARN}{where}"
    if schema:
        message += f"; {schema}"
    return {
        "level": level,
        "max_psi": top if measured else None,
        "column": column,
        "columns": columns,
        "scope": scope,
        "schema": schema,
        "message": message,
    }


def drift_summary(d: dict[str, Any]) -> str:
    """One line naming a drifted column and its PSI and KS."""
    parts = [f"PSI {d['psi']:.3f}" if d["psi"] is not None else "", f"KS {d['ks']:.3f}" if d["ks"] is not None else ""]
    return f"drift on {d['column']!r}: " + ", ".join(p for p in parts if p)


def drift_markdown(rows: Sequence[dict[str, Any]], spec: PipelineSpec) -> str:
    """A Markdown table of `drift` results with the thresholds."""
    if not rows:
        return "no previous validated version to compare with\n"
    verdict = drift_verdict(rows, spec)
    lines = [
        f"thresholds: PSI > {spec.max_drift_psi}, KS > {spec.max_drift_ks}",
        "",
        f"**verdict**: {verdict['message']}",
        "",
        *([f"**{verdict['schema']}**", ""] if verdict["schema"] else []),
        "| column | method | PSI | KS | KS p-value | drifted | measured on | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in rows:
        lines.append(
            f"| {d['column']} | {d['method']} | {_number(d['psi'])} | {_number(d['ks'])} | {_number(d['ks_pvalue'])} | "
            f"{'**yes**' if d['drifted'] else 'no'} | {md_cell(d.get('scope', ''))} | {md_cell(d['note'])} |"
        )
    return "\n".join(lines) + "\n"


def _number(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.4f}"


def delivery_files(
    store: FileStore, prev_raw_uri: Optional[str], cur_raw_uri: Optional[str]
) -> Optional[list[dict[str, Any]]]:
    """The files of the snapshot at `cur_raw_uri` that the one at `prev_raw_uri` did not have: the new delivery.

    Each snapshot keeps `manifest.json` beside its `data.parquet` with the
    ingest record of every file it was made of (URI, content hash, rows, the
    part holding its canonical rows). A file is new when its URI is not in
    the previous snapshot or its bytes changed (a replaced file); a file read
    again only because the declared columns changed is not. Returns None when
    either snapshot has no manifest (a snapshot not made by `ingest`, e.g. a
    Feast training set), so the delivery cannot be told apart.
    """
    def records(raw_uri: str) -> Optional[list[dict[str, Any]]]:
        uri = f"{raw_uri.rsplit('/', 1)[0]}/manifest.json"
        if not store.exists(uri):
            return None
        files = store.read_json(uri).get("files")
        return files if isinstance(files, list) else None

    if not prev_raw_uri or not cur_raw_uri:
        return None
    prev, cur = records(prev_raw_uri), records(cur_raw_uri)
    if prev is None or cur is None:
        return None
    before = {r["uri"]: r for r in prev}

    def same(r: dict[str, Any], old: Optional[dict[str, Any]]) -> bool:
        if old is None:
            return False
        if r.get("content_hash") and old.get("content_hash"):
            return bool(r["content_hash"] == old["content_hash"])
        return bool(r.get("part") == old.get("part"))

    return [r for r in cur if not same(r, before.get(r["uri"]))]


def _profile_parts(
    store: FileStore, schema: pa.Schema, files: Sequence[dict[str, Any]]
) -> list[tuple[str, int, dict[str, Any], pa.Table]]:
    """Profile and sample of the whole delivery and of each of its files (one pass over their parts)."""
    import pyarrow.ipc as ipc

    total = sum(int(r.get("rows") or 0) for r in files)
    whole = Profiler(schema, total)
    single = len(files) > 1
    out = []
    for r in files:
        own = Profiler(schema, int(r.get("rows") or 0)) if single else None
        if r.get("part") and store.exists(r["part"]):
            with store.open(r["part"], "rb") as f:
                reader = ipc.open_file(f)
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i).select(schema.names).cast(schema)
                    whole.update(batch)
                    if own is not None:
                        own.update(batch)
        if own is not None:
            out.append((_file_name(r["uri"]), own.rows, own.profile(), own.sample()))
    names = ", ".join(_file_name(r["uri"]) for r in files)
    return [(f"delivery ({names})", whole.rows, whole.profile(), whole.sample()), *out]


def _file_name(uri: str) -> str:
    return uri.rsplit("/", 1)[-1]


def delivery_drift(
    store: FileStore,
    spec: PipelineSpec,
    reference: tuple[dict[str, Any], pa.Table],
    prev_raw_uri: Optional[str],
    cur_raw_uri: Optional[str],
    current: tuple[dict[str, Any], pa.Table],
    reference_name: str = "the previous accepted version",
) -> list[dict[str, Any]]:
    """Drift of the rows a version adds (its new delivery) against the reference's profile and sample.

    The delivery is `delivery_files`: the landing files new in this snapshot.
    Its rows are measured together and, when it has several files, each file
    of at least `DRIFT_MIN_ROWS` rows on its own; every feature's row is the
    worst of these (drifted first, then the largest PSI) and its `scope` says
    which (`delivery (a.csv, b.csv)` or one file's name) and how many rows. A
    delivery of fewer than `DRIFT_MIN_ROWS` rows is measured but not judged
    (`judged: False`: never drifted, nor a moderate shift).
    When the delivery cannot be told (no snapshot manifest) or adds no rows
    (files were only removed, or read again for changed declarations), the
    whole version is measured, as `scope` says. Schema rows (`schema_changes`) compare the whole version's columns.

    Args:
        reference: Profile and sample of the reference data.
        prev_raw_uri: The reference's raw snapshot URI (its `manifest.json`
            lists its files), or None.
        cur_raw_uri: This version's raw snapshot URI.
        current: Profile and sample of this whole version.
        reference_name: How `scope` names the reference.
    """
    files = delivery_files(store, prev_raw_uri, cur_raw_uri)
    schema = current[1].schema
    groups = None
    why = "its files are not known" if files is None else "no new landing file: files were only removed or read again"
    if files is not None and any(int(r.get("rows") or 0) for r in files):
        try:
            groups = _profile_parts(store, schema, files)
        except (KeyError, pa.ArrowException) as e:  # parts not in the snapshot's columns (not made by this ingest)
            why = f"the new files' parts cannot be read as the snapshot's columns: {e}"
    if groups is None:
        rows = drift(*reference, *current, spec)
        for r in rows:
            r["scope"] = f"whole version, {current[0]['rows']} rows ({why}) against {reference_name}"
        return rows
    schema_rows = schema_changes(reference[0], current[0])
    best: dict[str, dict[str, Any]] = {}
    for i, (name, n, profile, sample) in enumerate(groups):
        if i > 0 and n < DRIFT_MIN_ROWS:
            continue
        for row in drift(*reference, profile, sample, spec):
            if row["method"] == "schema":
                continue
            row["scope"] = f"{name}, {n} rows against {reference_name}"
            if n < DRIFT_MIN_ROWS and row["psi"] is not None:
                row["drifted"], row["judged"] = False, False
                row["note"] = (
                    row["note"] + "; " if row["note"] else ""
                ) + f"{n} rows (< {DRIFT_MIN_ROWS}): too few to judge"
            old = best.get(row["column"])
            if old is None or _worse(row, old):
                best[row["column"]] = row
    for r in schema_rows:
        r["scope"] = f"whole version against {reference_name}"
    return [*schema_rows, *(best[name] for name in spec.features if name in best)]


def _worse(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ka = (bool(a["drifted"]), -1.0 if a["psi"] is None else float(a["psi"]))
    kb = (bool(b["drifted"]), -1.0 if b["psi"] is None else float(b["psi"]))
    return ka > kb
