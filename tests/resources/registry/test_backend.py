"""The registry's retry decorator: backoff through the injected sleep, outermost call only, a clear final error."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import pytest

from resources.registry.backend import check_model_name, check_trial_key, retried, to_uri
from resources.registry.errors import RegistryError, RegistryUnavailable


@dataclass
class FakeRegistry:
    tracking_uri: str = "http://user:secret@mlflow:5000"
    retry_attempts: int = 3
    retry_backoff_s: float = 0.5
    waits: list[float] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    failures: int = 0
    lookups: int = 0

    @property
    def _sleep(self) -> Callable[[float], None]:
        return self.waits.append

    @retried
    def lookup(self, name: str) -> str:
        self.calls.append(name)
        self.lookups += 1
        if self.lookups <= self.failures:
            raise RegistryUnavailable(f"down ({self.lookups})")
        return f"found {name}"

    @retried
    def outer(self) -> str:
        self.calls.append("outer")
        return self.lookup("inner")

    @retried
    def broken(self) -> None:
        self.calls.append("broken")
        raise RegistryError("terminal")


def test_retries_with_doubling_waits_then_succeeds(caplog: pytest.LogCaptureFixture) -> None:
    registry = FakeRegistry(failures=2)
    with caplog.at_level(logging.WARNING):
        assert registry.lookup("m") == "found m"
    assert registry.waits == [0.5, 1.0]
    assert registry.calls == ["m", "m", "m"]
    assert (
        "registry http://user:***@mlflow:5000 unavailable during lookup (attempt 1 of 3), retrying in 0.5s: down (1)"
        in caplog.text
    )
    assert "secret" not in caplog.text


def test_gives_up_after_the_attempts_naming_registry_and_count() -> None:
    registry = FakeRegistry(failures=99, retry_attempts=4, retry_backoff_s=2.0)
    with pytest.raises(
        RegistryUnavailable,
        match=r"^registry http://user:\*\*\*@mlflow:5000 unavailable; gave up after 4 attempt\(s\): down \(4\)$",
    ) as caught:
        registry.lookup("m")
    assert registry.waits == [2.0, 4.0, 8.0]
    assert isinstance(caught.value.__cause__, RegistryUnavailable)


def test_nested_calls_retry_at_the_outermost_level_only() -> None:
    registry = FakeRegistry(failures=1)  # the first (inner) lookup fails once
    assert registry.outer() == "found inner"
    assert registry.calls == ["outer", "inner", "outer", "inner"]
    assert registry.waits == [0.5]


def test_terminal_errors_are_not_retried() -> None:
    registry = FakeRegistry()
    with pytest.raises(RegistryError, match="terminal"):
        registry.broken()
    assert (registry.calls, registry.waits) == (["broken"], [])


def test_name_rules_and_uris() -> None:
    with pytest.raises(ValueError, match="model_name='a/b' is not a valid registered model name"):
        check_model_name("a/b")
    with pytest.raises(ValueError, match="trial_key='x y' is not valid"):
        check_trial_key("x y")
    check_model_name("vision.digits-2")
    check_trial_key("vision/digits/ab12/trial-0003")
    assert to_uri("s3://bucket/prefix/") == "s3://bucket/prefix"
    assert to_uri("/var/trainyard/art") == "file:///var/trainyard/art"


def test_a_language_model_with_a_tokenizer_is_served_with_tokenizers_pinned() -> None:
    from importlib.metadata import version

    from resources.registry.registration import serving_requirements

    lm = serving_requirements({"task": "causal_lm", "tokenizer": "tokenizer.json"})
    assert f"tokenizers=={version('tokenizers')}" in lm and any(r.startswith("torch==") for r in lm)
    assert not any(r.startswith("tokenizers") for r in serving_requirements({"task": "classification"}))
