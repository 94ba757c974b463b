"""The data engine behind `raw_data` and `validated_data`: plain functions over the store they are given.

The chain, as the assets use it:

1. `trainyard.data.ingest` reads the landing files into a canonical snapshot;
2. `to_canonical` keeps the stored columns (every declared one but role
   `ignore`) in declared order and declared types (`cast_values` parses dates
   and times), and `CanonicalParquetWriter` writes them so that equal data gives
   equal bytes (hence an equal DVC md5, hence an equal Dagster data version);
3. `validate_snapshot` streams a snapshot once through the pipeline's Great
   Expectations suite (`trainyard.data.expectations.ArrowSuite`), the platform
   checks (finite floats, duplicate rows, repeated ids as a warning) and the profiler, then renders GE's
   Data Docs;
4. `drift` compares the profile with the previous validated version's: PSI
   for every feature (categories; per-value bins of discrete numerics,
   quantile bins of continuous ones), KS for numerics; `drift_verdict` says
   stable, moderate or drifted;
5. `decide` applies the pipeline's `on_bad_data` policy; `set_aside_rows`
   moves bad rows out when the policy is "warn";
6. `split_snapshot` writes the deterministic train/val/test split, by a salted
   hash of each row's id (or whole row), stable across versions;
7. the quarantine functions keep rejected data with its report, list it,
   and record releases (who, when, why).

`validate_version` runs steps 3 to 7 for one raw snapshot. `validate`,
`split`, `psi` and `drift_report` are the same operations on in-memory
frames, for small data and tests.

Modules, bottom to top: `errors`, `canonical`, `suite`, `report`, `checks`,
`profile`, `splitting`, `drift_detection`, `quarantine`, `metrics` and
`expectations` (the streamed GE engine), `validation`; `landing` and `ingest`
for ingestion. This package re-exports the names callers use, so `from
trainyard import data as dq` then `dq.validate_version(...)` works. The module
names differ from the functions `validate`, `split` and `drift` on purpose, so
`trainyard.data.split` is always the function and never a module.

Errors about the data itself derive from `DataQualityError` and are terminal:
retrying reads the same data. Storage errors from the object store pass
through unchanged (some are retryable). Great Expectations, scikit-learn and
SciPy are imported inside the functions that need them (slow imports).
"""

from trainyard.data.canonical import (
    ARROW_TYPES,
    BATCH_ROWS,
    PARQUET_OPTIONS,
    CanonicalParquetWriter,
    canonical_schema,
    cast_values,
    dictionary_columns,
    read_rows,
    to_canonical,
    write_parquet_deterministic,
)
from trainyard.data.checks import (
    DEDUP_MEMORY_BYTES,
    FINITE_EXPECTATION,
    UNIQUE_IDS_EXPECTATION,
    UNIQUE_ROWS_EXPECTATION,
    row_hashes,
)
from trainyard.data.drift_detection import (
    DRIFT_MIN_ROWS,
    PSI_ALERT,
    PSI_EPSILON,
    PSI_WARN,
    delivery_drift,
    drift,
    drift_markdown,
    drift_report,
    drift_verdict,
    numeric_edges,
    psi,
    schema_changes,
)
from trainyard.data.errors import (
    DataQualityError,
    MalformedLandingFile,
    MissingLandingData,
    QuarantineError,
    SchemaMismatch,
    SplitError,
)
from trainyard.data.expectations import UnsupportedExpectation
from trainyard.data.profile import (
    CATEGORY_LIMIT,
    PROFILE_DOMAIN_LIMIT,
    PROFILE_SAMPLE_ROWS,
    profile_snapshot,
    profile_to_suite,
)
from trainyard.data.quarantine import (
    QuarantineEntry,
    list_quarantine,
    quarantine_root,
    quarantine_rows,
    quarantine_snapshot,
    read_quarantine,
    release_of,
    release_quarantine,
)
from trainyard.data.report import PLATFORM_CHECK, SUITE_CHECK, ValidationReport
from trainyard.data.splitting import split, split_snapshot, split_table
from trainyard.data.suite import GX_TYPE_NAMES, expectation_configs, suite_expectations, suite_hash
from trainyard.data.validation import (
    SnapshotValidation,
    Verdict,
    VersionOutcome,
    decide,
    set_aside_rows,
    validate,
    validate_snapshot,
    validate_version,
)

__all__ = [
    "ARROW_TYPES",
    "BATCH_ROWS",
    "CATEGORY_LIMIT",
    "DEDUP_MEMORY_BYTES",
    "DRIFT_MIN_ROWS",
    "FINITE_EXPECTATION",
    "UNIQUE_IDS_EXPECTATION",
    "GX_TYPE_NAMES",
    "PARQUET_OPTIONS",
    "PLATFORM_CHECK",
    "PROFILE_DOMAIN_LIMIT",
    "PROFILE_SAMPLE_ROWS",
    "PSI_ALERT",
    "PSI_EPSILON",
    "PSI_WARN",
    "SUITE_CHECK",
    "UNIQUE_ROWS_EXPECTATION",
    "CanonicalParquetWriter",
    "DataQualityError",
    "MalformedLandingFile",
    "MissingLandingData",
    "QuarantineEntry",
    "QuarantineError",
    "SchemaMismatch",
    "SnapshotValidation",
    "SplitError",
    "UnsupportedExpectation",
    "ValidationReport",
    "Verdict",
    "VersionOutcome",
    "canonical_schema",
    "cast_values",
    "decide",
    "delivery_drift",
    "dictionary_columns",
    "drift",
    "drift_markdown",
    "drift_report",
    "drift_verdict",
    "expectation_configs",
    "list_quarantine",
    "numeric_edges",
    "profile_snapshot",
    "profile_to_suite",
    "psi",
    "schema_changes",
    "quarantine_root",
    "quarantine_rows",
    "quarantine_snapshot",
    "read_quarantine",
    "read_rows",
    "release_of",
    "release_quarantine",
    "row_hashes",
    "set_aside_rows",
    "split",
    "split_snapshot",
    "split_table",
    "suite_expectations",
    "suite_hash",
    "to_canonical",
    "validate",
    "validate_snapshot",
    "validate_version",
    "write_parquet_deterministic",
]
