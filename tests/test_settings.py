"""One settings object for every `TRAINYARD_*` variable (`common.settings`), and one table of them
(docs/configuration.md).

tests/test_settings_reads.py holds that no production module reads a variable anywhere else.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

import common.settings
from common.settings import NAMES, Settings, SettingsError, markdown_table, settings

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
def _documented() -> str:
    text = DOC.read_text()
    match = re.search(r"^\| Variable \|.*?(?=^(?!\|)|\Z)", text, flags=re.S | re.M)
    assert match, f"{DOC} has no table starting with '| Variable |'"
    return match.group(0)


def test_every_variable_is_in_the_documentation_table_and_the_table_names_no_other() -> None:
    documented = re.findall(r"^\| `(TRAINYARD_[A-Z0-9_]+)` \|", _documented(), flags=re.M)
    assert sorted(set(NAMES) - set(documented)) == [], "declared in common/settings.py but not in docs/configuration.md"
    assert sorted(set(documented) - set(NAMES)) == [], "in docs/configuration.md but not declared in common/settings.py"
    assert len(documented) == len(set(documented)) == len(Settings.model_fields)


def test_the_documentation_table_is_the_models_own() -> None:
    """Type, default, meaning and reader as declared: regenerate with `python -m common.settings`."""
    assert _documented() == markdown_table(), (
        "docs/configuration.md's table differs: paste `python -m common.settings` over it"
    )


def test_the_environment_is_read_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINYARD_WARM_WORKERS", raising=False)
    assert settings().warm_workers is True
    monkeypatch.setenv("TRAINYARD_WARM_WORKERS", "off")
    assert settings().warm_workers is False
    monkeypatch.setenv("TRAINYARD_DEVICE_MEMORY_GB", "24")
    assert settings().device_memory_gb == 24.0
    assert settings({}).device_memory_gb is None  # a given mapping, not this process's environment


def test_one_set_of_values_is_validated_once() -> None:
    """The hot paths (the warm fork, a worker's start) pay dictionary look-ups, not a validation: the same object comes
    back."""
    env = {"TRAINYARD_LAUNCH_ID": "job-a", "TRAINYARD_K8S_SECRETS": "aws"}
    assert settings(env) is settings(dict(env))
    assert settings({**env, "TRAINYARD_LAUNCH_ID": "job-b"}).launch_id == "job-b"


@pytest.mark.parametrize(("name", "value", "message"), [
    ("TRAINYARD_WARM_WORKERS", "maybe", "TRAINYARD_WARM_WORKERS='maybe': expected one of"),
    ("TRAINYARD_ENV", "staging", "TRAINYARD_ENV='staging' is not an environment; use one of ['local', 'cluster']"),
    ("TRAINYARD_DEVICE_MEMORY_GB", "lots", "TRAINYARD_DEVICE_MEMORY_GB='lots' is not a number of GiB"),
    ("TRAINYARD_DEVICE_MEMORY_GB", "0", "TRAINYARD_DEVICE_MEMORY_GB='0' must be > 0 GiB"),
    ("TRAINYARD_K8S_STUCK_SECONDS", "5m", "TRAINYARD_K8S_STUCK_SECONDS='5m' is not a number of seconds"),
    ("TRAINYARD_K8S_GPUS_PER_POD", "-1", "TRAINYARD_K8S_GPUS_PER_POD='-1' is not a number of GPUs"),
    ("TRAINYARD_K8S_GANG_KIND", "deployment", "TRAINYARD_K8S_GANG_KIND='deployment' is not a gang kind"),
    ("TRAINYARD_TRACKING_MODE", "loud", "TRAINYARD_TRACKING_MODE='loud' is not a W&B tracking mode"),
    ("TRAINYARD_FEAST_OFFLINE_STORE", "duckdb", "TRAINYARD_FEAST_OFFLINE_STORE='duckdb' is not JSON"),
    ("TRAINYARD_FEAST_OFFLINE_STORE", "[1]", "TRAINYARD_FEAST_OFFLINE_STORE='[1]' must be a JSON object with a 'type'"),
    ("TRAINYARD_STORE_LISTEN_FD", "x", "TRAINYARD_STORE_LISTEN_FD='x' is not a file descriptor number"),
])
def test_a_bad_value_is_refused_naming_the_variable_and_the_value(name: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        settings({name: value})


def test_every_bad_variable_is_named_at_once() -> None:
    with pytest.raises(SettingsError) as info:
        settings({"TRAINYARD_ENV": "prod", "TRAINYARD_K8S_STUCK_SECONDS": "soon"})
    assert "TRAINYARD_ENV='prod'" in str(info.value) and "TRAINYARD_K8S_STUCK_SECONDS='soon'" in str(info.value)


def test_values_parse_as_the_readers_did() -> None:
    s = settings(
        {
            "TRAINYARD_K8S_SECRETS": " aws, wandb ,,",
            "TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS": "0",
            "TRAINYARD_CODE_VERSION": " abc123-dirty \n",
            "TRAINYARD_FEAST_OFFLINE_STORE": '{"type": "duckdb"}',
            "TRAINYARD_WARM_RUN_WORKERS": "0",
            "TRAINYARD_WARM_WANDB_SERVICE": "1",
            "TRAINYARD_STORE_LISTEN_FD": "7",
            "TRAINYARD_HOME": "/srv/ty",
            "TRAINYARD_LAUNCH_ID": "",
        }
    )
    assert s.k8s_secrets == ("aws", "wandb") and s.k8s_active_deadline_seconds == 0  # 0: no deadline, not unset
    assert s.code_version == "abc123-dirty" and s.feast_offline_store == {"type": "duckdb"}
    assert (s.warm_run_workers, s.warm_wandb_service, s.store_listen_fd) == (False, True, 7)
    assert str(s.home) == "/srv/ty" and s.launch_id == ""  # an empty launch id is kept as given
    empty = settings({name: "" for name in NAMES if name not in ("TRAINYARD_K8S_QUEUE", "TRAINYARD_LAUNCH_ID")})
    assert empty == settings({}), "an empty variable counts as unset"


def test_the_k8s_queue_tells_unset_from_empty() -> None:
    """Unset: the launcher's default queue; empty: no Kueue at all."""
    from resources.k8s.config import K8sJobConfig

    assert settings({}).k8s_queue == K8sJobConfig.model_fields["queue_name"].default == "trainyard"
    assert settings({"TRAINYARD_K8S_QUEUE": ""}).k8s_queue is None
    assert settings({"TRAINYARD_K8S_QUEUE": "gpu"}).k8s_queue == "gpu"


def test_pydantic_settings_reads_the_same_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Settings()` (pydantic-settings' own environment source) and `settings()` agree on every variable's name."""
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINYARD_K8S_SECRETS", "a,b")
    monkeypatch.setenv("TRAINYARD_ENV", "cluster")
    monkeypatch.setenv("trainyard_home", "/not/this")  # names are case-sensitive, as the environment is
    assert Settings() == settings()
    assert (Settings().k8s_secrets, Settings().env, Settings().home) == (("a", "b"), "cluster", None)


def test_the_settings_module_examples_hold() -> None:
    assert doctest.testmod(common.settings).failed == 0
