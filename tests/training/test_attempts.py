"""Which attempt of a trial may use a warm server's shared W&B service
(`training.attempts.private_wandb_unless_first`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.attempts import SHARED_WANDB_MARKER, private_wandb_unless_first
from training.spec import ATTEMPTS_DIR

TOKEN = "3-123-unix-/tmp/wandb-123/socket"


@pytest.fixture()
def service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SERVICE", TOKEN)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)


def test_only_an_offline_trials_first_attempt_keeps_the_shared_service(
    service: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    assert private_wandb_unless_first(str(tmp_path), "offline") is True
    assert os.environ["WANDB_SERVICE"] == TOKEN and (tmp_path / ATTEMPTS_DIR / SHARED_WANDB_MARKER).exists()
    # the next attempt of the same trial (a Dagster retry, a resumed run) finds the marker: a service of its own
    assert private_wandb_unless_first(str(tmp_path), "offline") is False
    assert "WANDB_SERVICE" not in os.environ


def test_a_restarted_rank_and_an_online_run_start_their_own_service(
    service: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert private_wandb_unless_first(str(tmp_path / "a"), "offline") is False and "WANDB_SERVICE" not in os.environ
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("WANDB_SERVICE", TOKEN)
    assert private_wandb_unless_first(str(tmp_path / "b"), "online") is False and "WANDB_SERVICE" not in os.environ
    assert not (tmp_path / "b" / ATTEMPTS_DIR / SHARED_WANDB_MARKER).exists()


def test_without_a_shared_service_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    assert private_wandb_unless_first(str(tmp_path), "offline") is False
    assert not (tmp_path / ATTEMPTS_DIR).exists()
