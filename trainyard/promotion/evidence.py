"""Evidence a promotion decision rests on, read from Dagster's check results or a version's tags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from trainyard import naming
from trainyard.lineage import DATA_VERSION_TAG, METRIC_PREFIX, PIPELINE_TAG, VALIDATION_SUMMARY_TAG, VALIDATION_TAG

if TYPE_CHECKING:
    from trainyard.store import FileStore


@dataclass(frozen=True)
class ValidationEvidence:
    """What the data validation of the candidate's training data found.

    Attributes:
        passed: The expectations check passed for this data version and it is not quarantined.
        detail: One line saying why, with the numbers.
        data_version: DVC md5 of the raw data the model was trained on.
        expectations: Expectations evaluated (None when unknown).
        failed: Expectations that failed (None when unknown).
        max_psi: Largest drift PSI against the previous data version.
        run_id: Dagster run whose check is the evidence.
    """

    passed: bool
    detail: str
    data_version: Optional[str] = None
    expectations: Optional[int] = None
    failed: Optional[int] = None
    max_psi: Optional[float] = None
    run_id: Optional[str] = None

    def lineage_fields(self) -> dict[str, str]:
        """The `LineageRecord` fields recorded at registration (`validation`, `validation_summary`)."""
        return {"validation": "passed" if self.passed else "failed", "validation_summary": self.detail}

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> "ValidationEvidence":
        """The evidence recorded on a version at registration."""
        state = tags.get(VALIDATION_TAG)
        if state is None:
            return cls(False, f"the version carries no data validation record (tag {VALIDATION_TAG})")
        summary = tags.get(VALIDATION_SUMMARY_TAG, "")
        return cls(state == "passed", f"recorded at registration: {state}" + (f" ({summary})" if summary else ""),
                   data_version=tags.get(DATA_VERSION_TAG))


def evidence_from_check(
    check_name: str, data_version: str, run_id: str, passed: bool, metadata: Mapping[str, Any]
) -> ValidationEvidence:
    """The evidence of the expectations check that ran for `data_version` in run `run_id`.

    Args:
        check_name: The asset check's name (`expectations`).
        data_version: The data version the candidate was trained on (and the check ran for).
        run_id: The Dagster run of the check.
        passed: Whether the check passed.
        metadata: The check's metadata as plain values (`expectations`, `failed`, `max_psi`).
    """
    expectations = _int_or_none(metadata.get("expectations"))
    failed = _int_or_none(metadata.get("failed"))
    max_psi = _float_or_none(metadata.get("max_psi"))
    detail = (
        f"{check_name} check {'passed' if passed else 'FAILED'} for data version {data_version} in run {run_id[:8]}: "
        f"{expectations} expectations, {failed} failed, max drift PSI {0.0 if max_psi is None else max_psi:.4f}"
    )
    return ValidationEvidence(passed, detail, data_version, expectations, failed, max_psi, run_id)


def _int_or_none(value: Any) -> Optional[int]:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _float_or_none(value: Any) -> Optional[float]:
    try:
        return float(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def recorded_metrics(tags: Mapping[str, str]) -> dict[str, float]:
    """The metrics recorded on a version as `trainyard.metric.<name>` tags."""
    out = {}
    for key, value in tags.items():
        if key.startswith(METRIC_PREFIX):
            number = _float_or_none(value)
            if number is not None:
                out[key[len(METRIC_PREFIX):]] = number
    return out


def is_quarantined(store: "FileStore", pipeline: str, md5: str) -> bool:
    """Whether a data version sits in quarantine and has not been released (with a recorded reason)."""
    where = naming.quarantine_dir(store, *pipeline.split("/"), md5)
    return store.exists(where) and not store.exists(f"{where}/release.json")


def validation_now(store: Optional["FileStore"], tags: Mapping[str, str]) -> ValidationEvidence:
    """Recorded validation evidence, failed if the data has been quarantined (and not released) since."""
    evidence = ValidationEvidence.from_tags(tags)
    pipeline, md5 = tags.get(PIPELINE_TAG), tags.get(DATA_VERSION_TAG)
    if evidence.passed and store is not None and pipeline and md5 and is_quarantined(store, pipeline, md5):
        where = naming.quarantine_dir(store, *pipeline.split("/"), md5)
        return ValidationEvidence(False, f"data version {md5} has been quarantined since ({where})", md5)
    return evidence
