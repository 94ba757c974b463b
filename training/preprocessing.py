"""The preprocessing the platform owns: fitted on the train split, applied to every split and at serving.

Implements `training.spec.Preprocessing` (its docstring is the contract). The
fitted state is a JSON-able dict (`fit`), saved as `preprocessing.json` with the
trial's exported model; `transform` turns raw columns (strings, dates, missing
values as they come) into the model's numeric matrix with that state alone.

This module is self-contained (numpy, pandas and the standard library): the
registered MLflow model ships it (`code_paths`) and `training/serving_model.py`
imports it as `preprocessing`, so a serving image needs nothing of trainyard.

Rules, per declared dtype (`DataSpec.feature_types`; empty, as in specs written
before the field: every feature numeric):

- numeric (`int`, `float`, `bool`): LightGBM (`trainer="gbt"`) gets the values
  as they are, a missing value as NaN (LightGBM's own missing-value handling),
  never scaled. Lightning models get missing values imputed (train median,
  mean or zero) plus a 0/1 indicator column `<col>__missing` for each column
  that had missing values in the train split (or in any split the caller
  names), and every numeric output standardised with the train mean and
  standard deviation (`scale`).
- categorical (`str`, `category`): a vocabulary of the train split's
  `max_categories` most frequent values (compared as text); any other value
  (seen only outside train, unseen at serving, missing) is the level `other`.
  LightGBM gets the integer codes (`0..k-1`, `other` = k) as a native
  categorical feature (`categorical_outputs`); Lightning one-hot columns
  `<col>=<value>` and `<col>=__other__` or, with `categorical="index"`, the code
  as one float column.
- `date` / `datetime`: the parts in `date_parts` (`hour` for datetimes only) as
  numeric columns `<col>__<part>`, treated as numeric features from then on.
  Dates arrive as dates, timestamps or ISO text.

A table whose features are all numeric and complete in every split (every
pipeline written before this module) goes to the model exactly as before:
the raw values, unscaled (`"passthrough": true` in the state).

`enabled=False` hands the raw columns to the model as numbers: a feature holding
text, dates or missing values fails before any compute, naming the column.

Images (a model trained on image shards) need no fitted state: `image_batch`
reads served images, each row's values flattened row-major, into the model's
float32 `[N, C, H, W]` with the declared range, as the streaming loader did in
training; `check_image_meta` checks the fields of `meta.json` it reads them by.
"""

from __future__ import annotations

import datetime as _dt
import math
from typing import Any, Iterable, Optional

import numpy as np
import pandas as pd

try:  # on the pod: a ConfigError, so a trial fails at once with the config exit status
    from training.errors import ConfigError as _Base
except ImportError:  # at serving, where this file ships alone
    _Base = ValueError  # type: ignore[assignment,misc]

STATE_VERSION = 1
STATE_FILE = "preprocessing.json"
NUMERIC = ("int", "float", "bool")
CATEGORICAL = ("str", "category")
DATES = ("date", "datetime")
OTHER = "__other__"
DATE_PARTS = ("year", "month", "day", "dayofweek", "dayofyear", "hour")
DEFAULT_CONFIG: dict[str, Any] = {
    "enabled": True, "impute": "median", "missing_indicators": True, "scale": True, "categorical": "onehot",
    "max_categories": 50, "date_parts": ["year", "month", "day", "dayofweek", "dayofyear", "hour"],
}
HINT = ("turn the platform's preprocessing on (PipelineSpec.preprocessing, enabled=True, the default) or convert the "
        "column to numbers without gaps before the data lands")


class PreprocessingError(_Base):
    """The features cannot become the model's numeric input (on the pod a `training.errors.ConfigError`)."""


# -- raw values -------------------------------------------------------------------------------


def _is_missing(values: pd.Series) -> np.ndarray:
    return np.asarray(values.isna(), dtype=bool)


def _numbers(values: pd.Series, column: str, dtype: str = "float") -> np.ndarray:
    """A numeric column as float64 (missing: NaN); a value that is no number is an error naming the column, its dtype
    and row."""
    if pd.api.types.is_bool_dtype(values.dtype) or pd.api.types.is_numeric_dtype(values.dtype):
        return values.to_numpy(dtype="float64", na_value=np.nan)
    if pd.api.types.is_datetime64_any_dtype(values.dtype):
        raise PreprocessingError(
            f"feature {column!r} holds dates, but it is declared {dtype!r}; declare it dtype='date' or 'datetime'"
        )
    out = np.full(len(values), np.nan)
    for i, v in enumerate(values.tolist()):
        if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA or v is pd.NaT:
            continue
        if isinstance(v, str) and not v.strip():
            continue  # an empty cell is missing, as ingest reads it (a frame read with keep_default_na=False holds "")
        if isinstance(v, (bool, np.bool_)):
            out[i] = float(v)
            continue
        if isinstance(v, str) and v.strip().lower() in ("true", "false"):
            out[i] = 1.0 if v.strip().lower() == "true" else 0.0
            continue
        try:
            out[i] = float(v)
        except (TypeError, ValueError):
            fix = (
                "give true/false (or 1/0)"
                if dtype == "bool"
                else "give a number, or declare the column's dtype 'category' in the pipeline's columns if it is text"
            )
            raise PreprocessingError(
                f"feature {column!r} is declared {dtype!r} but holds {v!r} (row {i + 1} of the input); {fix}"
            ) from None
    return out


def _datetimes(values: pd.Series, column: str, dtype: str = "date") -> pd.Series:
    """A date or datetime column (dates, timestamps or ISO text) as UTC timestamps; missing (or empty text): NaT."""
    if pd.api.types.is_datetime64_any_dtype(values.dtype):
        out = values
    else:
        cleaned = values.map(lambda v: v.isoformat() if isinstance(v, (_dt.date, _dt.datetime))
                             else None if isinstance(v, str) and not v.strip() else v)
        try:
            out = pd.to_datetime(cleaned, errors="raise", format="ISO8601", utc=True)
        except (TypeError, ValueError):
            bad = pd.to_datetime(cleaned, errors="coerce", format="ISO8601", utc=True).isna() & cleaned.notna()
            row = int(np.flatnonzero(bad.to_numpy())[0]) if bad.any() else None
            found = (
                f" {cleaned.iloc[row]!r} (row {row + 1} of the input)"
                if row is not None
                else " a value that is not one"
            )
            example = "'2022-05-04'" if dtype == "date" else "'2024-01-02T10:00:00+01:00'"
            raise PreprocessingError(
                f"feature {column!r} is declared {dtype!r} but holds{found}; give ISO 8601 text such as {example}"
            ) from None
    if getattr(out.dt, "tz", None) is None:
        out = out.dt.tz_localize("UTC")
    return out.dt.tz_convert("UTC")


def _declared(state: dict[str, Any], column: str) -> str:
    return str((state.get("feature_types") or {}).get(column, "float"))


def _date_part(stamps: pd.Series, part: str) -> np.ndarray:
    values = getattr(stamps.dt, part)
    return values.to_numpy(dtype="float64", na_value=np.nan)


def _text(value: Any) -> Optional[str]:
    """The vocabulary key of a categorical value: its text (None for a missing value)."""
    if value is None or value is pd.NA or value is pd.NaT or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (np.integer,)):
        return str(int(value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _kind(dtype: str) -> str:
    if dtype in CATEGORICAL:
        return "categorical"
    if dtype in DATES:
        return "date"
    return "numeric"


# -- fit --------------------------------------------------------------------------------------


def check_raw(frame: pd.DataFrame, features: list[str], where: str = "the data") -> None:
    """With preprocessing off: refuse features that hold text, dates or missing values, naming each.

    Raises:
        PreprocessingError: with every offending column and what it holds.
    """
    problems = []
    for c in features:
        values = frame[c]
        if pd.api.types.is_datetime64_any_dtype(values.dtype):
            problems.append(f"{c!r} holds dates")
            continue
        if not (pd.api.types.is_bool_dtype(values.dtype) or pd.api.types.is_numeric_dtype(values.dtype)):
            sample = next((v for v in values.tolist() if _text(v) is not None), None)
            if isinstance(sample, (_dt.date, _dt.datetime)):
                problems.append(f"{c!r} holds dates (e.g. {sample.isoformat()!r})")
                continue
            if sample is not None and not isinstance(sample, (int, float, bool, np.number, np.bool_)):
                problems.append(f"{c!r} holds text (e.g. {sample!r})")
                continue
        missing = int(_is_missing(values).sum())
        if missing:
            problems.append(f"{c!r} has {missing} missing value{'s' if missing != 1 else ''} of {len(values)}")
    if problems:
        raise PreprocessingError(
            "preprocessing is off (PipelineSpec.preprocessing enabled=False), so features go to the model as raw "
            "numbers, "
            f"but in {where} feature {'; '.join(problems)}; {HINT}"
        )


def fit(frame: pd.DataFrame, feature_types: dict[str, str], domains: Optional[dict[str, list[Any]]] = None,
        config: Optional[dict[str, Any]] = None, trainer: str = "lightning", features: Optional[list[str]] = None,
        missing_elsewhere: Iterable[str] = ()) -> dict[str, Any]:
    """The preprocessing state fitted on the train split `frame` (JSON-able).

    Args:
        frame: The train split's raw feature columns.
        feature_types: Declared dtype per feature (`DataSpec.feature_types`); a feature
            without one (every feature of a spec written before the field) is numeric.
        domains: Closed domains of categorical features (kept in the state for reference).
        config: `training.spec.Preprocessing` as a dict (`model_dump()`); None: the defaults.
        trainer: `gbt` (LightGBM) or `lightning`.
        features: The raw feature columns in order (default: `frame`'s columns).
        missing_elsewhere: Numeric features with missing values in another split (their
            indicator columns exist even though train is complete).

    Raises:
        PreprocessingError: preprocessing is off and a feature holds text, dates or gaps;
            or a numeric feature holds text.
    """
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    features = list(features if features is not None else frame.columns)
    if trainer not in ("gbt", "lightning"):
        raise ValueError(f"trainer {trainer!r}: use 'gbt' or 'lightning'")
    missing = [c for c in features if c not in frame.columns]
    if missing:
        raise PreprocessingError(f"the train split lacks feature columns {missing}")
    types = {c: feature_types.get(c, "float") for c in features}
    state: dict[str, Any] = {"version": STATE_VERSION, "trainer": trainer, "features": features, "feature_types": types,
                             "domains": {k: list(v) for k, v in (domains or {}).items() if k in features},
                             "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()}}
    elsewhere = set(missing_elsewhere)
    all_numeric = all(t in NUMERIC for t in types.values())
    if not cfg["enabled"]:
        check_raw(frame, features, "the train split")
        state.update(enabled=False, passthrough=True)
        _set_outputs(state, [{"name": c, "kind": "raw"} for c in features])
        return state
    if all_numeric and not elsewhere and not any(_is_missing(frame[c]).any() for c in features):
        # Complete numeric tables (every pipeline before preprocessing existed) reach the model unchanged.
        for c in features:
            _numbers(
                frame[c], c, types[c]
            )  # text in a numeric column is named here, not as a float conversion error later
        state.update(enabled=True, passthrough=True)
        _set_outputs(state, [{"name": c, "kind": "raw"} for c in features])
        return state
    state.update(enabled=True, passthrough=False)
    columns: list[dict[str, Any]] = []
    for c in features:
        kind = _kind(types[c])
        if kind == "categorical":
            columns.append(_fit_categorical(frame[c], c, int(cfg["max_categories"])))
        elif kind == "date":
            parts = [p for p in cfg["date_parts"] if p != "hour" or types[c] == "datetime"]
            stamps = _datetimes(frame[c], c, types[c])
            for i, p in enumerate(parts):  # one missing-value indicator per date: on its first part
                col = _fit_numeric(_date_part(stamps, p), f"{c}__{p}", cfg, trainer, c in elsewhere, source=c, part=p)
                if i and "indicator" in col:
                    col["indicator"] = False
                columns.append(col)
        else:
            columns.append(_fit_numeric(_numbers(frame[c], c, types[c]), c, cfg, trainer, c in elsewhere, source=c))
    outputs: list[dict[str, Any]] = []
    for col in columns:
        outputs.extend(_column_outputs(col, trainer, cfg))
    state["columns"] = columns
    _set_outputs(state, outputs)
    return state


def _fit_numeric(values: np.ndarray, name: str, cfg: dict[str, Any], trainer: str, missing_elsewhere: bool,
                 source: str, part: Optional[str] = None) -> dict[str, Any]:
    col: dict[str, Any] = {"kind": "numeric", "name": name, "source": source}
    if part is not None:
        col["part"] = part
    if trainer == "gbt":
        return col
    present = values[~np.isnan(values)]
    if cfg["impute"] == "median":
        fill = float(np.median(present)) if len(present) else 0.0
    elif cfg["impute"] == "mean":
        fill = float(np.mean(present)) if len(present) else 0.0
    else:
        fill = 0.0
    col["fill"] = fill
    col["indicator"] = bool(cfg["missing_indicators"] and (len(present) < len(values) or missing_elsewhere))
    if cfg["scale"]:
        filled = np.where(np.isnan(values), fill, values)
        std = float(np.std(filled)) if len(filled) else 0.0
        col["mean"] = float(np.mean(filled)) if len(filled) else 0.0
        col["std"] = std if std > 0 and math.isfinite(std) else 1.0
    return col


def _fit_categorical(values: pd.Series, name: str, max_categories: int) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for v in values.tolist():
        key = _text(v)
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    kept = sorted(counts, key=lambda k: (-counts[k], k))[:max_categories]
    return {"kind": "categorical", "name": name, "source": name, "vocabulary": sorted(kept)}


def _column_outputs(col: dict[str, Any], trainer: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    if col["kind"] == "categorical":
        if trainer == "gbt" or cfg["categorical"] == "index":
            return [{"name": col["name"], "kind": "code", "categorical": trainer == "gbt"}]
        return [{"name": f"{col['name']}={v}", "kind": "onehot"} for v in col["vocabulary"]] + [
            {"name": f"{col['name']}={OTHER}", "kind": "onehot"}
        ]
    outs = [{"name": col["name"], "kind": "numeric"}]
    if col.get("indicator"):
        outs.append({"name": f"{col['name']}__missing", "kind": "indicator"})
    return outs


def _set_outputs(state: dict[str, Any], outputs: list[dict[str, Any]]) -> None:
    state["outputs"] = [o["name"] for o in outputs]
    state["categorical_outputs"] = [i for i, o in enumerate(outputs) if o.get("categorical")]


# -- transform --------------------------------------------------------------------------------


def output_names(state: dict[str, Any]) -> list[str]:
    """The model's input columns, in order."""
    return list(state["outputs"])


def categorical_outputs(state: dict[str, Any]) -> list[int]:
    """Indices of the outputs LightGBM treats as categorical (codes >= 0)."""
    return list(state.get("categorical_outputs", []))


def transform(frame: pd.DataFrame, state: dict[str, Any], dtype: Any = None) -> tuple[np.ndarray, list[str]]:
    """The model input of raw rows `frame` (any extra columns ignored) and its column names.

    `dtype`: float32 for Lightning, float64 for LightGBM (default: by the state's trainer).

    Raises:
        ValueError: a feature column is missing (`PreprocessingError` when preprocessing
            is off and a feature holds text, dates or gaps).
    """
    features = state["features"]
    if not isinstance(frame, pd.DataFrame):
        frame = pd.DataFrame(frame)
    absent = [c for c in features if c not in frame.columns]
    if absent:
        raise ValueError(
            f"model input is missing feature columns {absent}; expected all of {features}, got {list(frame.columns)}"
        )
    dtype = np.dtype(dtype or ("float64" if state["trainer"] == "gbt" else "float32"))
    if state.get("passthrough"):
        if not state.get("enabled", True):
            check_raw(frame, features)
        x = (
            np.column_stack([_numbers(frame[c], c, _declared(state, c)) for c in features])
            if len(frame)
            else np.empty((0, len(features)))
        )
        return np.ascontiguousarray(x, dtype=dtype), output_names(state)
    cfg = state["config"]
    n = len(frame)
    blocks: list[np.ndarray] = []
    stamps_cache: dict[str, pd.Series] = {}
    for col in state["columns"]:
        source = frame[col["source"]]
        if col["kind"] == "categorical":
            blocks.append(_encode_categorical(source, col, state["trainer"], cfg))
            continue
        if "part" in col:
            if col["source"] not in stamps_cache:
                stamps_cache[col["source"]] = _datetimes(source, col["source"], _declared(state, col["source"]))
            values = _date_part(stamps_cache[col["source"]], col["part"])
        else:
            values = _numbers(source, col["source"], _declared(state, col["source"]))
        if state["trainer"] == "gbt":
            blocks.append(values.reshape(n, 1))
            continue
        missing = np.isnan(values)
        filled = np.where(missing, col["fill"], values)
        if "mean" in col:
            filled = (filled - col["mean"]) / col["std"]
        blocks.append(filled.reshape(n, 1))
        if col.get("indicator"):
            blocks.append(missing.astype("float64").reshape(n, 1))
    x = np.concatenate(blocks, axis=1) if blocks else np.empty((n, 0))
    return np.ascontiguousarray(x, dtype=dtype), output_names(state)


def _encode_categorical(values: pd.Series, col: dict[str, Any], trainer: str, cfg: dict[str, Any]) -> np.ndarray:
    vocab = col["vocabulary"]
    index = {v: i for i, v in enumerate(vocab)}
    other = len(vocab)
    codes = np.fromiter((index.get(_text(v), other) if _text(v) is not None else other for v in values.tolist()),
                        dtype="int64", count=len(values))
    if trainer == "gbt" or cfg["categorical"] == "index":
        return codes.astype("float64").reshape(-1, 1)
    onehot = np.zeros((len(values), other + 1))
    onehot[np.arange(len(values)), codes] = 1.0
    return onehot


# -- targets ----------------------------------------------------------------------------------


def label_key(value: Any) -> Any:
    """A label as JSON keeps it: numpy scalars become Python ones."""
    return value.item() if isinstance(value, np.generic) else value


def class_list(*targets: Iterable[Any]) -> list[Any]:
    """The sorted distinct labels over `targets` (missing labels skipped)."""
    seen: set[Any] = set()
    for t in targets:
        array = np.asarray(t) if not isinstance(t, pd.Series) else t.to_numpy()
        distinct = np.unique(array) if array.dtype.kind in "biu" else pd.unique(pd.Series(array, dtype=object))
        seen.update(label_key(v) for v in distinct if _text(v) is not None)
    try:
        return sorted(seen)
    except TypeError:
        return sorted(seen, key=str)


def encode_labels(values: Iterable[Any], classes: list[Any]) -> np.ndarray:
    """Class indices of `values` in `classes`.

    Raises:
        ValueError: a value is missing or not one of `classes`.
    """
    array = values if isinstance(values, np.ndarray) else np.asarray(list(values), dtype=object)
    if array.dtype.kind in "biu":  # integer or bool labels: no per-row Python
        codes = (
            pd.Index(np.asarray(classes)).get_indexer(array)
            if all(isinstance(c, (int, bool)) for c in classes)
            else np.full(len(array), -1)
        )
    else:
        codes = pd.Index([label_key(c) for c in classes], dtype=object).get_indexer(
            pd.Series(array, dtype=object).map(label_key)
        )
    if (codes < 0).any():
        bad = array[int(np.flatnonzero(codes < 0)[0])]
        raise ValueError(f"label {label_key(bad)!r} is not one of the classes {classes}")
    return codes.astype("int64")


def positive_index(classes: list[Any], positive_label: Any = None) -> int:
    """The positive class of a binary target: `positive_label` when given, else the second of the sorted labels."""
    if positive_label is None:
        return 1
    for i, c in enumerate(classes):
        if c == positive_label or _text(c) == _text(positive_label):
            return i
    raise ValueError(f"positive_label {positive_label!r} is not one of the classes {classes}")


# -- images -----------------------------------------------------------------------------------


def check_image_meta(meta: dict[str, Any], where: str) -> None:
    """An image model's `meta.json` fields: `shape` `[H, W]` or `[H, W, C]` (positive ints), `scale` `[min, max]` with
    min < max.

    Raises:
        ValueError: naming `where`, the field and what it holds.
    """
    shape, scale = meta.get("shape"), meta.get("scale")
    if (
        not isinstance(shape, list)
        or len(shape) not in (2, 3)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
    ):
        raise ValueError(
            f"{where}: field 'shape' of an image model must be [height, width] or [height, width, channels], got "
            f"{shape!r}"
        )
    if (
        not isinstance(scale, list)
        or len(scale) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in scale)
        or not scale[0] < scale[1]
    ):
        raise ValueError(f"{where}: field 'scale' of an image model must be [min, max] with min < max, got {scale!r}")


def image_batch(cells: Iterable[Any], shape: list[int], low: float, high: float) -> np.ndarray:
    """Images sent flattened (one list of values per row, row-major from `shape`, `[H, W]` or `[H, W, C]`) as the
    model's float32 `[N, C, H, W]` input, `(value - low) * (1 / (high - low))` in float32: exactly what
    `training.streaming.ImageCollate` computes from the stored images in training.

    Raises:
        PreprocessingError: naming the 1-based row: values that are not numbers, another number of them, or one
            outside [low, high] (NaN included).
    """
    rows = list(cells)
    size = int(np.prod(shape))
    images = np.zeros((len(rows), size), dtype=np.float32)
    for i, cell in enumerate(rows, start=1):
        try:
            row = np.asarray(cell, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise PreprocessingError(f"row {i}: expected a list of pixel values, got {str(cell)[:100]}") from None
        if row.size != size:
            raise PreprocessingError(
                f"row {i} holds {row.size} values; the model reads {size}: an image of shape {list(shape)} "
                "flattened row-major"
            )
        outside = ~((row >= low) & (row <= high))
        if outside.any():
            at = int(np.argmax(outside))
            raise PreprocessingError(
                f"row {i}: value {row[at]:g} at position {at} is outside the image range {low:g}..{high:g}"
            )
        images[i - 1] = row
    x = images.reshape(len(rows), *shape)
    x = x[:, None] if len(shape) == 2 else x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray((x - np.float32(low)) * np.float32(1.0 / (float(high) - float(low))))
