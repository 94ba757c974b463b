"""The TrainSpec of a trial, assembled by a pure function: layers and every field, without Dagster."""

from __future__ import annotations

import subprocess
import sys

from tests.pipelines.pipeline_fixtures import small_spec
from training.spec import Distribution, FaultInjection, PrunerSpec, TrackerSpec
from trainyard.spec import ModelSpec
from trainyard.trainspec import TrialInputs, build_train_spec, model_kwargs
from trainyard.values import ValidatedData

DATA = ValidatedData(
    md5="a" * 32,
    split_id="a" * 32 + "-f",
    train="/d/train.parquet",
    val="/d/val.parquet",
    test="/d/test.parquet",
    rows={"train": 70, "val": 15, "test": 15},
)


def build(spec, trial: TrialInputs, **over):
    args = dict(
        output_uri="/store/runs/test/digits/s/trial-0001",
        distribution=Distribution(procs_per_node=2),
        tracker=TrackerSpec(kind="none"),
        optuna_storage_url="sqlite:///o.db",
        lineage={"data_version": "a" * 32},
    )
    args.update(over)
    return build_train_spec(spec, trial, DATA, **args)


def test_every_field_comes_from_its_layer() -> None:
    spec = small_spec(
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP", max_epochs=2, batch_size=64, hparams={"hidden": 32})
    )
    ts = build(spec, TrialInputs("trial-0001", 1, "s", {"lr": 0.01}))
    assert ts.pipeline == "test/digits" and ts.trial_id == "trial-0001" and ts.task == spec.model.task
    assert ts.model.path == "pipelines.vision.models:DigitsMLP" and ts.model.kwargs == {
        "lr": 0.01,
        "hidden": 32,
    }  # trial over hparams
    assert ts.datamodule.path == spec.model.datamodule
    assert ts.data.model_dump() == {
        "train_uri": "/d/train.parquet",
        "val_uri": "/d/val.parquet",
        "test_uri": "/d/test.parquet",
        "features": spec.features,
        "target": "label",
        "version": "a" * 32,
        "feature_types": {c: "float" for c in spec.features},
        "domains": {},
        "keep": [],
        "positive_label": None,
    }
    assert ts.preprocessing == spec.preprocessing and ts.class_weight is None
    assert ts.output_uri == "/store/runs/test/digits/s/trial-0001"
    assert (ts.max_epochs, ts.batch_size, ts.monitor, ts.monitor_mode, ts.seed) == (
        2,
        64,
        spec.model.monitor,
        spec.model.monitor_mode,
        spec.model.seed,
    )
    assert ts.distribution == Distribution(procs_per_node=2) and ts.checkpoint == spec.checkpoint
    assert ts.tracker == TrackerSpec(kind="none") and ts.faults == FaultInjection()
    assert ts.optuna is not None and (ts.optuna.storage_url, ts.optuna.study_name, ts.optuna.trial_number) == (
        "sqlite:///o.db",
        "s",
        1,
    )
    assert ts.optuna.pruner == spec.search.pruner
    assert ts.lineage == {"data_version": "a" * 32}


def test_column_roles_and_types_reach_the_pod() -> None:
    from trainyard.spec import ColumnSpec

    columns = {
        "customer": ColumnSpec(dtype="str", role="id"),
        "signup": ColumnSpec(dtype="date", role="timestamp"),
        "plan": ColumnSpec(dtype="category", domain=["basic", "pro"]),
        "country": ColumnSpec(dtype="str", nullable=True),
        "charges": ColumnSpec(dtype="float", nullable=True),
        "export_batch": ColumnSpec(dtype="int", role="ignore"),
        "churned": ColumnSpec(dtype="str", domain=["no", "yes"]),
    }
    spec = small_spec(columns=columns, target="churned", positive_label="yes",
                      model=ModelSpec(path="pipelines.vision.models:DigitsMLP", class_weight="balanced"))
    assert spec.features == ["plan", "country", "charges"] and spec.keep_columns == ["customer", "signup"]
    assert list(spec.stored_columns) == ["customer", "signup", "plan", "country", "charges", "churned"]
    ts = build(spec, TrialInputs("trial-0000", 0, "s"))
    assert ts.data.features == ["plan", "country", "charges"] and ts.data.keep == ["customer", "signup"]
    assert ts.data.feature_types == {"plan": "category", "country": "str", "charges": "float"}
    assert (
        ts.data.domains == {"plan": ["basic", "pro"]}
        and ts.data.positive_label == "yes"
        and ts.class_weight == "balanced"
    )


def test_run_config_is_the_last_layer() -> None:
    spec = small_spec()
    faults = FaultInjection(kill_rank=1, kill_at_step=5)
    ts = build(spec, TrialInputs("trial-0000", 0, "s"), max_epochs=1, faults=faults)
    assert ts.max_epochs == 1 and ts.faults == faults
    assert build(spec, TrialInputs("trial-0000", 0, "s"), max_epochs=None).max_epochs == spec.model.max_epochs


def test_a_finished_trial_trained_again_gets_no_pruner() -> None:
    from trainyard.search import SearchSpec

    spec = small_spec(search=SearchSpec(n_trials=1, pruner=PrunerSpec(kind="median")))
    assert build(spec, TrialInputs("trial-0000", 0, "s", accepts_reports=True)).optuna.pruner.kind == "median"
    assert build(spec, TrialInputs("trial-0000", 0, "s", accepts_reports=False)).optuna.pruner == PrunerSpec()


def test_model_kwargs_layer_trial_params_over_hparams() -> None:
    spec = small_spec(model=ModelSpec(path="pipelines.vision.models:DigitsMLP", hparams={"a": 1, "b": 2}))
    assert model_kwargs(spec, {"b": 3, "c": 4}) == {"a": 1, "b": 3, "c": 4}


def test_assembly_imports_without_dagster() -> None:
    code = (
        "import sys; sys.modules['dagster'] = None; import trainyard.trainspec, trainyard.values, trainyard.naming, "
        "trainyard.trials"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
