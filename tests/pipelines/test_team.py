"""A team declares its settings once; mistakes name the field and the fix; pool limits hold across concurrent runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from dagster import AssetKey, DagsterEventType, DagsterInstance, EventRecordsFilter
from pydantic import ValidationError

from pipelines.catalog import workspace_teams
from pipelines.environments import local_resources
from pipelines.team import TeamSpec, apply_pool_limits, check_pipelines, team_definitions, team_resources
from tests.pipelines.pipeline_fixtures import small_spec
from trainyard.naming import drift_sensor_name
from trainyard.naming import retrain_schedule_name as schedule_name
from trainyard.spec import RetrainPolicy

ROOT = Path(__file__).resolve().parent.parent.parent


def error_text(excinfo: pytest.ExceptionInfo) -> str:
    return str(excinfo.value)


def test_pipeline_of_another_team_names_the_field_and_the_fix() -> None:
    with pytest.raises(ValueError) as e:
        team_definitions(TeamSpec(name="vision"), small_spec(), resources={})
    assert error_text(e) == (
        "pipeline 'test/digits': team='test' does not match this team module's TeamSpec(name='vision'); "
        "set PipelineSpec(team='vision', ...) or move the pipeline to the 'test' team's module"
    )
    with pytest.raises(
        ValueError, match=r"team_definitions needs at least one pipeline, e\.g\. team_definitions\(team, my_pipeline\)"
    ):
        team_definitions(TeamSpec(name="vision"), resources={})


def test_negative_pool_limit_names_the_field_and_the_fix() -> None:
    with pytest.raises(ValidationError) as e:
        TeamSpec(name="vision", gpu_pool_limit=-1)
    text = error_text(e)
    assert "gpu_pool_limit" in text
    assert (
        "gpu_pool_limit=-1 would let no trial train; set it to the most trials the team may train at once (1 or more)"
        in text
    )


def test_unknown_priority_class_lists_the_platform_classes() -> None:
    with pytest.raises(ValidationError) as e:
        TeamSpec(name="vision", priority_class="high")
    assert "priority_class 'high' is not a platform PriorityClass; use one of " \
           "['trainyard-interactive', 'trainyard-production', 'trainyard-sweep'] (highest first)" in error_text(e)
    with pytest.raises(ValidationError, match="did you mean 'trainyard-production'"):
        TeamSpec(name="vision", priority_class="production")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"name": "Vision"}, "team name 'Vision' is not valid; use 1-31 lowercase letters"),
        (
            {"queue": "Vision_Queue"},
            "queue 'Vision_Queue' is not a Kubernetes name; use lowercase letters, digits and '-'",
        ),
        ({"namespace": "team vision"}, "namespace 'team vision' is not a Kubernetes name"),
        (
            {"env": {"DAGSTER_HOME": "/tmp/x"}},
            "env 'DAGSTER_HOME' is not a setting the platform reads; use upper-case variables starting with one of",
        ),
        ({"gpu_pools": 2}, "gpu_pools\n  Extra inputs are not permitted"),
        (
            {"retrain": {"cron": "daily"}},
            "cron 'daily' is not a cron string; use five fields 'minute hour day month weekday', e.g. '0 3 * * *'",
        ),
        (
            {"retrain": {"drift_psi": 0.2, "on_new_data": False}},
            "with on_new_data=False and no cron nothing ingests new data; set on_new_data=True or a cron schedule",
        ),
        ({"retrain": {"drift_psi": -0.1}}, "drift_psi -0.1 must be above 0"),
        (
            {"retrain": {"cron": "0 3 * * *", "timezone": "Mars/Olympus"}},
            "timezone 'Mars/Olympus' is not an IANA time zone",
        ),
    ],
)
def test_other_mistakes_name_the_field_and_the_fix(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError) as e:
        TeamSpec(**{"name": "vision", **fields})
    assert message in error_text(e)


def test_team_default_retraining_applies_unless_the_pipeline_sets_its_own(tmp_path: Path) -> None:
    team = TeamSpec(name="test", retrain=RetrainPolicy(cron="0 3 * * *", drift_psi=0.25))
    own = small_spec(name="own", retrain=RetrainPolicy(on_new_data=True))
    inherited, kept = check_pipelines(team, [small_spec(), own])
    assert inherited.retrain_policy == team.retrain and kept.retrain_policy == RetrainPolicy()
    assert inherited.fingerprint() == small_spec().fingerprint()  # triggers do not change what trains
    defs = team_definitions(team, small_spec(), own, resources=local_resources(tmp_path))
    assert sorted(s.name for s in defs.sensors) == [
        "test__digits__drift",
        "test__digits__landing",
        "test__digits__sweep",
        "test__own__landing",
        "test__own__sweep",
    ]
    assert [s.name for s in defs.schedules] == [schedule_name(inherited)] == ["test__digits__retrain"]
    schedule = defs.get_schedule_def("test__digits__retrain")
    assert (schedule.cron_schedule, schedule.execution_timezone, schedule.job_name) == (
        "0 3 * * *",
        "UTC",
        "test__digits__prepare",
    )
    assert drift_sensor_name(inherited) == "test__digits__drift"


def test_example_teams_keep_their_behaviour() -> None:
    from pipelines.tabular.definitions import defs as tabular
    from pipelines.vision.definitions import defs as vision

    for defs, team, name in ((vision, "vision", "digits"), (tabular, "tabular", "breast_cancer")):
        assert {f"{team}__{name}__landing", f"{team}__{name}__sweep"} <= {s.name for s in defs.sensors}
        assert not [
            s.name for s in defs.sensors if s.name.startswith(f"{team}__{name}__") and s.name.endswith("__drift")
        ]
        assert not list(defs.schedules or [])
        trial = defs.get_assets_def(AssetKey([team, name, "trial_model"]))
        assert trial.op.pool == f"{team}_gpu"
    limits = {t.name: t.gpu_pool_limit for t in workspace_teams()}
    assert (limits["vision"], limits["tabular"]) == (2, 2)


def test_cluster_resources_take_the_teams_queue_priority_and_namespace(tmp_path: Path) -> None:
    env = {
        "TRAINYARD_ENV": "cluster",
        "TRAINYARD_S3_ROOT": "s3://lake/trainyard",
        "TRAINYARD_OPTUNA_URL": "postgresql+psycopg2://optuna@db/optuna",
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        "TRAINYARD_HOME": str(tmp_path),
        "TRAINYARD_K8S_NAMESPACE": "shared",
        "TRAINYARD_K8S_QUEUE": "everyone",
        "TRAINYARD_TRAINER_IMAGE": "registry.example/trainyard-trainer:1.0",
    }
    team = TeamSpec(name="vision", queue="vision-gpu", namespace="vision", priority_class="trainyard-production",
                    env={"TRAINYARD_OPTUNA_URL": "postgresql+psycopg2://optuna@db/vision"})
    res = team_resources(team, base_env=env)
    launcher = res["launcher"]
    assert (launcher.namespace, launcher.queue_name, launcher.priority_class) == (
        "vision",
        "vision-gpu",
        "trainyard-production",
    )
    assert res["sweeps"].storage_url == "postgresql+psycopg2://optuna@db/vision"
    local = team_resources(TeamSpec(name="vision", env={"TRAINYARD_HOME": str(tmp_path / "vision")}), base_env={})
    assert local["store"].root == str(tmp_path / "vision" / "store")


def test_init_sets_each_teams_pool_limit(tmp_path: Path) -> None:
    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster"), overrides={"telemetry": {"enabled": False}}) as instance:
        limits = apply_pool_limits(
            instance, [TeamSpec(name="vision", gpu_pool_limit=3), TeamSpec(name="tabular", gpu_pool_limit=1)]
        )
        assert limits == {"vision_gpu": 3, "tabular_gpu": 1}
        assert instance.event_log_storage.get_concurrency_info("vision_gpu").slot_count == 3
        assert instance.event_log_storage.get_concurrency_info("tabular_gpu").slot_count == 1
        with pytest.raises(ValueError, match="team 'vision' is declared twice with gpu_pool_limit 3 and 2"):
            apply_pool_limits(instance, [TeamSpec(name="vision", gpu_pool_limit=3), TeamSpec(name="vision")])
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "init"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "TRAINYARD_HOME": str(tmp_path / "home"),
            "DAGSTER_HOME": str(tmp_path / "home" / "dagster"),
        },
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pool vision_gpu: at most 2 trial(s) at once" in out.stdout
    with DagsterInstance.from_config(str(tmp_path / "home" / "dagster")) as instance:
        assert instance.event_log_storage.get_concurrency_info("tabular_gpu").slot_count == 2


def step_events(instance: DagsterInstance, kind: DagsterEventType, step_key: str) -> list[tuple[str, float]]:
    """(run id, timestamp) of every `kind` event of step `step_key`."""
    records = instance.get_event_records(EventRecordsFilter(event_type=kind))
    return [
        (r.event_log_entry.run_id, r.event_log_entry.timestamp)
        for r in records
        if r.event_log_entry.step_key == step_key
    ]


def step_intervals(instance: DagsterInstance, step_key: str) -> list[tuple[float, float]]:
    """(start, end) of every execution of `step_key`, from its STEP_START and STEP_SUCCESS events."""
    starts = dict(step_events(instance, DagsterEventType.STEP_START, step_key))
    ends = dict(step_events(instance, DagsterEventType.STEP_SUCCESS, step_key))
    return [(starts[r], ends[r]) for r in starts if r in ends]


def unclaimed_steps(instance: DagsterInstance, pool: str = "test_gpu") -> set[tuple[str, str]]:
    """(run id, step key) of every step queued for a slot of `pool` that holds none.

    Dagster's `pending_step_count` counts only steps not yet assigned a slot, but assignment is
    not atomic: two claims can both see a free slot and both be assigned, and the one that then
    finds every slot row taken stays blocked, assigned yet holding no slot. So count the queue
    rows that hold no slot instead.
    """
    info = instance.event_log_storage.get_concurrency_info(pool)
    return {(s.run_id, s.step_key) for s in info.pending_steps} - {(c.run_id, c.step_key) for c in info.claimed_slots}


def blocked_runs(instance: DagsterInstance, pool: str = "test_gpu") -> set[str]:
    """Runs whose step Dagster reported as waiting for a slot of `pool`."""
    records = instance.get_event_records(EventRecordsFilter(event_type=DagsterEventType.ENGINE_EVENT))
    return {
        r.event_log_entry.run_id
        for r in records
        if f"blocked by limit for pool {pool}" in (r.event_log_entry.message or "")
    }


def pool_state(
    instance: DagsterInstance, step_key: str, running: Any, waiting: set[str], pending: set[tuple[str, str]]
) -> str:
    """What the pool-limit test saw when it gave up: every run (partition, status), the slots' holders, who started."""
    runs = {r.run_id: (r.tags.get("dagster/partition"), r.status.value) for r in instance.get_runs()}
    holders = [
        (c.run_id, c.step_key) for c in instance.event_log_storage.get_concurrency_info("test_gpu").claimed_slots
    ]
    started = {r for r, _ in step_events(instance, DagsterEventType.STEP_START, step_key)}
    return (
        f"in the barrier {running}, waiting {waiting}, queued without a slot {pending}, slot holders {holders}, "
        f"started {started}, runs {runs}"
    )


@pytest.mark.slow
def test_pool_limit_holds_with_more_concurrent_trial_runs_than_slots(tmp_path: Path, pg_databases) -> None:
    """Four trial runs, each its own process, on one instance whose pool `test_gpu` has two slots:
    two trials train, two wait for a slot; each trial is held open until the test saw who waited.
    The trials train inside a barrier that opens once two are in, so two at once is certain, and
    the barrier's count of trials inside together shows that a third never joined them.

    The instance stores runs, events and slots in PostgreSQL, as the cluster's does. There Dagster's
    own slot claim let two runs take one slot and three trials train at once (CI caught it here);
    the trial runs claim through `instance.pool_slots`, which assets.factory installs.
    """
    from tests.pipelines.sweep_drill import TrivialLauncher, drill_resources, drill_spec, prepared_home
    from tests.support.barrier import FileBarrier

    home = tmp_path
    (home / "dagster").mkdir()
    postgres_url = pg_databases[1]
    (home / "dagster" / "dagster.yaml").write_text(
        f"telemetry:\n  enabled: false\nstorage:\n  postgres:\n    postgres_url: {postgres_url}\n"
    )
    spec = drill_spec(n_trials=4, parallelism=4)
    instance = DagsterInstance.from_config(str(home / "dagster"))
    assert apply_pool_limits(instance, [TeamSpec(name="test", gpu_pool_limit=2)]) == {"test_gpu": 2}
    sweep = prepared_home(home, spec, drill_resources(home, TrivialLauncher()), instance)
    assert len(sweep["trials"]) == 4
    env = {**os.environ, "DAGSTER_HOME": str(home / "dagster"), "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.pipelines.pool_drill", str(home), key], cwd=ROOT, env=env,
                         stdout=open(home / f"{key}.log", "w"), stderr=subprocess.STDOUT)
        for key in sweep["trials"]
    ]
    gates, barrier = home / "gates", FileBarrier(home / "barrier", parties=2)
    trial_step = f"{spec.team}__{spec.name}__trial_model"
    try:
        deadline = time.time() + 400  # a bound for a loaded machine (four Python starts at once), not a measure
        while True:  # two trials train and two steps wait for a slot
            running = barrier.inside_now()
            waiting = blocked_runs(instance) - {
                r for r, _ in step_events(instance, DagsterEventType.STEP_START, trial_step)
            }
            pending = unclaimed_steps(instance)
            # A blocked run queues its claim, then logs its event: wait for both.
            if len(running) == 2 and barrier.is_open() and len(waiting) == 2 and {r for r, _ in pending} == waiting:
                break
            assert len(running) <= 2, f"{running} train at once with two slots"
            assert all(p.poll() is None for p in procs), [
                (home / f"{k}.log").read_text()[-2000:] for k in sweep["trials"]
            ]
            assert time.time() < deadline, pool_state(instance, trial_step, running, waiting, pending)
            time.sleep(0.5)
        # Both slots are claimed and both other steps queue for one: none of them can start
        # before a slot is freed, and no slot is freed before a gate opens.
        info = instance.event_log_storage.get_concurrency_info("test_gpu")
        assert info.slot_count == 2 and len(info.claimed_slots) == 2 and len(unclaimed_steps(instance)) == 2
        assert barrier.inside_now() == running
        gates.mkdir()
        for key in sweep["trials"]:
            (gates / key).write_text("go")
        for p in procs:
            assert p.wait(timeout=240) == 0, [(home / f"{k}.log").read_text()[-2000:] for k in sweep["trials"]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert len(step_intervals(instance, trial_step)) == 4
    assert barrier.peak() == 2  # two trials trained at once, never more
    assert instance.event_log_storage.get_concurrency_info("test_gpu").claimed_slots == []


def test_readme_team_example_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ast
    import re
    import sys
    import types

    import pipelines.locations

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path))
    code = re.search(r"```python\n(# pipelines/fraud/team.py.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert len(code.splitlines()) <= 35
    imported = {n.module for n in ast.walk(ast.parse(code)) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Import) for a in n.names}
    assert imported == {"trainyard"}, imported  # a team module needs one import
    module = types.ModuleType("pipelines.fraud.team")
    exec(compile(code, "README.md", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "pipelines.fraud.team", module)
    defs = pipelines.locations.fraud  # what workspace.yaml's `attribute: fraud` makes Dagster read
    assert sorted(s.name for s in defs.sensors) == [
        "fraud__transactions__drift",
        "fraud__transactions__landing",
        "fraud__transactions__sweep",
    ]
    assert [s.name for s in defs.schedules] == ["fraud__transactions__retrain"]
    assert (
        defs.get_assets_def(AssetKey(["fraud", "transactions", "trial_model"])).op.pool
        == module.team.pool
        == "fraud_gpu"
    )


def test_a_team_module_declares_exactly_one_team(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from pipelines.team import team_location

    module = types.ModuleType("pipelines.noteam.team")
    module.spec = small_spec()
    monkeypatch.setitem(sys.modules, "pipelines.noteam.team", module)
    with pytest.raises(
        ValueError, match="pipelines.noteam.team: a team module declares exactly one TeamSpec, found none"
    ):
        team_location("pipelines.noteam.team")


def test_the_readme_text_corpus_pipeline_is_a_language_model_on_streaming_shards() -> None:
    import importlib
    import re
    import types

    code = re.search(
        r"```python\n(# pipelines/docs_team/corpus.py.*?)```", (ROOT / "README.md").read_text(), re.S
    ).group(1)
    assert len(code.splitlines()) <= 30
    module = types.ModuleType("pipelines.docs_team.corpus")
    exec(compile(code, "README.md", "exec"), module.__dict__)
    corpus = module.corpus
    assert (corpus.task, corpus.target_name, corpus.features) == ("causal_lm", "tokens", ["tokens"])
    assert (corpus.model.monitor, corpus.model.monitor_mode) == ("val_loss", "min")
    assert (corpus.promotion.metric, corpus.promotion.mode) == ("test_perplexity", "min")
    path, _, name = corpus.model.datamodule.partition(":")
    assert getattr(importlib.import_module(path), name).__name__ == "StreamingShardDataModule"
    path, _, name = corpus.model.path.partition(":")
    assert "vocab_size" in getattr(importlib.import_module(path), name).__init__.__code__.co_varnames


def test_the_readmes_own_pipeline_builds_its_location_as_the_shipped_teams_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README's "Write your own pipeline", as written: its two files, with the model module a user would write."""
    import importlib
    import re
    import sys

    import pipelines

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    code = re.search(r"```python\n(# pipelines/myteam/churn.py.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    churn_code, marker, definitions_code = code.partition("# pipelines/myteam/definitions.py")
    assert (
        marker and "team_definitions" in definitions_code and "build_definitions" not in code
    )  # the shipped teams' API
    team_dir = tmp_path / "src" / "pipelines" / "myteam"
    team_dir.mkdir(parents=True)
    (team_dir / "__init__.py").write_text("")
    (team_dir / "models.py").write_text(
        "from pipelines.vision.models import DigitsMLP as ChurnNet  # the user's LightningModule\n"
    )
    (team_dir / "churn.py").write_text(churn_code)
    (team_dir / "definitions.py").write_text(marker + definitions_code)
    monkeypatch.setattr(pipelines, "__path__", [*pipelines.__path__, str(tmp_path / "src" / "pipelines")])
    for name in (
        "pipelines.myteam",
        "pipelines.myteam.models",
        "pipelines.myteam.churn",
        "pipelines.myteam.definitions",
    ):
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        defs = importlib.import_module("pipelines.myteam.definitions").defs
    finally:
        for name in [m for m in sys.modules if m.startswith("pipelines.myteam")]:
            del sys.modules[name]
    assert sorted(s.name for s in defs.sensors) == ["myteam__churn__landing", "myteam__churn__sweep"]
    assert defs.get_assets_def(AssetKey(["myteam", "churn", "trial_model"])).op.pool == "myteam_gpu"
