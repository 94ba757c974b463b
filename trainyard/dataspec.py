"""The data a pipeline declares: where its landing files are and how to read them, its columns, and its split.

`SourceSpec`, `ColumnSpec` and `SplitSpec` are fields of `trainyard.spec.PipelineSpec`;
import them from `trainyard` (or `trainyard.spec`), as team modules do.

Example:
    >>> ColumnSpec(dtype="int", domain=[0, 1]).categorical
    False
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from training.spec import FeatureDtype
from trainyard.search import StrictSpec


class SourceSpec(StrictSpec):
    """Landing files: where they are, which of them to take and how to parse them.

    Attributes:
        prefix: Directory or prefix, relative to the object store root, or
            absolute (`s3://bucket/prefix` on an S3 store, `/data/...` on a
            local one).
        pattern: A glob, or a list of globs, relative to `prefix` (`*`, `?`,
            `[...]`, and `**` for any depth); a file matching any of them is
            a landing file.
        format: `csv`, `parquet`, `jsonl` (JSON lines), or `auto` to tell by
            extension (`.csv`; `.parquet`/`.pq`; `.jsonl`/`.ndjson`/`.json`).
        encoding: Text encoding of CSV files (a Python codec name).
        duplicates: Rows that repeat an earlier row of the data version:
            `keep_first` (default) drops the repeats, keeping the first, and
            reports how many; `reject` makes them failing rows (the version
            is rejected, or under `on_bad_data="warn"` they are set aside);
            `allow` keeps them. Deliveries overlap in practice (a day re-sent,
            a backfill), and a repeated row adds no information but weights
            itself twice, so dropping it with a count is the safe default.
        missing_values: The cell texts (CSV) that mean "missing", matched
            exactly after parsing quotes. Default `[""]`: an empty cell
            (`,,` or `,"",`) is missing, and nothing else is: `n/a`, `NA`,
            `null` or `-` in a number, bool or date column are values that do
            not fit its type (the file is rejected naming them), and in a text
            column they are text. List the tokens your export writes, e.g.
            `["", "n/a", "NULL"]`, to read them as missing. Cells read as
            missing are counted per column and reported (docs/data.md).

    Example:
        >>> SourceSpec(prefix="s3://lake/churn", pattern=["2024/**/*.parquet", "backfill/*.csv"], format="auto").globs
        ['2024/**/*.parquet', 'backfill/*.csv']
    """

    prefix: str
    pattern: Union[str, list[str]] = "*.csv"
    format: Literal["csv", "parquet", "jsonl", "auto"] = "csv"
    encoding: str = "utf-8"
    duplicates: Literal["keep_first", "reject", "allow"] = "keep_first"
    missing_values: list[str] = Field(default_factory=lambda: [""])

    @field_validator("pattern")
    @classmethod
    def _relative_globs(cls, v: Union[str, list[str]]) -> Union[str, list[str]]:
        globs = [v] if isinstance(v, str) else v
        if not globs:
            raise ValueError("pattern must name at least one glob, e.g. '*.csv'")
        for glob in globs:
            if not glob.strip() or glob.startswith("/") or "://" in glob or ".." in glob.split("/"):
                raise ValueError(
                    f"pattern {glob!r} must be a non-empty glob relative to prefix, without '..' "
                    "(put absolute locations in prefix)"
                )
        return v

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, v: str) -> str:
        import codecs

        try:
            codecs.lookup(v)
        except LookupError as e:
            raise ValueError(f"encoding {v!r} is not a codec Python knows (e.g. 'utf-8', 'latin-1', 'cp1252')") from e
        return v

    @property
    def globs(self) -> list[str]:
        """The patterns as a list."""
        return [self.pattern] if isinstance(self.pattern, str) else list(self.pattern)

    def check_columns(self, columns: dict[str, "ColumnSpec"], target: str) -> None:
        """Check the pipeline's declared columns against this source (landing files carry them all: nothing to
        check)."""


class ColumnSpec(StrictSpec):
    """One declared column: its role, type, nulls, range, categorical domain, finiteness.

    `role` says what the platform does with the column (docs/data.md, "Columns"):

    - `feature` (default): the model is trained on it (the pipeline's `target`
      column is the label, whatever its role says);
    - `id`: an identifier (a customer id). Kept with the data through validation
      and the splits and returned with every prediction, never trained on;
    - `timestamp`: when the row happened (a `date` or `datetime` column); kept and
      returned like an id, never trained on;
    - `ignore`: the files may carry it; it is dropped at ingest, unvalidated.

    `dtype`: `int`, `float`, `bool`; `str` (text; as a feature, an open
    categorical); `category` (a categorical: closed when `domain` lists its
    values, open otherwise); `date` (`2022-05-04`) and `datetime` (ISO 8601, UTC
    when the text names no zone), parsed from text at ingest. `min`/`max` apply to
    numbers; `nullable=True` accepts empty cells (a feature's missing values are
    then imputed by the platform's preprocessing, `PipelineSpec.preprocessing`).
    `finite` (float columns only): NaN and +-inf are bad values, reported by
    the platform check `trainyard_values_are_finite`.

    Example:
        >>> ColumnSpec(dtype="category", domain=["basic", "plus", "pro"], nullable=True).role
        'feature'
    """

    dtype: FeatureDtype
    role: Literal["feature", "id", "timestamp", "ignore"] = "feature"
    nullable: bool = False
    min: Optional[float] = None
    max: Optional[float] = None
    domain: Optional[list[Union[int, str, bool]]] = None
    finite: bool = True

    @model_validator(mode="after")
    def _range_ordered(self) -> "ColumnSpec":
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is greater than max {self.max}")
        if not self.finite and self.dtype != "float":
            raise ValueError(f"finite=False applies to float columns only; this column's dtype is {self.dtype!r}")
        if (self.min is not None or self.max is not None) and self.dtype not in ("int", "float"):
            raise ValueError(f"min/max apply to int and float columns only; this column's dtype is {self.dtype!r}")
        if self.domain is not None and self.dtype in ("float", "date", "datetime"):
            raise ValueError(
                f"domain applies to int, str, bool and category columns; this column's dtype is {self.dtype!r}"
            )
        if self.role == "timestamp" and self.dtype not in ("date", "datetime"):
            raise ValueError(f"role 'timestamp' needs dtype 'date' or 'datetime', got {self.dtype!r}")
        if self.role == "id" and self.dtype not in ("int", "str", "category"):
            raise ValueError(f"role 'id' needs dtype 'int', 'str' or 'category', got {self.dtype!r}")
        return self

    @property
    def categorical(self) -> bool:
        """Whether a feature of this dtype is encoded as categories (`str`, `category`)."""
        return self.dtype in ("str", "category")

class SplitSpec(StrictSpec):
    """Deterministic train/val/test split (docs/data.md, "The split").

    `method="hash"` (default): each row's part comes from a salted hash of its id
    (or of the whole row), so a row keeps its part as deliveries add rows, and a
    test row of a later version never was a training row of an earlier one.
    `method="shuffle"`: the split of versions validated before the hash split
    existed (a seeded, stratified shuffle of the version's rows, which moves rows
    between parts when the data grows); `trainyard reproduce` uses it for those
    versions, and a pipeline may keep it to continue a study it began with.
    """

    val_fraction: float = Field(0.15, gt=0, lt=0.5)
    test_fraction: float = Field(0.15, gt=0, lt=0.5)
    seed: int = 0
    method: Literal["hash", "shuffle"] = "hash"
