"""Handoff events: how serving learns that a model's `champion` changed.

Each champion change (a promotion whose policy passed, a forced override, a
rollback) becomes one `HandoffEvent`:

1. a JSON record in the object store at
   `<store>/handoff/<model>/<UTC timestamp>-v<version>.json` (written first; the
   durable source of truth, which a serving controller can poll or list), then
2. when `webhook_url` is set, an HTTP `POST` of the same JSON to it (the
   notification), retried on connection errors, timeouts, 408, 429 and 5xx.

Records never change once written; a webhook that failed is re-delivered from
the record with the same `event_id`, so consumers deduplicate on it.

Example:
    >>> handoff = HandoffPublisher(store=ObjectStore(root="/var/trainyard/store"))
    >>> receipt = handoff.publish(event)
    >>> receipt.uri
    '/var/trainyard/store/handoff/vision.digits/20250130T070102.123456Z-v3.json'
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Callable, Literal, Optional

from dagster import ConfigurableResource
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from common.retry import RetriesExhausted, retry_call
from resources.storage import ObjectStore, StorageError
from trainyard import naming
from trainyard.redact import endpoint_only

logger = logging.getLogger(__name__)

EVENT_ID_HEADER = "X-Trainyard-Event-Id"
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class HandoffError(Exception):
    """A handoff event could not be written or is malformed (terminal)."""


class HandoffDeliveryFailed(HandoffError):
    """The record is written but the webhook did not accept it; re-delivering may succeed.

    Attributes:
        uri: The written record, from which `HandoffPublisher.deliver` re-sends it.
        status: The last HTTP status, or None when no answer came back.
    """

    def __init__(self, message: str, uri: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.uri = uri
        self.status = status


class _WebhookRefused(Exception):
    """The webhook answered with a status that retrying cannot change (e.g. 400)."""

    def __init__(self, message: str, status: Optional[int]) -> None:
        super().__init__(message)
        self.status = status


class _WebhookUnavailable(_WebhookRefused):
    """No answer, or 408, 429 or 5xx: retrying may succeed."""


class HandoffEvent(BaseModel):
    """One champion change, as serving consumes it.

    Attributes:
        event_id: Unique id; consumers deduplicate re-deliveries on it.
        model: Registered model name.
        version: The version that now holds `alias`.
        alias: The alias that moved (`champion`).
        alias_uri: `models:/<model>@<alias>`: what MLServer or `mlflow models serve` load.
        model_uri: `models:/<model>/<version>`: the same model, pinned.
        artifact_uri: Storage location of the version's MLflow model directory
            (`s3://...`): what KServe's `storageUri` takes.
        previous_version: The version that held the alias before, if any.
        action: `promote` (policy passed or forced) or `rollback`.
        override: True when the change was forced past a failing check.
        reason: Why, in words (the policy's verdict or the override's reason).
        decided_by: Who or what decided (a Dagster run, a CLI user).
        at: When, ISO 8601 in UTC.
        run_id: MLflow run that logged the model.
        lineage: Data version, code version, trial... copied from the version's tags.
        checks: The policy checks and their outcome.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    event_id: str
    model: str
    version: str
    alias: str = "champion"
    alias_uri: str
    model_uri: str
    artifact_uri: str
    previous_version: Optional[str] = None
    action: Literal["promote", "rollback"]
    override: bool = False
    reason: str
    decided_by: str
    at: str
    run_id: Optional[str] = None
    lineage: dict[str, str] = Field(default_factory=dict)
    checks: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("at")
    @classmethod
    def _utc(cls, value: str) -> str:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError as e:
            raise ValueError(f"at={value!r} is not an ISO 8601 timestamp") from e
        offset = parsed.utcoffset()
        if offset is None or offset.total_seconds() != 0:
            raise ValueError(f"at={value!r} must be in UTC (e.g. '2025-01-30T07:01:02.123456+00:00')")
        return value

    def file_name(self) -> str:
        """`<YYYYmmddTHHMMSS.ffffff>Z-v<version>.json`: sorts by time within a model's folder."""
        stamp = datetime.fromisoformat(self.at).astimezone(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        return f"{stamp}-v{self.version}.json"


@dataclass(frozen=True)
class HandoffReceipt:
    """Where an event went.

    Attributes:
        uri: The record in the object store.
        webhook: `delivered`, or `disabled` when no webhook is configured.
        status: HTTP status of the accepted delivery.
        attempts: Webhook attempts made (0 when disabled).
    """

    uri: str
    webhook: Literal["delivered", "disabled"]
    status: Optional[int] = None
    attempts: int = 0


def now_iso() -> str:
    """The current time as the ISO 8601 UTC string `HandoffEvent.at` expects."""
    return datetime.now(UTC).isoformat()


class HandoffPublisher(ConfigurableResource):
    """Writes handoff events to the object store and, optionally, POSTs them to a webhook.

    Attributes:
        store: Object store the records go to (under `handoff/`).
        webhook_url: `http(s)://` endpoint notified of each event; None disables it.
            Dagster keeps resource config in its run storage and shows it in the
            UI: a URL that carries a token belongs in `webhook_url_env` instead.
        webhook_url_env: Name of the environment variable that holds the URL,
            read at delivery (the URL is then never part of any config).
        webhook_timeout_s: Deadline per webhook request.
        webhook_attempts: Tries per delivery on retryable failures.
        webhook_backoff_s: Wait before the first retry; doubles on each further one.
    """

    store: ObjectStore
    webhook_url: Optional[str] = Field(default=None, description="http(s):// URL POSTed each event; None disables")
    webhook_url_env: Optional[str] = Field(
        default=None, description="environment variable holding the URL, read at delivery"
    )
    webhook_timeout_s: float = Field(default=5.0, gt=0, le=120)
    webhook_attempts: int = Field(default=3, ge=1, le=10)
    webhook_backoff_s: float = Field(default=0.5, ge=0, le=60)

    # Waits between webhook attempts; tests replace it on an instance to observe the backoff.
    _sleep: Callable[[float], None] = PrivateAttr(default_factory=lambda: time.sleep)

    @field_validator("webhook_url")
    @classmethod
    def _check_webhook(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"webhook_url={endpoint_only(value)!r} must start with http:// or https://")
        return value or None

    def target(self) -> Optional[str]:
        """The webhook URL: `webhook_url`, else the value of `webhook_url_env`; None when neither is configured.

        Raises:
            HandoffError: `webhook_url_env` names a variable that is unset, or not an http(s) URL.
        """
        if self.webhook_url is not None or self.webhook_url_env is None:
            return self.webhook_url
        value = os.environ.get(self.webhook_url_env, "").strip()
        if not value.startswith(("http://", "https://")):
            state = "is not set" if not value else f"is not an http(s) URL ({endpoint_only(value)})"
            raise HandoffError(f"the handoff webhook's variable {self.webhook_url_env} {state}")
        return value

    def event_uri(self, event: HandoffEvent) -> str:
        """`<store>/handoff/<model>/<timestamp>-v<version>.json`."""
        return f"{naming.handoff_dir(self.store, event.model)}/{event.file_name()}"

    def publish(self, event: HandoffEvent) -> HandoffReceipt:
        """Writes the record, then delivers it to the webhook when one is configured.

        Raises:
            HandoffError: The record could not be written (nothing was sent).
            HandoffDeliveryFailed: The record is written, the webhook did not accept it.
        """
        uri = self.event_uri(event)
        try:
            self.store.write_json(uri, event.model_dump(mode="json"))
        except StorageError as e:
            raise HandoffError(f"could not write handoff event {event.event_id} to {uri}: {e}") from e
        return self.deliver(event, uri)

    def deliver(self, event: HandoffEvent, uri: str) -> HandoffReceipt:
        """POSTs the event (with its record's URI) to the webhook, retrying transient failures.

        Connection errors, timeouts, 408, 429 and 5xx are retried up to
        `webhook_attempts` tries in all, waiting `webhook_backoff_s`, then twice
        that, and so on; any other HTTP answer fails at once.

        Raises:
            HandoffDeliveryFailed: No 2xx answer after `webhook_attempts` tries, or a
                4xx answer that retrying cannot change.
        """
        try:
            webhook_url = self.target()
        except HandoffError as e:
            raise HandoffDeliveryFailed(f"{e}; the record is at {uri}", uri=uri, status=None) from e
        if webhook_url is None:
            return HandoffReceipt(uri=uri, webhook="disabled")
        shown = endpoint_only(webhook_url)  # a webhook's path is often its secret
        body = json.dumps({**event.model_dump(mode="json"), "record_uri": uri}).encode()
        attempts = 0

        def post() -> HandoffReceipt:
            nonlocal attempts
            attempts += 1
            request = urllib.request.Request(
                webhook_url,
                data=body,
                method="POST",
                headers={"Content-Type": "application/json", EVENT_ID_HEADER: event.event_id},
            )
            try:
                with urllib.request.urlopen(request, timeout=self.webhook_timeout_s) as response:
                    return HandoffReceipt(uri=uri, webhook="delivered", status=response.status, attempts=attempts)
            except urllib.error.HTTPError as e:
                answer = f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
                if e.code not in _RETRY_STATUSES:
                    raise _WebhookRefused(answer, e.code) from e
                raise _WebhookUnavailable(answer, e.code) from e
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                raise _WebhookUnavailable(f"{type(e).__name__}: {getattr(e, 'reason', e)}", None) from e

        def log_retry(attempt: int, error: BaseException, wait: float) -> None:
            logger.warning(
                "handoff webhook %s failed for event %s (attempt %d of %d), retrying in %.1fs: %s",
                shown, event.event_id, attempt, self.webhook_attempts, wait, error,
            )

        try:
            return retry_call(
                post, retry_on=_WebhookUnavailable, attempts=self.webhook_attempts, backoff_s=self.webhook_backoff_s,
                max_backoff_s=math.inf, sleep=self._sleep, on_retry=log_retry, describe=f"handoff webhook {shown}",
            )
        except RetriesExhausted as e:
            failure = e.last
        except _WebhookRefused as e:
            failure = e
        assert isinstance(failure, _WebhookRefused)
        raise HandoffDeliveryFailed(
            f"webhook {shown} did not accept handoff event {event.event_id} "
            f"({event.model} v{event.version}) after {attempts} attempt(s): {failure}; "
            f"the record is at {uri}",
            uri=uri,
            status=failure.status,
        ) from failure

    def read(self, uri: str) -> HandoffEvent:
        """Reads one record back.

        Raises:
            HandoffError: The record is missing or not a valid event.
        """
        try:
            return HandoffEvent.model_validate(self.store.read_json(uri))
        except (StorageError, ValidationError) as e:
            raise HandoffError(f"could not read handoff event at {uri}: {e}") from e

    def list_events(self, model: str) -> list[str]:
        """URIs of a model's records, oldest first."""
        return sorted(self.store.glob(f"{naming.handoff_dir(self.store, model)}/*.json"))
