"""The team-facing policies of a pipeline: when a version may become champion (`PromotionSpec`) and when it
retrains (`RetrainPolicy`). Split from `trainyard.spec`, which re-exports both."""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from trainyard.cron import is_valid_cron
from trainyard.search import StrictSpec
from trainyard.tasks import metric_direction


class PromotionSpec(StrictSpec):
    """When a new version may take the `champion` alias (checked by `trainyard.promotion`).

    Every new version gets alias `challenger`; `champion` moves to it only when all hold:

    - threshold: `metric` on the pinned test split is at least `threshold` (mode
      "max") or at most `threshold` (mode "min"); skipped when `threshold` is None;
    - beats_champion: `metric` beats the current champion's, on the same test
      split, by more than `min_improvement` (the champion is re-evaluated on this
      split from its served labels and probabilities when its recorded metric is
      from another one: any metric `trainyard.tasks` lists for the task can be);
    - beats_baseline: `metric` beats the trivial baseline's (`baseline_<metric>`,
      the train split's class prior or mean, reported by every trial); skipped with
      a note for versions trained before baselines were reported;
    - data_validation: the blocking expectations check passed for the data
      version the model was trained on, and that data is not quarantined;
    - serving_smoke_test: a fresh process with only the serving dependencies
      loads `models:/<name>@challenger`, predicts on the input example and the
      test split, and `metric` computed from what it served equals the
      training-side one within `served_metric_tolerance`; it must finish within
      `smoke_test_timeout_s`;
    - clean_lineage: the version was trained from committed code (its recorded
      `code_dirty` is False) with the deployed dependency lock (its recorded
      `lock_hash` equals the deciding orchestrator's). `require_clean_lineage`
      says whether a finding blocks: True blocks, False records it as a warning
      and promotes, None (default) takes the environment's default: blocking in
      `cluster`, a warning in `local` (`TRAINYARD_ENV`).

    Each decision and its evidence is recorded on the version; `trainyard
    registry promote|rollback --force --reason ...` is the only way past a
    failing check, and is recorded as an override.
    """

    # `mode` unset takes the metric's direction (`trainyard.tasks.metric_direction`):
    # PromotionSpec(metric="test_logloss") minimises.
    metric: str = "test_acc"
    mode: Literal["max", "min"] = "max"
    min_improvement: float = Field(0.0, ge=0.0)
    threshold: Optional[float] = None
    smoke_test_timeout_s: float = Field(300.0, gt=0, le=1800)
    served_metric_tolerance: float = Field(1e-6, ge=0, le=0.1)
    require_clean_lineage: Optional[bool] = None

    @field_validator("metric")
    @classmethod
    def _test_metric(cls, v: str) -> str:
        if not re.match(r"^test_[a-z0-9_]+$", v):
            raise ValueError(
                f"promotion.metric {v!r} must be a metric measured on the held-out test split, named "
                "'test_<name>' (e.g. 'test_acc'), so versions are compared on the same pinned test data"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _mode_of_metric(cls, data: Any) -> Any:
        # A metric named without its mode gets its direction: PromotionSpec(metric="test_logloss") promotes lower
        # losses.
        if isinstance(data, dict) and "mode" not in data and isinstance(data.get("metric"), str):
            known = metric_direction(data["metric"])
            if known is not None:
                return {**data, "mode": known}
        return data

    @model_validator(mode="after")
    def _direction(self) -> "PromotionSpec":
        known = metric_direction(self.metric)
        if known is not None and known != self.mode:
            raise ValueError(
                f"promotion.mode {self.mode!r} with metric {self.metric!r} would promote worse models; use "
                f"mode={known!r}"
            )
        lower_is_better = self.metric.endswith(("_loss", "_logloss", "_rmse", "_mae", "_mse", "_error"))
        if lower_is_better and self.mode == "max":
            raise ValueError(
                f"promotion.mode 'max' with metric {self.metric!r} would promote worse models; use mode='min'"
            )
        return self

class RetrainPolicy(StrictSpec):
    """When a pipeline retrains (see `pipelines.retrain`); a team sets a default in its `TeamSpec`.

    - `on_new_data`: the landing sensor (`<team>__<name>__landing`) starts the
      `prepare` job when new or changed files land;
    - `cron`: a schedule (`<team>__<name>__retrain`) starts the `prepare` job on
      this cron string (in `timezone`); a tick whose data version did not change
      since the last sweep is skipped, so nothing retrains on the same data;
    - `drift_psi`: new data alone does not retrain. Landing and scheduled runs
      ingest and validate only; the drift sensor (`<team>__<name>__drift`)
      compares the newest validated version with the data the `champion` model
      was trained on and starts the sweep only when the largest per-feature PSI
      exceeds this threshold (or when there is no champion yet);
    - `automatic` (default on): the sweep sensor (`<team>__<name>__sweep`) runs
      from the start, trains every sweep to its budget and then starts the
      `promote` job once per finished study, so a sweep ends in a promotion
      decision with nobody starting anything; off, that sensor starts stopped
      and `promote` is started by hand.

    Example:
        >>> RetrainPolicy(cron="0 3 * * *", on_new_data=False, drift_psi=0.2)
    """

    on_new_data: bool = True
    automatic: bool = True
    cron: Optional[str] = None
    timezone: str = "UTC"
    drift_psi: Optional[float] = None

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        if not is_valid_cron(v):
            raise ValueError(
                f"cron {v!r} is not a cron string; use five fields 'minute hour day month weekday', e.g. '0 3 * * *' "
                "(03:00 daily)"
            )
        return v

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, v: str) -> str:
        import zoneinfo

        try:
            zoneinfo.ZoneInfo(v)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError) as e:
            raise ValueError(f"timezone {v!r} is not an IANA time zone; use e.g. 'UTC' or 'Europe/Berlin'") from e
        return v

    @field_validator("drift_psi")
    @classmethod
    def _psi(cls, v: Optional[float]) -> Optional[float]:
        if v is not None and not v > 0:
            raise ValueError(
                f"drift_psi {v!r} must be above 0 (0.1: moderate shift, 0.25: large shift), or None to retrain on any "
                "new data"
            )
        return v

    @model_validator(mode="after")
    def _something_ingests(self) -> "RetrainPolicy":
        if self.drift_psi is not None and not self.on_new_data and self.cron is None:
            raise ValueError(
                "drift_psi gates retraining on new data, but with on_new_data=False and no cron nothing ingests new "
                "data; "
                "set on_new_data=True or a cron schedule"
            )
        return self
