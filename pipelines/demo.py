"""Run the digits pipeline from raw data to a registered champion, as real Dagster runs.

Order: the `prepare` job (raw_data, validated_data, sweep), one `train` run per
trial partition that has not completed, then the `promote` job. Runs are kept
in `DAGSTER_HOME`, so `make ui` shows them.
"""

from __future__ import annotations

import warnings

from dagster import BetaWarning, DagsterInstance

from pipelines.environments import local_resources
from pipelines.factory import job_names
from pipelines.vision.definitions import defs
from pipelines.vision.digits import digits
from trainyard import naming


def _run(job_name: str, instance: DagsterInstance, partition_key: str | None = None):
    job = defs.resolve_job_def(job_name)
    result = job.execute_in_process(
        instance=instance,
        partition_key=partition_key,
        raise_on_error=False,
        run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
    )
    label = f"{job_name}" + (f" [{partition_key}]" if partition_key else "")
    status = "ok" if result.success else "FAILED"
    print(f"  run {result.run_id[:8]} {label}: {status}", flush=True)
    if not result.success:
        for event in result.all_events:
            if event.is_failure and event.event_specific_data is not None:
                error = getattr(event.event_specific_data, "error", None)
                if error is not None:
                    print(error.message.strip()[:4000])
    return result


def run_demo() -> int:
    warnings.filterwarnings("ignore", category=BetaWarning)
    instance = DagsterInstance.get()
    names = job_names(digits)
    print(f"trainyard demo: pipeline {digits.key}, Dagster home {instance.root_directory}")
    prepare = _run(names["prepare"], instance)
    if not prepare.success:
        return 1
    sweep = prepare.output_for_node(naming.node_name(digits, naming.SWEEP))
    sweeps = local_resources()["sweeps"]
    study = sweeps.load(sweep.study)
    done = {t.number for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"}
    for key in sweep.trials:
        if naming.trial_number(key) in done:
            print(f"  {key}: already trained on this data and code, skipped")
            continue
        if not _run(names["train"], instance, partition_key=key).success:
            return 1
    promote = _run(names["promote"], instance)
    if not promote.success:
        return 1
    reg = promote.output_for_node(naming.node_name(digits, naming.REGISTERED_MODEL))
    best = promote.output_for_node(naming.node_name(digits, naming.BEST_MODEL))
    print()
    print(f"registered model : {reg.name} version {reg.version} ({'new' if reg.created else 'existing, no duplicate'})")
    print(f"champion         : {reg.champion}")
    print(f"best trial       : {best.trial} params {best.params}")
    print(f"test accuracy    : {reg.metrics['test_acc']:.4f}")
    print(f"Dagster runs     : make ui, then open http://127.0.0.1:3000/runs (promote run {promote.run_id})")
    print(f"MLflow           : make mlflow-ui, then open http://127.0.0.1:5000/#/models/{reg.name}")
    return 0
