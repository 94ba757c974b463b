"""HandoffPublisher's webhook delivery: which answers are retried, and the backoff, through an injected sleep."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from resources.handoff import HandoffDeliveryFailed, HandoffEvent, HandoffPublisher
from resources.storage import ObjectStore
from tests.support.webhook import WebhookServer
from trainyard.redact import endpoint_only


def event() -> HandoffEvent:
    return HandoffEvent(
        event_id="ev-1", model="vision.digits", version="3", alias_uri="models:/vision.digits@champion",
        model_uri="models:/vision.digits/3", artifact_uri="s3://ml/3", action="promote", reason="beats champion",
        decided_by="test", at="2025-01-30T07:01:02.123456+00:00",
    )


def publisher(tmp_path: Path, url: str, waits: list[float], **kwargs: object) -> HandoffPublisher:
    handoff = HandoffPublisher(store=ObjectStore(root=str(tmp_path)), webhook_url=url, webhook_timeout_s=2, **kwargs)
    handoff._sleep = waits.append
    return handoff


def test_transient_answers_are_retried_with_doubling_waits(
    tmp_path: Path, webhook: WebhookServer, caplog: pytest.LogCaptureFixture
) -> None:
    waits: list[float] = []
    webhook.statuses = [503, 429]
    with caplog.at_level(logging.WARNING):
        receipt = publisher(tmp_path, webhook.url, waits, webhook_attempts=3, webhook_backoff_s=0.5).publish(event())
    assert (receipt.webhook, receipt.status, receipt.attempts) == ("delivered", 200, 3)
    assert waits == [0.5, 1.0]
    assert webhook.event_ids == ["ev-1"] * 3  # the same event id each time, so consumers deduplicate
    assert (
        f"handoff webhook {endpoint_only(webhook.url)} failed for event ev-1 (attempt 1 of 3), retrying in 0.5s: HTTP "
        "503: busy"
        in caplog.text
    )


def test_gives_up_after_the_attempts_with_the_last_answer(tmp_path: Path, webhook: WebhookServer) -> None:
    waits: list[float] = []
    webhook.statuses = [500, 502, 504]
    handoff = publisher(tmp_path, webhook.url, waits, webhook_attempts=2, webhook_backoff_s=0.25)
    with pytest.raises(
        HandoffDeliveryFailed, match=r"after 2 attempt\(s\): HTTP 502: busy; the record is at "
    ) as caught:
        handoff.publish(event())
    assert caught.value.status == 502
    assert waits == [0.25]
    assert Path(caught.value.uri).is_file()


def test_a_refusal_is_not_retried(tmp_path: Path, webhook: WebhookServer) -> None:
    waits: list[float] = []
    webhook.statuses = [404]
    with pytest.raises(HandoffDeliveryFailed, match=r"after 1 attempt\(s\): HTTP 404: refused") as caught:
        publisher(tmp_path, webhook.url, waits, webhook_attempts=5).publish(event())
    assert (caught.value.status, waits, webhook.event_ids) == (404, [], ["ev-1"])


def test_an_unreachable_webhook_is_retried_without_a_status(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    waits: list[float] = []
    handoff = publisher(tmp_path, f"http://127.0.0.1:{port}/x", waits, webhook_attempts=3, webhook_backoff_s=1.0)
    with pytest.raises(HandoffDeliveryFailed, match=r"after 3 attempt\(s\): URLError: ") as caught:
        handoff.publish(event())
    assert caught.value.status is None
    assert waits == [1.0, 2.0]


def test_a_webhook_by_reference_is_read_at_delivery_and_its_path_never_shown(
    tmp_path: Path, webhook: WebhookServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The URL's path is the webhook's secret (as Slack's are): config names the variable, messages show the endpoint
    only."""
    secret_url = webhook.url.rstrip("/") + "/services/T0/B0/hook-s3cret-token"
    handoff = HandoffPublisher(
        store=ObjectStore(root=str(tmp_path)),
        webhook_url_env="TEST_HANDOFF_WEBHOOK",
        webhook_attempts=2,
        webhook_backoff_s=0,
    )
    assert "hook-s3cret-token" not in repr(handoff) and handoff.webhook_url is None

    with pytest.raises(HandoffDeliveryFailed, match=r"variable TEST_HANDOFF_WEBHOOK is not set; the record is at "):
        handoff.publish(event())

    monkeypatch.setenv("TEST_HANDOFF_WEBHOOK", secret_url)
    webhook.statuses = [503, 503]
    with caplog.at_level(logging.WARNING), pytest.raises(HandoffDeliveryFailed) as caught:
        handoff.publish(event())
    assert webhook.event_ids == ["ev-1", "ev-1"]  # it was POSTed to the variable's URL
    assert "hook-s3cret-token" not in str(caught.value) and "hook-s3cret-token" not in caplog.text
    assert f"webhook {endpoint_only(secret_url)} did not accept" in str(caught.value)

    webhook.statuses = []
    assert handoff.publish(event()).webhook == "delivered"
