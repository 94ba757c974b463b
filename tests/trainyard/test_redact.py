"""Redaction: passwords in URLs, secret query parameters and the values of secret variables never shown."""

from __future__ import annotations

import pytest

from trainyard.redact import redact_text, redact_url, secret_values, strip_url_credentials, url_has_credentials


@pytest.mark.parametrize(
    ("url", "redacted", "stripped"),
    [
        (
            "postgresql+psycopg2://optuna:s3cret@db:5432/optuna?sslmode=require",
            "postgresql+psycopg2://optuna:***@db:5432/optuna?sslmode=require",
            "postgresql+psycopg2://optuna@db:5432/optuna?sslmode=require",
        ),
        (
            "postgresql://u:pa/ss@h/db",
            "postgresql://u:***@h/db",
            "postgresql://u@h/db",
        ),  # SQLAlchemy allows '/' in a password
        ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db", "postgresql://u@h/db"),  # an unencoded '@' too
        ("postgresql://:pw@h/db", "postgresql://:***@h/db", "postgresql://h/db"),
        (
            "postgresql://h/db?password=pw&sslmode=require",
            "postgresql://h/db?password=***&sslmode=require",
            "postgresql://h/db?sslmode=require",
        ),
        ("https://h/x?a=1&token=tk#top", "https://h/x?a=1&token=***#top", "https://h/x?a=1#top"),
        (
            "s3://bucket/x?X-Amz-Signature=abc&X-Amz-Date=1",
            "s3://bucket/x?X-Amz-Signature=***&X-Amz-Date=1",
            "s3://bucket/x?X-Amz-Date=1",
        ),
        ("postgresql://u@h/db", "postgresql://u@h/db", "postgresql://u@h/db"),
        ("http://host:8080/path", "http://host:8080/path", "http://host:8080/path"),
        ("sqlite:////tmp/optuna.db", "sqlite:////tmp/optuna.db", "sqlite:////tmp/optuna.db"),
    ],
)
def test_urls(url: str, redacted: str, stripped: str) -> None:
    assert redact_url(url) == redacted
    assert strip_url_credentials(url) == stripped
    assert url_has_credentials(url) == (stripped != url)


def test_text_with_urls_and_libpq_settings() -> None:
    text = (
        "failed: postgresql://u:pw1@h/db and mlflow at https://a:pw2@m.example/ (host=h password=pw3 user=u); mail "
        "me@x.org"
    )
    assert (
        redact_url(text)
        == "failed: postgresql://u:***@h/db and mlflow at https://a:***@m.example/ (host=h password=*** user=u); mail "
           "me@x.org"
    )


def test_secret_values_of_the_environment_are_redacted_anywhere() -> None:
    env = {
        "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567",
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG",
        "MLFLOW_TRACKING_PASSWORD": "ml-pass",
        "TRAINYARD_OPTUNA_URL": "postgresql://u:opt-pw@h/db",
        "PGPASSWORD": "pw",  # too short to look for in text: it would blank out ordinary words
        "HOME": "/home/someone",
    }
    assert secret_values(env) == [
        "0123456789abcdef0123456789abcdef01234567",
        "wJalrXUtnFEMI/K7MDENG",
        "ml-pass",
        "opt-pw",
    ]
    text = (
        "key=0123456789abcdef0123456789abcdef01234567 secret wJalrXUtnFEMI/K7MDENG, ml-pass; opt-pw in /home/someone pw"
    )
    assert redact_text(text, env) == "key=*** secret ***, ***; *** in /home/someone pw"
    assert redact_text("nothing here", {}) == "nothing here"


def test_team_code_cannot_hold_a_credential_and_the_error_does_not_repeat_it() -> None:
    import pydantic

    from trainyard import TeamSpec

    for env in (
        {"TRAINYARD_OPTUNA_URL": "postgresql://optuna:pw-canary-1@db:5432/optuna"},
        {"WANDB_API_KEY": "wk-canary-22"},
    ):
        with pytest.raises(pydantic.ValidationError, match="holds a credential") as caught:
            TeamSpec(name="t", env=env)
        assert "canary" not in str(caught.value)
    assert TeamSpec(name="t", env={"TRAINYARD_OPTUNA_URL": "postgresql://optuna@db:5432/optuna"}).env


def test_endpoint_only_hides_a_webhook_path() -> None:
    from trainyard.redact import endpoint_only

    assert endpoint_only("https://hooks.example.com/services/T0/B0/s3cret") == "https://hooks.example.com/…"
    assert endpoint_only("http://u:pw@127.0.0.1:8080/") == "http://127.0.0.1:8080"
