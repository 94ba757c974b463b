"""LightGBM trials (`task="gbt"`) through the entrypoint in one process: objectives, checkpoint resume, pruning,
serving."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from tests.support.gbt import FAST, make_spec, result, run
from tests.support.k8s import k8s_validate
from training import gbt
from training.spec import (
    EXIT_BAD_CONFIG,
    EXIT_PREEMPTED,
    EXIT_USER_ERROR,
    CheckpointPolicy,
    FaultInjection,
    ImportTarget,
    OptunaSpec,
    PrunerSpec,
    TrainSpec,
)


def serve(model_dir: Path, frame: pd.DataFrame) -> pd.Series:
    """The served target column (the served frame also holds `proba_<label>` per class)."""
    from training.serving_model import ExportedClassifier

    model = ExportedClassifier()
    model.load_context(SimpleNamespace(artifacts={"model_dir": str(model_dir)}))
    return model.predict(None, frame)["target"]


def test_binary_trains_exports_and_serves_its_test_accuracy(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    assert run(tmp_path) == 0
    res = result(tmp_path)
    names = (
        "acc",
        "logloss",
        "roc_auc",
        "pr_auc",
        "f1",
        "balanced_acc",
        "precision/0",
        "recall/0",
        "precision/1",
        "recall/1",
    )
    assert set(res.metrics) == {"best_iteration"} | {
        f"{b}{s}_{n}" for b in ("", "baseline_") for s in ("val", "test") for n in names
    }
    assert res.metrics["test_roc_auc"] > 0.9 and res.metrics["baseline_test_roc_auc"] == 0.5
    assert res.world_size == 1 and res.best_metric == res.metrics["val_acc"]
    assert res.metrics["test_acc"] > 0.9
    assert res.checkpoint_uri == str(tmp_path / "run" / "checkpoints" / "model.txt")
    assert res.goodput["attempts"] == 1 and 0 < res.goodput["goodput"] <= 1
    assert res.device_hours == pytest.approx(res.goodput["wall_seconds"] / 3600)
    meta = json.loads((tmp_path / "run" / "model" / "meta.json").read_text())
    assert meta["format"] == "lightgbm" and meta["task"] == "classification" and meta["classes"] == [0, 1]
    assert meta["objective"] == "binary" and meta["best_iteration"] == int(res.metrics["best_iteration"])
    test = pd.read_parquet(spec.data.test_uri)
    predicted = serve(tmp_path / "run" / "model", test.drop(columns=["target"]))
    assert float((predicted.to_numpy() == test["target"].to_numpy()).mean()) == res.metrics["test_acc"]


def test_multiclass_serves_original_labels(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "multiclass")
    assert run(tmp_path) == 0
    res = result(tmp_path)
    assert res.best_metric == res.metrics["val_logloss"]
    meta = json.loads((tmp_path / "run" / "model" / "meta.json").read_text())
    assert meta["objective"] == "multiclass" and meta["classes"] == [0, 1, 2]
    test = pd.read_parquet(spec.data.test_uri)
    predicted = serve(tmp_path / "run" / "model", test)
    assert set(predicted) <= {0, 1, 2}
    assert float((predicted.to_numpy() == test["target"].to_numpy()).mean()) == res.metrics["test_acc"]


def test_regression_reports_rmse_and_serves_values(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "regression")
    assert run(tmp_path) == 0
    res = result(tmp_path)
    assert set(res.metrics) == {"best_iteration"} | {
        f"{b}{s}_{n}" for b in ("", "baseline_") for s in ("val", "test") for n in ("rmse", "mae")
    }
    assert res.metrics["test_rmse"] < res.metrics["baseline_test_rmse"]
    assert res.best_metric == res.metrics["val_rmse"]
    meta = json.loads((tmp_path / "run" / "model" / "meta.json").read_text())
    assert meta["task"] == "regression" and "classes" not in meta
    test = pd.read_parquet(spec.data.test_uri)
    predicted = serve(tmp_path / "run" / "model", test).to_numpy()
    assert float(np.sqrt(np.mean((predicted - test["target"].to_numpy()) ** 2))) == pytest.approx(
        res.metrics["test_rmse"], rel=1e-12
    )


@pytest.mark.parametrize(
    ("kwargs", "monitor", "message"),
    [
        ({"objective": "lambdarank"}, ("val_acc", "max"), "model.kwargs.objective='lambdarank' is not supported"),
        ({"n_estimators": 500}, ("val_acc", "max"), "['n_estimators']; the number of boosting rounds is max_epochs"),
        ({"seed": 3}, ("val_acc", "max"), "sets ['seed'], which the platform owns"),
        ({"early_stopping_rounds": 0}, ("val_acc", "max"), "early_stopping_rounds=0 must be an integer >= 1"),
        (
            {},
            ("val_rmse", "min"),
            "monitor='val_rmse' measures regression, but this is a classification task; use one of ['val_acc', "
            "'val_balanced_acc', 'val_f1', 'val_logloss', 'val_pr_auc', 'val_roc_auc']",
        ),
        ({}, ("val_acc", "min"), "monitor_mode='min' does not fit monitor='val_acc'"),
        ({"num_leaves": -3}, ("val_acc", "max"), "LightGBM rejected"),
    ],
)
def test_bad_config_exits_with_the_config_status_and_names_the_field(
    tmp_path: Path, kwargs: dict, monitor: tuple, message: str
) -> None:
    make_spec(
        tmp_path,
        model=ImportTarget(path="lightgbm:train", kwargs={**FAST, **kwargs}),
        monitor=monitor[0],
        monitor_mode=monitor[1],
    )
    assert run(tmp_path) == EXIT_BAD_CONFIG
    failure = json.loads((tmp_path / "run" / "failures" / "rank-0.json").read_text())
    assert failure["category"] == "config" and message in failure["error"]


def test_missing_split_is_a_config_error(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    os.remove(spec.data.val_uri)
    assert run(tmp_path) == EXIT_BAD_CONFIG
    assert "does not exist" in json.loads((tmp_path / "run" / "failures" / "rank-0.json").read_text())["error"]


def _predictions(tmp: Path, out: str, spec: TrainSpec) -> np.ndarray:
    import lightgbm as lgb

    booster = lgb.Booster(model_file=str(tmp / out / "model" / "model.txt"))
    return booster.predict(pd.read_parquet(spec.data.test_uri)[spec.data.features].to_numpy("float64"))


@pytest.mark.parametrize("lose_state", [False, True], ids=["state-file", "state-rescored"])
def test_interrupted_trial_resumes_from_the_model_file_exactly(tmp_path: Path, lose_state: bool) -> None:
    kw = dict(kind="multiclass", max_epochs=80, checkpoint=CheckpointPolicy(every_n_steps=10))
    spec = make_spec(tmp_path, out="straight", **kw)
    assert run(tmp_path, "straight") == 0
    straight = result(tmp_path, "straight")

    make_spec(tmp_path, out="broken", faults=FaultInjection(raise_at_step=25), **kw)
    assert run(tmp_path, "broken") == EXIT_USER_ERROR
    state = json.loads((tmp_path / "broken" / "checkpoints" / "state.json").read_text())
    assert state["iterations"] == 20 and len(state["history"]) == 20
    if lose_state:
        (tmp_path / "broken" / "checkpoints" / "state.json").unlink()
    assert run(tmp_path, "broken", launch="launch-2") == 0  # the fault fires once per trial
    resumed = result(tmp_path, "broken")
    assert resumed.resumed_from == str(tmp_path / "broken" / "checkpoints" / "model.txt")
    assert resumed.metrics == straight.metrics and resumed.epochs == straight.epochs
    assert np.array_equal(_predictions(tmp_path, "broken", spec), _predictions(tmp_path, "straight", spec))
    assert resumed.goodput["attempts"] == 2 and resumed.goodput["lost_steps"] == 5  # iterations 21..25 were redone
    assert resumed.goodput["restart_causes"] == ["failed"]


def test_a_finished_model_file_is_not_trained_again(tmp_path: Path) -> None:
    make_spec(tmp_path)
    assert run(tmp_path) == 0
    first = result(tmp_path)
    (tmp_path / "run" / "result.json").unlink()
    assert run(tmp_path) == 0
    again = result(tmp_path)
    assert again.metrics == first.metrics and again.epochs == first.epochs


def test_sigterm_commits_the_model_file_and_exits_preempted(tmp_path: Path) -> None:
    make_spec(tmp_path, kind="multiclass", max_epochs=80, faults=FaultInjection(sigterm_at_step=17))
    previous = signal.getsignal(signal.SIGTERM)
    assert run(tmp_path) == EXIT_PREEMPTED
    assert signal.getsignal(signal.SIGTERM) == previous  # the trial's handler is removed again
    state = json.loads((tmp_path / "run" / "checkpoints" / "state.json").read_text())
    assert state["iterations"] == 17
    assert run(tmp_path, launch="launch-2") == 0
    resumed = result(tmp_path)
    assert resumed.resumed_from is not None and resumed.goodput["restart_causes"] == ["preempted"]


def test_optuna_pruner_stops_a_bad_trial_and_marks_it_pruned(tmp_path: Path) -> None:
    import optuna

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=url, direction="minimize")
    for _ in range(5):  # the default MedianPruner's startup trials, all far better than a real model
        t = study.ask()
        for step in range(gbt.REPORT_EVERY, 200, gbt.REPORT_EVERY):
            t.report(0.0, step)
        study.tell(t, 0.0)
    number = study.ask().number
    pruner = PrunerSpec(kind="median")  # Optuna's MedianPruner() defaults: 5 startup trials, no warm-up
    make_spec(
        tmp_path,
        kind="multiclass",
        max_epochs=80,
        optuna=OptunaSpec(storage_url=url, study_name="s", trial_number=number, pruner=pruner),
    )
    assert run(tmp_path) == 0
    res = result(tmp_path)
    assert res.epochs == gbt.REPORT_EVERY and res.status == "pruned"  # stopped at the first report
    trial = optuna.load_study(study_name="s", storage=url).trials[number]
    assert trial.state == optuna.trial.TrialState.RUNNING  # the pod reports; only the orchestrator ends a trial
    assert trial.intermediate_values == {gbt.REPORT_EVERY: pytest.approx(res.metrics["val_logloss"])}
    assert (tmp_path / "run" / "model" / "model.txt").exists()  # a pruned trial still keeps its model

    # what the orchestrator does with the result (assets.sweeps.trials.tell_result): the trial ends PRUNED and keeps its
    # result's location and metrics, so `trainyard compare --trials` lists it with them
    from resources.storage import ObjectStore
    from resources.sweeps import SweepStore
    from trainyard.trials import trial_comparison

    sweeps = SweepStore(storage_url=url)
    attrs = {"result_uri": str(tmp_path / "run" / "result.json"), "metrics": res.metrics}
    assert sweeps.tell("s", number, None, attrs, pruned=True) == "PRUNED"
    trial = sweeps.trial("s", number)
    assert trial.user_attrs["metrics"] == res.metrics
    assert f"| {res.trial_id} |" in trial_comparison(ObjectStore(root=str(tmp_path)), [trial]).splitlines()


def test_a_trial_whose_pipeline_declares_no_pruner_is_never_pruned(tmp_path: Path) -> None:
    """The same bad trial as above, with no pruner declared: it trains every round and the study is not asked."""
    import optuna

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=url, direction="minimize")
    for _ in range(5):
        t = study.ask()
        for step in range(gbt.REPORT_EVERY, 200, gbt.REPORT_EVERY):
            t.report(0.0, step)
        study.tell(t, 0.0)
    number = study.ask().number
    make_spec(
        tmp_path,
        kind="multiclass",
        max_epochs=80,
        optuna=OptunaSpec(storage_url=url, study_name="s", trial_number=number),
    )
    assert run(tmp_path) == 0
    res = result(tmp_path)
    assert res.status != "pruned" and res.epochs > gbt.REPORT_EVERY
    trial = optuna.load_study(study_name="s", storage=url).trials[number]
    assert (
        trial.state == optuna.trial.TrialState.RUNNING and trial.intermediate_values == {}
    )  # the orchestrator tells it


def test_metric_values_are_exact() -> None:
    y = np.array([0, 1, 1, 0])
    assert gbt.metric_value("acc", np.array([0.2, 0.7, 0.4, 0.5]), y) == 0.75  # 0.5 is not above the threshold
    assert gbt.metric_value("logloss", np.array([0.5, 0.5, 0.5, 0.5]), y) == pytest.approx(np.log(2))
    assert (
        gbt.metric_value("acc", np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.5, 0.5]]), y) == 0.75
    )  # ties go to the first class
    assert gbt.metric_value("rmse", np.array([1.0, 2.0]), np.array([1.0, 4.0])) == pytest.approx(np.sqrt(2.0))


def test_a_gbt_trial_is_a_single_pod_job_on_kubernetes(tmp_path: Path) -> None:
    from resources.k8s.config import K8sJobConfig
    from resources.k8s.manifests import job_manifest

    spec = make_spec(tmp_path)
    job = job_manifest(
        spec,
        "s3://bucket/runs/tabular/test/trial-0000/spec.json",
        0,
        K8sJobConfig(namespace="tabular", image="trainer:1", queue_name="tabular"),
    )
    s = job["spec"]
    assert (s["parallelism"], s["completions"], s["suspend"]) == (1, 1, True)
    container = s["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["requests"]
    assert container["command"][-3:] == ["training.entrypoint", "--spec", "s3://bucket/runs/tabular/test/trial-0000/spec.json"]
    assert "--nproc-per-node=1" in container["command"]
    k8s_validate(job)
