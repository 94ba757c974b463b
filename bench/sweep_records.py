"""What a benchmarked sweep leaves in the stores, written fast: trial run records and finished Optuna trials.

`RunRecords` makes a trial's run record the way the sensor daemon (create +
enqueue) and a run worker (run events) make it, or copies a real one in a batch
straight into Dagster's run tables; `seed_trials` writes finished trials straight
into Optuna's tables. `bench.sweep_10k` drives the sweep sensor over both.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Callable, Optional, Sequence


class RunRecords:
    """Run records for trial runs, made as the sensor daemon (create + submit) and a run worker (run events) make them.

    Args:
        instance: the Dagster instance.
        defs: the pipeline's Definitions; `train_job` names its train job.
        origin: where the daemon says the train job comes from (`bench.sweep_10k.job_origin`).
    """

    def __init__(self, instance: Any, defs: Any, train_job: str, origin: Any) -> None:
        from dagster._core.execution.api import create_execution_plan

        self.instance = instance
        self.job = defs.resolve_job_def(train_job)
        self.plan = create_execution_plan(self.job, instance_ref=instance.get_ref())
        self.origin = origin
        self.template: Optional[Any] = None

    def submit(self, request: Any) -> str:
        """The daemon's part for one RunRequest: create the run (NOT_STARTED) and enqueue it; returns the run id."""
        from dagster import DagsterRunStatus
        from dagster._core.events import DagsterEvent

        tags = {**request.tags, "dagster/partition": request.partition_key, "dagster/run_key": request.run_key}
        run = self.instance.create_run_for_job(
            self.job,
            execution_plan=self.plan,
            status=DagsterRunStatus.NOT_STARTED,
            tags=tags,
            remote_job_origin=self.origin,
        )
        self.instance.report_dagster_event(DagsterEvent.job_enqueue(run), run_id=run.run_id)
        return run.run_id

    def run(self, run_id: str, work: Callable[[], None]) -> None:
        """The run's life after the queue: starting (launcher), start (run worker), `work`, success."""
        from dagster._core.events import DagsterEvent, DagsterEventType

        def report(kind: Any) -> None:
            self.instance.report_dagster_event(
                DagsterEvent(event_type_value=kind.value, job_name=self.job.name), run_id=run_id
            )

        report(DagsterEventType.RUN_STARTING)
        report(DagsterEventType.RUN_START)
        work()
        report(DagsterEventType.RUN_SUCCESS)
        if self.template is None:
            self.template = self.instance.get_run_by_id(run_id)

    def seed(self, keys: Sequence[str], tags: dict[str, str], study: str) -> None:
        """Write one finished run per partition key straight into the run tables (copies of a real run record).

        Raises:
            RuntimeError: no real run was made yet to copy (`run` first).
        """
        from dagster._core.storage.runs.schema import RunsTable, RunTagsTable
        from dagster._core.utils import make_new_run_id
        from dagster_shared.record import copy
        from dagster_shared.serdes import serialize_value

        if self.template is None:
            raise RuntimeError("seed copies a real finished run record; create and run one first")
        storage = self.instance.run_storage
        now = datetime.now(UTC)
        base = storage._get_run_insertion_values(self.template, now)  # checks the job snapshot exists, once
        base.update(update_timestamp=now, start_time=now.timestamp(), end_time=now.timestamp())
        runs, run_tags = [], []
        for key in keys:
            run_tags_here = {
                **self.template.tags,
                **tags,
                "dagster/partition": key,
                "dagster/run_key": f"{study}/{key}",
            }
            run = copy(self.template, run_id=make_new_run_id(), tags=run_tags_here)
            runs.append({**base, "run_id": run.run_id, "run_body": serialize_value(run), "partition": key})
            run_tags.extend({"run_id": run.run_id, "key": k, "value": v} for k, v in run.tags_for_storage().items())
        with storage.connect() as conn:
            for start in range(0, len(runs), 5000):
                conn.execute(RunsTable.insert(), runs[start:start + 5000])
            for start in range(0, len(run_tags), 20000):
                conn.execute(RunTagsTable.insert(), run_tags[start:start + 20000])


def seed_trials(sweeps: Any, study_name: str, search: Any, first: int, count: int, seed: int = 0) -> None:
    """Write `count` COMPLETE trials numbered from `first` straight into Optuna's tables.

    Parameters are drawn at random from `search`'s distributions; the value is
    the trivial trial's (`score`), as if each had been asked and told.

    Raises:
        ValueError: the study already has a trial numbered `first` or above.
    """
    import random

    import sqlalchemy
    from optuna.distributions import distribution_to_json
    from optuna.storages._rdb import models
    from optuna.trial import TrialState

    from resources.sweeps.rules import distributions
    from tests.pipelines.sweep_drill import score

    storage = sweeps.storage()
    study_id = storage.get_study_id_from_name(study_name)
    dists = distributions(search)
    draw = random.Random(seed)
    with storage.engine.begin() as conn:
        top = conn.execute(
            sqlalchemy.select(sqlalchemy.func.max(models.TrialModel.number)).where(
                models.TrialModel.study_id == study_id
            )
        ).scalar()
        if top is not None and top >= first:
            raise ValueError(f"study {study_name!r} already has trial {top}; seeding starts at {first}")
        next_id = (conn.execute(sqlalchemy.select(sqlalchemy.func.max(models.TrialModel.trial_id))).scalar() or 0) + 1
        now = datetime.now()
        trials, params, values = [], [], []
        for i in range(count):
            trial_id = next_id + i
            drawn = {name: _draw(dist, draw) for name, dist in dists.items()}
            trials.append(
                {
                    "trial_id": trial_id,
                    "number": first + i,
                    "study_id": study_id,
                    "state": TrialState.COMPLETE,
                    "datetime_start": now,
                    "datetime_complete": now,
                }
            )
            params.extend({"trial_id": trial_id, "param_name": name, "param_value": dists[name].to_internal_repr(v),
                           "distribution_json": distribution_to_json(dists[name])} for name, v in drawn.items())
            values.append({"trial_id": trial_id, "objective": 0, "value": score(drawn),
                           "value_type": models.TrialValueModel.TrialValueType.FINITE})
        conn.execute(models.TrialModel.__table__.insert(), trials)
        conn.execute(models.TrialParamModel.__table__.insert(), params)
        conn.execute(models.TrialValueModel.__table__.insert(), values)


def _draw(dist: Any, rng: Any) -> Any:
    """One random value of an Optuna distribution (float: log-uniform when log; int: on its step grid)."""
    import math

    from optuna.distributions import FloatDistribution, IntDistribution

    if isinstance(dist, FloatDistribution):
        if dist.log:
            return math.exp(rng.uniform(math.log(dist.low), math.log(dist.high)))
        return rng.uniform(dist.low, dist.high)
    if isinstance(dist, IntDistribution):
        return rng.randrange(dist.low, dist.high + 1, dist.step)
    raise ValueError(f"seed_trials draws float and int parameters only, got {dist!r}")
