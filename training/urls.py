"""Credentials in URLs: never in a spec file, never shown.

At the bottom of the layers (imported by `training.spec`, which re-exports these), so
that the pod side redacts with the same rules as the orchestrator (`trainyard.redact`
builds on these). Standard library only.
"""

from __future__ import annotations

import re

# The password of `scheme://user:password@host`: up to the last `@` of the authority (SQLAlchemy
# allows a `/` in it; an unencoded `@` is kept inside it too).
_URL_PASSWORD = re.compile(r"(?P<head>://(?P<user>[^/?#:@\s]*):)[^@\s]*(?:@[^@\s/?#]*)*@")
# Query parameters (and libpq `key=value` settings) that carry a secret.
SECRET_PARAMS = ("password", "passwd", "pwd", "sslpassword", "secret", "token", "access_token", "api_key", "apikey",
                 "aws_secret_access_key", "aws_session_token", "x-amz-signature", "x-amz-security-token")
_SECRET_PARAM = re.compile(
    r"(?P<head>(?<![\w-])(?:" + "|".join(map(re.escape, SECRET_PARAMS)) + r")=)[^&;#\s'\"]+", re.IGNORECASE
)


def redact_url(url: str) -> str:
    """`url` with its password and secret query parameters replaced by `***` (user, host, path and the rest kept).

    Works on any text: every URL in it is redacted.

    Example:
        >>> redact_url("postgresql+psycopg2://optuna:s3cret@db:5432/optuna?sslmode=require&password=x")
        'postgresql+psycopg2://optuna:***@db:5432/optuna?sslmode=require&password=***'
    """
    return _SECRET_PARAM.sub(r"\g<head>***", _URL_PASSWORD.sub(r"\g<head>***@", url))


def strip_url_credentials(url: str) -> str:
    """`url` without its password and secret query parameters: what may be written down and shown.

    Example:
        >>> strip_url_credentials("postgresql://optuna:s3cret@db/optuna?password=x&sslmode=require")
        'postgresql://optuna@db/optuna?sslmode=require'
    """
    stripped = _URL_PASSWORD.sub(lambda m: f"://{m.group('user')}@" if m.group("user") else "://", url)
    base, q, rest = stripped.partition("?")
    query, hash_, fragment = rest.partition("#")
    params = [p for p in re.split(r"[&;]", query) if p]
    kept = [p for p in params if p.split("=", 1)[0].lower() not in SECRET_PARAMS]
    if not q or kept == params:
        return stripped
    return base + ("?" + "&".join(kept) if kept else "") + hash_ + fragment


def url_has_credentials(url: str) -> bool:
    """Whether `url` carries a password or a secret query parameter."""
    return strip_url_credentials(url) != url


def same_database(a: str, b: str) -> bool:
    """Whether URLs `a` and `b` name the same database: same dialect, host, port and path (user, driver, credentials and
    query aside).

    A team's Secret may hold its own database user for the orchestrator's database.
    """

    def where(url: str) -> str:
        scheme, sep, rest = strip_url_credentials(url).partition("://")
        rest = re.sub(r"^[^/?#@]*@", "", rest)
        return f"{scheme.split('+')[0]}{sep}{re.split(r'[?#]', rest)[0]}"

    return where(a) == where(b)
