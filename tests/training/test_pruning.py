"""Pruning: pruner settings, rank-0 reports and decisions, and a pruned run under 2-process DDP."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from pydantic import ValidationError

from tests.support.train_specs import make_spec
from training import entrypoint
from training.checkpointing import CheckpointStore
from training.errors import ConfigError
from training.pruning import OptunaPruning, build_pruner, pruning_callback
from training.spec import Distribution, OptunaSpec, PrunerSpec, TrainResult


def study_with_trial(tmp_path: Path, name: str = "s", direction: str = "maximize") -> tuple[str, int]:
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name=name, storage=url, direction=direction, load_if_exists=True)
    return url, study.ask().number


def test_pruner_kinds() -> None:
    kinds = {
        k: type(
            build_pruner(PrunerSpec(kind=k, lower=0.1) if k == "threshold" else PrunerSpec(kind=k), max_epochs=9)
        ).__name__
        for k in ("none", "median", "successive_halving", "hyperband", "threshold")
    }
    assert kinds == {"none": "NopPruner", "median": "MedianPruner", "successive_halving": "SuccessiveHalvingPruner",
                     "hyperband": "HyperbandPruner", "threshold": "ThresholdPruner"}
    with pytest.raises(ConfigError, match="pruner 'hyperband' needs max_resource"):
        build_pruner(PrunerSpec(kind="hyperband"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kind": "threshold"}, "pruner 'threshold' needs lower or upper"),
        ({"kind": "threshold", "lower": 0.5, "upper": 0.5}, "lower 0.5 must be below upper 0.5"),
        ({"kind": "median", "lower": 0.5}, "lower/upper apply to pruner 'threshold' only; this pruner is 'median'"),
        ({"kind": "hyperband", "min_resource": 3, "max_resource": 3}, "max_resource 3 must exceed min_resource 3"),
        ({"kind": "successive_halving", "reduction_factor": 1}, "greater than or equal to 2"),
    ],
)
def test_pruner_settings_are_checked(kwargs, message) -> None:
    with pytest.raises(ValidationError, match=message):
        PrunerSpec(**kwargs)


def test_callback_only_for_an_enabled_pruner(tmp_path: Path) -> None:
    optuna_spec = OptunaSpec(storage_url="sqlite:///x.db", study_name="s", trial_number=0)
    with pytest.raises(ValueError, match="OptunaPruning needs an enabled pruner; optuna.pruner.kind is 'none'"):
        OptunaPruning(optuna_spec, "val_acc")
    assert pruning_callback(make_spec(tmp_path)) is None
    assert pruning_callback(make_spec(tmp_path, optuna=optuna_spec)) is None
    on = optuna_spec.model_copy(update={"pruner": PrunerSpec(kind="median")})
    assert pruning_callback(make_spec(tmp_path, optuna=on)).metric == "val_acc"


def test_median_decision_against_completed_trials(tmp_path: Path) -> None:
    url, _ = study_with_trial(tmp_path)
    study = optuna.load_study(study_name="s", storage=url)
    study.tell(0, state=TrialState.FAIL)
    for curve in ([0.5, 0.6, 0.7], [0.6, 0.7, 0.8], [0.4, 0.5, 0.6]):
        t = study.ask()
        for step, v in enumerate(curve):
            t.report(v, step)
        study.tell(t, curve[-1])
    number = study.ask().number
    spec = OptunaSpec(
        storage_url=url,
        study_name="s",
        trial_number=number,
        pruner=PrunerSpec(kind="median", n_startup_trials=3, n_warmup_steps=1),
    )
    callback = OptunaPruning(spec, "val_acc")
    callback._connect()
    assert callback.decide(0, 0.1) == {"prune": False, "value": 0.1, "error": None}  # warm-up epoch
    assert callback.decide(1, 0.65) == {"prune": False, "value": 0.65, "error": None}  # above the median 0.6 of epoch 1
    assert callback.decide(2, 0.66) == {"prune": True, "value": 0.66, "error": None}  # below the median 0.7 of epoch 2
    assert callback.reported == [(0, 0.1), (1, 0.65), (2, 0.66)]
    trial = optuna.load_study(study_name="s", storage=url).trials[number]
    assert trial.intermediate_values == {0: 0.1, 1: 0.65, 2: 0.66}
    assert (
        callback.decide(2, None)["error"]
        == "metric 'val_acc' was not logged during validation; pruning reports it every epoch"
    )


def test_finished_or_missing_trials_fail_before_training(tmp_path: Path) -> None:
    url, number = study_with_trial(tmp_path)
    optuna.load_study(study_name="s", storage=url).tell(number, 0.5)
    done = OptunaPruning(
        OptunaSpec(storage_url=url, study_name="s", trial_number=number, pruner=PrunerSpec(kind="median")), "val_acc"
    )
    with pytest.raises(ConfigError, match="trial 0 of study 's' is already COMPLETE"):
        done._connect()
    missing = OptunaPruning(
        OptunaSpec(storage_url=url, study_name="nope", trial_number=0, pruner=PrunerSpec(kind="median")), "val_acc"
    )
    with pytest.raises(ConfigError, match="optuna study 'nope' does not exist"):
        missing._connect()


def test_trial_storage_checks_the_schema_with_one_query_and_says_what_is_wrong(tmp_path: Path) -> None:
    """A trial opens its study's storage without Optuna reading its migration scripts each time, yet a database of
    another schema still fails with Optuna's own message (as `RDBStorage(url)` would), and one without Optuna's
    tables gets the missing study's error, as before."""
    import sqlalchemy

    from training.pruners import open_trial_storage, schema_head

    url, number = study_with_trial(tmp_path)
    reference = optuna.storages.RDBStorage(url)
    assert schema_head() == reference.get_head_version() == reference.get_current_version()
    storage = open_trial_storage(url)
    assert storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name("s"), number) is not None

    older, unknown = reference.get_all_versions()[1], "v0.0.0.unknown"
    engine = sqlalchemy.create_engine(url)
    for stamped, advice in ((older, "optuna storage upgrade --storage"), (unknown, "pip install -U optuna")):
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text("UPDATE alembic_version SET version_num = :v"), {"v": stamped})
        with pytest.raises(RuntimeError) as optunas:
            optuna.storages.RDBStorage(url)
        with pytest.raises(ConfigError) as ours:
            open_trial_storage(url)
        assert str(optunas.value) in str(ours.value) and advice in str(ours.value), (
            str(optunas.value),
            str(ours.value),
        )
        assert str(ours.value).startswith(f"sqlite:///{tmp_path / 'optuna.db'}: The runtime optuna version")

    empty = tmp_path / "empty.db"  # no Optuna tables: Optuna's default open makes them, and the study is missing
    sqlalchemy.create_engine(f"sqlite:///{empty}").connect().close()
    missing = OptunaPruning(
        OptunaSpec(storage_url=f"sqlite:///{empty}", study_name="s", trial_number=0, pruner=PrunerSpec(kind="median")),
        "val_acc",
    )
    with pytest.raises(ConfigError, match=r"optuna study 's' does not exist in sqlite:///.*empty.db"):
        missing._connect()


def pruned_run_spec(tmp_path: Path, procs: int):
    url, number = study_with_trial(tmp_path)
    # Deterministic: val_acc of this tiny model stays far below 0.99, so the trial is pruned after the warm-up epoch.
    optuna_spec = OptunaSpec(storage_url=url, study_name="s", trial_number=number,
                             pruner=PrunerSpec(kind="threshold", lower=0.99, n_warmup_steps=1))
    return (
        make_spec(tmp_path, optuna=optuna_spec, max_epochs=5, distribution=Distribution(procs_per_node=procs)),
        url,
        number,
    )


def test_pruned_single_process_run_writes_a_pruned_result(tmp_path: Path) -> None:
    spec, url, number = pruned_run_spec(tmp_path, 1)
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == 0
    result = TrainResult.model_validate_json((tmp_path / "run" / "result.json").read_text())
    assert result.status == "pruned" and result.epochs == 2
    trial = optuna.load_study(study_name="s", storage=url).trials[number]
    assert sorted(trial.intermediate_values) == [0, 1]
    assert trial.state == TrialState.RUNNING  # the orchestrator, reading result.json, ends it as PRUNED


@pytest.mark.slow
def test_ddp_ranks_stop_together_and_keep_the_last_checkpoint(tmp_path: Path) -> None:
    from resources.launcher import LocalLauncher

    spec, url, number = pruned_run_spec(tmp_path, 2)
    outcome = LocalLauncher(timeout_seconds=300).launch(spec)
    result = outcome.result
    assert result.status == "pruned" and result.epochs == 2 and result.world_size == 2
    trial = optuna.load_study(study_name="s", storage=url).trials[number]
    assert sorted(trial.intermediate_values) == [0, 1]  # rank 0 reported each epoch once
    # both ranks left the loop after epoch 1: the run ended (no rank waited in a collective) at the same step,
    # and that step's state is the newest committed checkpoint
    steps_per_epoch = 210 // (32 * 2) + (1 if 210 % (32 * 2) else 0)
    assert result.global_step == 2 * steps_per_epoch
    latest = CheckpointStore(str(tmp_path / "run" / "checkpoints")).latest()
    assert latest.step == result.global_step
    attempts = [json.loads(p.read_text()) for p in (tmp_path / "run" / "attempts").glob("*.json")]
    assert [a["status"] for a in attempts] == ["completed"] and attempts[0]["last_step"] == result.global_step
