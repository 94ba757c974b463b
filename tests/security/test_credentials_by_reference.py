"""Credentials by reference: the spec names the variable, the pod reads it, the launcher hands it over.

The real-process test launches a LightGBM trial through the local launcher
against a PostgreSQL study whose URL carries a password known only to the
`SweepStore` resource (not to this process's environment): the trial reports
to its study, and its spec file holds no password.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import optuna
import pytest
from pydantic import ValidationError

from pipelines.environments import EnvironmentError_, cluster_resources, local_resources
from resources.launcher import LocalLauncher, TrainingConfigError, pod_environment
from resources.sweeps import SweepError, SweepStore
from tests.support import gbt
from tests.support.canary import postgres_database
from training.spec import OPTUNA_URL_ENV, OptunaSpec, PrunerSpec
from trainyard.search import FloatParam, SearchSpec

PASSWORD = f"CANARY-PW-{uuid.uuid4().hex[:8]}"
URL = f"postgresql+psycopg2://optuna:{PASSWORD}@db.example:5432/optuna?sslmode=require"
BARE = "postgresql+psycopg2://optuna@db.example:5432/optuna?sslmode=require"


def test_a_spec_never_holds_a_credential() -> None:
    for url in (URL, "postgresql://db.example/optuna?password=" + PASSWORD):
        with pytest.raises(ValidationError, match="carries a credential, and a spec file never holds one") as info:
            OptunaSpec(storage_url=url, study_name="s", trial_number=0)
        assert PASSWORD not in str(info.value)
    spec = OptunaSpec.by_reference(URL, study_name="s", trial_number=0)
    assert (spec.storage_url, spec.storage_url_env) == (BARE, OPTUNA_URL_ENV)
    assert PASSWORD not in spec.model_dump_json()
    local = OptunaSpec.by_reference("sqlite:////tmp/optuna.db", study_name="s", trial_number=0)
    assert (local.storage_url, local.storage_url_env) == ("sqlite:////tmp/optuna.db", None)


def test_the_pod_reads_the_url_from_the_variable_the_spec_names() -> None:
    spec = OptunaSpec.by_reference(URL, study_name="s", trial_number=0)
    assert spec.connect_url({OPTUNA_URL_ENV: URL}) == URL
    team_user = (
        "postgresql://vision:team-pw@db.example:5432/optuna"  # a team's Secret may hold its own user of that database
    )
    assert spec.connect_url({OPTUNA_URL_ENV: team_user}) == team_user
    with pytest.raises(
        ValueError,
        match=f"needs its credentials from the environment variable {OPTUNA_URL_ENV}, which this process does not have",
    ):
        spec.connect_url({})
    other = f"postgresql+psycopg2://optuna:{PASSWORD}@other.example:5432/optuna"
    with pytest.raises(ValueError, match="points to postgresql\\+psycopg2://optuna:\\*\\*\\*@other.example") as info:
        spec.connect_url({OPTUNA_URL_ENV: other})
    assert PASSWORD not in str(info.value)
    local = OptunaSpec.by_reference("sqlite:////tmp/optuna.db", study_name="s", trial_number=0)
    assert local.connect_url({OPTUNA_URL_ENV: URL}) == "sqlite:////tmp/optuna.db"  # a local study ignores the variable


def test_the_sweep_store_is_configured_by_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    store = SweepStore.by_reference(URL)
    assert (store.storage_url, store.storage_url_env) == (BARE, OPTUNA_URL_ENV)
    monkeypatch.delenv(OPTUNA_URL_ENV, raising=False)
    with pytest.raises(SweepError, match=f"takes its credentials from the environment variable {OPTUNA_URL_ENV}"):
        store.connect_url()
    monkeypatch.setenv(OPTUNA_URL_ENV, URL)
    assert store.connect_url() == URL
    assert store.pod_environment() == {OPTUNA_URL_ENV: URL}
    assert store.shown_url() == "postgresql+psycopg2://optuna@db.example:5432/optuna"
    assert SweepStore(storage_url="sqlite:////tmp/o.db").pod_environment() == {}


def test_environments_keep_credentials_out_of_resource_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(OPTUNA_URL_ENV, URL)
    sweeps = local_resources(tmp_path)["sweeps"]
    assert (sweeps.storage_url, sweeps.storage_url_env) == (BARE, OPTUNA_URL_ENV)
    env = {
        "TRAINYARD_S3_ROOT": "s3://bucket/trainyard", OPTUNA_URL_ENV: URL, "TRAINYARD_HOME": str(tmp_path),
        "TRAINYARD_K8S_NAMESPACE": "team-vision", "TRAINYARD_TRAINER_IMAGE": "registry.example/trainer:1",
        "MLFLOW_TRACKING_URI": f"https://mlflow:{PASSWORD}@mlflow.example",
    }
    with pytest.raises(
        EnvironmentError_, match="MLFLOW_TRACKING_URI=https://mlflow:\\*\\*\\*@mlflow.example carries a password"
    ) as info:
        cluster_resources(env)
    assert PASSWORD not in str(info.value)
    res = cluster_resources({**env, "MLFLOW_TRACKING_URI": "https://mlflow.example"})
    assert (res["sweeps"].storage_url, res["sweeps"].storage_url_env) == (BARE, OPTUNA_URL_ENV)


@pytest.mark.slow  # two torchrun launches
def test_a_local_trial_gets_the_resource_s_credentials_from_the_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(OPTUNA_URL_ENV, raising=False)
    with postgres_database(PASSWORD) as url:
        sweeps = SweepStore(storage_url=url)  # configured on the resource only: this process's environment has no URL
        study = sweeps.load_or_create(
            "canary.gbt", "max", SearchSpec(params={"lr": FloatParam(low=0.01, high=0.1)}, n_trials=2)
        )
        numbers = [study.ask().number for _ in range(2)]
        specs = [
            gbt.make_spec(
                tmp_path,
                out=f"run-{n}",
                max_epochs=30,
                trial_id=f"trial-{n:04d}",
                optuna=OptunaSpec.by_reference(
                    url, study_name="canary.gbt", trial_number=n, pruner=PrunerSpec(kind="median")
                ),
            )
            for n in numbers
        ]
        launcher = LocalLauncher(timeout_seconds=600)
        with pod_environment(sweeps.pod_environment()):
            outcome = launcher.launch(specs[0])
        assert outcome.result.status == "completed"
        reported = optuna.load_study(study_name="canary.gbt", storage=url).trials[numbers[0]].intermediate_values
        assert reported and all(
            step % 10 == 0 for step in reported
        )  # the pod reported to the study behind the password
        written = (tmp_path / "run-0" / "spec.json").read_text()
        assert PASSWORD not in written and OPTUNA_URL_ENV in written

        with pytest.raises(
            TrainingConfigError, match=f"needs its credentials from the environment variable {OPTUNA_URL_ENV}"
        ) as info:
            launcher.launch(specs[1])  # no credentials handed over: the pod says which variable it misses
        assert PASSWORD not in str(info.value) and PASSWORD not in info.value.log_tail
