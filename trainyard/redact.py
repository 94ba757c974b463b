"""Credentials never shown: URLs and secrets are redacted before they reach a message, a log or metadata.

The URL rules live with the pod's contract (`training.spec`), so the pod side
redacts the same way; this module adds free text: the values of the secret
environment variables the platform reads (the W&B key, AWS keys, MLflow and
PostgreSQL passwords, the passwords inside the configured URLs) are replaced
wherever they appear.

Example:
    >>> redact_url("postgresql+psycopg2://optuna:s3cret@db:5432/optuna?sslmode=require")
    'postgresql+psycopg2://optuna:***@db:5432/optuna?sslmode=require'
    >>> redact_text("key wk-123456 in postgresql://u:pw@db/x", {"WANDB_API_KEY": "wk-123456"})
    'key *** in postgresql://u:***@db/x'
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Optional

from training.spec import redact_url, strip_url_credentials, url_has_credentials

__all__ = [
    "SECRET_ENV_VARS",
    "URL_ENV_VARS",
    "endpoint_only",
    "redact_text",
    "redact_url",
    "secret_values",
    "strip_url_credentials",
    "url_has_credentials",
]

SECRET_ENV_VARS = (
    "WANDB_API_KEY",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "PGPASSWORD",
)
"""Environment variables whose whole value is a secret."""

URL_ENV_VARS = ("TRAINYARD_OPTUNA_URL", "MLFLOW_TRACKING_URI", "TRAINYARD_HANDOFF_WEBHOOK", "AWS_ENDPOINT_URL")
"""Environment variables holding a URL that may carry a password (its password is the secret)."""

_MIN_SECRET = 4  # shorter values would blank out ordinary text; such a secret is no secret anyway
_PASSWORD_OF = re.compile(r"://[^/?#:@\s]*:(?P<pw>[^@\s]*(?:@[^@\s/?#]*)*)@")


def secret_values(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The secrets in `environ` (default `os.environ`): whole secret variables and the passwords of URL variables,
    longest first."""
    env = os.environ if environ is None else environ
    found = {env[name] for name in SECRET_ENV_VARS if env.get(name)}
    for name in URL_ENV_VARS:
        m = _PASSWORD_OF.search(env.get(name) or "")
        if m is not None and m.group("pw"):
            found.add(m.group("pw"))
    return sorted((s for s in found if len(s) >= _MIN_SECRET), key=len, reverse=True)


def redact_text(text: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """`text` with every URL redacted (`redact_url`) and every secret of `environ` (default `os.environ`) replaced by
    `***`."""
    for secret in secret_values(environ):
        text = text.replace(secret, "***")
    return redact_url(text)


def endpoint_only(url: str) -> str:
    """`scheme://host[:port]` of `url`, with `/…` for a path or query left out.

    For URLs whose path is the secret (a webhook's `https://hooks.example.com/services/T0/B0/XXXX`):
    `redact_url` keeps paths, this shows only where the URL points.

    Example:
        >>> endpoint_only("https://hooks.example.com/services/T0/B0/s3cret?x=1")
        'https://hooks.example.com/…'
        >>> endpoint_only("http://user:pw@127.0.0.1:8080")
        'http://127.0.0.1:8080'
    """
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    hidden = "/…" if (parts.path.strip("/") or parts.query or parts.fragment) else ""
    return f"{parts.scheme}://{host}{hidden}" if parts.scheme else "…"
