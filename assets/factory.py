"""The six-asset chain every team pipeline gets, built from a `PipelineSpec`.

raw_data -> validated_data -> sweep -> trial_model[trial-NNNN] -> best_model -> registered_model

Assets are thin: they resolve inputs, call a resource and return metadata a
person wants to see. Values passed between assets are small JSON pointers kept
by `ObjectStoreJsonIOManager`; data and models live in the object store.
"""


import os
import tempfile
import time
from typing import Any, Iterator, Optional

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    DataVersion,
    DynamicPartitionsDefinition,
    Failure,
    MetadataValue,
    Config,
    Output,
    RetryRequested,
    asset,
)

from assets import lineage
from assets.promotion import decide_promotion
from pipelines.spec import PipelineSpec
from resources.launcher import Launcher, LaunchError, TrainingPreempted
from resources.registry import ModelRegistry
from resources.storage import ObjectStore
from resources.sweeps import SweepStore
from resources.tracking import Tracking
from resources.versioning import DataVersioning
from training.spec import DataSpec, Distribution, FaultInjection, ImportTarget, OptunaSpec, TrainSpec

CHECK_NAME = "expectations"


class TrialConfig(Config):
    """Run config of a trial: launch-time overrides (the last configuration layer) and fault drills.

    A drill rehearses recovery before a long job: e.g. `drill_kill_rank=1,
    drill_kill_at_step=50` kills a rank mid-epoch; the trial must finish with the
    same weights. Each drill fires once per trial.
    """

    max_epochs: Optional[int] = None
    drill_kill_rank: Optional[int] = None
    drill_kill_at_step: Optional[int] = None
    drill_sigterm_at_step: Optional[int] = None
    drill_corrupt_latest_checkpoint: bool = False
    drill_fail_storage_writes: int = 0

    def faults(self) -> FaultInjection:
        return FaultInjection(
            kill_rank=self.drill_kill_rank,
            kill_at_step=self.drill_kill_at_step,
            sigterm_at_step=self.drill_sigterm_at_step,
            corrupt_latest_checkpoint=self.drill_corrupt_latest_checkpoint,
            fail_storage_writes=self.drill_fail_storage_writes,
        )


def trial_key(number: int) -> str:
    return f"trial-{number:04d}"


def trial_number(key: str) -> int:
    prefix, _, num = key.partition("-")
    if prefix != "trial" or not num.isdigit():
        raise ValueError(f"partition key {key!r} is not a trial key like 'trial-0003'")
    return int(num)


def handle_launch_error(
    context: AssetExecutionContext,
    error: LaunchError,
    spec: PipelineSpec,
    store: ObjectStore,
    sweeps: SweepStore,
    study: str,
    number: int,
    output_uri: str,
) -> None:
    """Fail at once on user errors; re-launch on infrastructure errors and preemption within budget.

    Every launch failure is appended to `<trial>/launches.json` (reset on the
    first attempt of a run), which is the budget's ledger and the record of
    restart causes.
    """
    ledger_uri = f"{output_uri}/launches.json"
    launches = store.read_json(ledger_uri) if context.retry_number > 0 and store.exists(ledger_uri) else []
    launches.append({"retry_number": context.retry_number, "cause": type(error).__name__, "message": str(error)[:1000], "at": time.time()})
    store.write_json(ledger_uri, launches)
    log_tail = MetadataValue.md(f"```\n{error.log_tail}\n```")
    if not error.retryable:
        sweeps.tell(study, number, None, {"error": str(error)[:2000]}, failed=True)
        raise Failure(description=str(error), metadata={"log_tail": log_tail, "retried": False}) from error
    preemptions = sum(1 for x in launches if x["cause"] == TrainingPreempted.__name__)
    infra = len(launches) - preemptions
    budget = spec.retries
    if infra > budget.max_infra_retries or preemptions > budget.max_preemptions:
        sweeps.tell(study, number, None, {"error": str(error)[:2000]}, failed=True)
        raise Failure(
            description=f"{context.partition_key}: giving up after {infra} infrastructure failure(s) (budget {budget.max_infra_retries}) "
            f"and {preemptions} preemption(s) (budget {budget.max_preemptions}); last: {error}",
            metadata={"log_tail": log_tail, "launches": MetadataValue.json(launches)},
        ) from error
    context.log.warning(
        f"{context.partition_key}: {type(error).__name__}: {str(error).splitlines()[0]} -- retrying "
        f"(infrastructure failures {infra}/{budget.max_infra_retries}, preemptions {preemptions}/{budget.max_preemptions}); "
        "the next attempt resumes from the newest committed checkpoint"
    )
    raise RetryRequested(max_retries=context.retry_number + 1, seconds_to_wait=budget.wait_seconds) from error


def trials_partitions(spec: PipelineSpec) -> DynamicPartitionsDefinition:
    return DynamicPartitionsDefinition(name=f"{spec.team}__{spec.name}__trials")


def study_name(spec: PipelineSpec, data_version: str) -> str:
    """One study per pipeline definition and data version: same inputs resume the same sweep."""
    return f"{spec.team}.{spec.name}.{data_version[:12]}.{spec.fingerprint()}"


def build_assets(spec: PipelineSpec) -> list[AssetsDefinition]:
    """The asset definitions of one pipeline, keyed `<team>/<pipeline>/<asset>`."""
    prefix = [spec.team, spec.name]
    group = f"{spec.team}_{spec.name}"
    key = lambda name: AssetKey([*prefix, name])  # noqa: E731
    partitions = trials_partitions(spec)
    code_version = spec.fingerprint()

    @asset(
        key=key("raw_data"),
        group_name=group,
        code_version=code_version,
        description=f"Snapshot of {spec.source.prefix}/{spec.source.pattern} as canonical Parquet, pinned with DVC.",
    )
    def raw_data(context: AssetExecutionContext, store: ObjectStore, versioning: DataVersioning) -> Output[dict]:
        from assets import data_quality as dq

        try:
            table = dq.to_canonical(dq.read_landing(store, spec.source), spec)
        except dq.DataQualityError as e:
            raise Failure(description=f"{spec.key}: raw data rejected: {e}") from e
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, "data.parquet")
            dq.write_parquet_deterministic(table, local)
            pin = versioning.pin(local)
            base = store.uri("data", spec.team, spec.name, "raw", pin.md5)
            store.put_file(local, f"{base}/data.parquet")
        store.write_bytes(f"{base}/data.parquet.dvc", pin.dvc_file.encode())
        value = {"uri": f"{base}/data.parquet", "md5": pin.md5, "rows": table.num_rows, "dvc_file": pin.dvc_file}
        return Output(
            value,
            data_version=DataVersion(pin.md5),
            metadata={
                "dvc_md5": pin.md5,
                "rows": table.num_rows,
                "columns": table.num_columns,
                "bytes": pin.size,
                "uri": MetadataValue.path(value["uri"]),
                "restore": MetadataValue.md(f"`dvc pull` with this pin:\n```\n{pin.dvc_file}```"),
            },
        )

    @asset(
        key=key("validated_data"),
        group_name=group,
        code_version=code_version,
        check_specs=[AssetCheckSpec(CHECK_NAME, asset=key("validated_data"), blocking=True, description="Great Expectations suite and drift")],
        description="Great Expectations suite and drift check, then a deterministic train/val/test split.",
    )
    def validated_data(context: AssetExecutionContext, raw_data: dict, store: ObjectStore) -> Iterator[Any]:
        import pandas as pd

        from assets import data_quality as dq

        with store.open(raw_data["uri"], "rb") as f:
            df = pd.read_parquet(f)
        report = dq.validate(df, spec)
        latest_uri = store.uri("data", spec.team, spec.name, "validated", "latest.json")
        drift: dict[str, float] = {}
        if store.exists(latest_uri):
            previous = store.read_json(latest_uri)
            if previous["md5"] != raw_data["md5"]:
                with store.open(previous["raw_uri"], "rb") as f:
                    drift = dq.drift_report(pd.read_parquet(f), df, spec)
        drifted = {c: v for c, v in drift.items() if spec.max_drift_psi is not None and v > spec.max_drift_psi}
        check_meta = {
            "expectations": report.evaluated,
            "failed": report.failed,
            "results": MetadataValue.md(report.to_markdown()),
            "max_psi": max(drift.values()) if drift else 0.0,
        }
        if not report.success or drifted:
            where = store.uri("quarantine", spec.team, spec.name, raw_data["md5"])
            store.copy(raw_data["uri"], f"{where}/data.parquet")
            store.write_json(
                f"{where}/report.json",
                {"raw": raw_data, "validation": report.model_dump(mode="json"), "drift": drift, "drifted": drifted},
            )
            check_meta["quarantine"] = MetadataValue.path(where)
            yield AssetCheckResult(check_name=CHECK_NAME, passed=False, severity=AssetCheckSeverity.ERROR, metadata=check_meta)
            reasons = [f"{report.failed} of {report.evaluated} expectations failed"] if not report.success else []
            reasons += [f"drift PSI above {spec.max_drift_psi} in {sorted(drifted)}"] if drifted else []
            raise Failure(
                description=f"{spec.key}: data version {raw_data['md5']} rejected ({'; '.join(reasons)}); "
                f"kept in quarantine at {where}",
                metadata=check_meta,
            )
        train, val, test = dq.split(df, spec)
        split_id = f"{raw_data['md5']}-{spec.fingerprint()}"
        base = store.uri("data", spec.team, spec.name, "validated", split_id)
        uris = {}
        for name, part in (("train", train), ("val", val), ("test", test)):
            uris[name] = f"{base}/{name}.parquet"
            with tempfile.TemporaryDirectory() as tmp:
                local = os.path.join(tmp, f"{name}.parquet")
                import pyarrow as pa

                dq.write_parquet_deterministic(pa.Table.from_pandas(part, preserve_index=False), local)
                store.put_file(local, uris[name])
        store.write_json(latest_uri, {"md5": raw_data["md5"], "raw_uri": raw_data["uri"]})
        yield AssetCheckResult(check_name=CHECK_NAME, passed=True, metadata=check_meta)
        value = {"md5": raw_data["md5"], "split_id": split_id, **uris, "rows": {"train": len(train), "val": len(val), "test": len(test)}}
        yield Output(
            value,
            data_version=DataVersion(split_id),
            metadata={"train_rows": len(train), "val_rows": len(val), "test_rows": len(test), "data_version": raw_data["md5"]},
        )

    @asset(
        key=key("sweep"),
        group_name=group,
        code_version=code_version,
        description=f"Optuna study of {spec.search.n_trials} trial(s); registers them as partitions of trial_model.",
    )
    def sweep(context: AssetExecutionContext, validated_data: dict, sweeps: SweepStore) -> Output[dict]:
        name = study_name(spec, validated_data["md5"])
        study = sweeps.load_or_create(name, spec.model.monitor_mode, spec.search)
        numbers = sweeps.ensure_trials(study, spec.search)
        keys = [trial_key(n) for n in numbers]
        existing = set(context.instance.get_dynamic_partitions(partitions.name))
        new = [k for k in keys if k not in existing]
        if new:
            context.instance.add_dynamic_partitions(partitions.name, new)
        rows = [(t.number, t.state.name, t.value, t.params) for t in study.get_trials(deepcopy=False)]
        table = "| trial | state | value | params |\n|---|---|---|---|\n" + "\n".join(
            f"| {trial_key(n)} | {s} | {'' if v is None else f'{v:.4f}'} | {p} |" for n, s, v, p in rows
        )
        return Output(
            {"study": name, "trials": keys, "data_md5": validated_data["md5"]},
            metadata={"study": name, "storage": sweeps.storage_url.split("?")[0], "trials": len(keys), "new_partitions": len(new), "table": MetadataValue.md(table)},
        )

    @asset(
        key=key("trial_model"),
        group_name=group,
        code_version=code_version,
        partitions_def=partitions,
        description="One Optuna trial trained by the launcher (torchrun) from a TrainSpec.",
    )
    def trial_model(
        context: AssetExecutionContext,
        config: TrialConfig,
        validated_data: dict,
        sweep: dict,
        store: ObjectStore,
        launcher: Launcher,
        tracking: Tracking,
        sweeps: SweepStore,
    ) -> Output[dict]:
        number = trial_number(context.partition_key)
        trial = sweeps.trial(sweep["study"], number)
        output_uri = store.uri("runs", spec.team, spec.name, sweep["study"], context.partition_key)
        record = lineage.record(spec, validated_data["md5"], params=trial.params, seed=spec.model.seed)
        record["max_epochs"] = config.max_epochs or spec.model.max_epochs  # run config overrides the spec
        if trial.state.name == "COMPLETE" and store.exists(f"{output_uri}/result.json"):
            context.log.info(f"{context.partition_key} already completed with these inputs; reusing its result")
            result = store.read_json(f"{output_uri}/result.json")
        else:
            train_spec = TrainSpec(
                pipeline=spec.key,
                trial_id=context.partition_key,
                model=ImportTarget(path=spec.model.path, kwargs={**spec.model.hparams, **trial.params}),
                datamodule=ImportTarget(path=spec.model.datamodule),
                data=DataSpec(
                    train_uri=validated_data["train"],
                    val_uri=validated_data["val"],
                    test_uri=validated_data["test"],
                    features=spec.features,
                    target=spec.target,
                    version=validated_data["md5"],
                ),
                output_uri=output_uri,
                max_epochs=config.max_epochs or spec.model.max_epochs,
                batch_size=spec.model.batch_size,
                monitor=spec.model.monitor,
                faults=config.faults(),
                monitor_mode=spec.model.monitor_mode,
                distribution=spec.distribution,
                seed=spec.model.seed,
                checkpoint=spec.checkpoint,
                tracker=tracking.tracker_spec(
                    project=f"{spec.team}-{spec.name}", group=sweep["study"], name=context.partition_key, config=record
                ),
                optuna=OptunaSpec(storage_url=sweeps.storage_url, study_name=sweep["study"], trial_number=number),
                lineage=record,
            )
            try:
                outcome = launcher.launch(train_spec, context=context)
            except LaunchError as e:
                handle_launch_error(context, e, spec, store, sweeps, sweep["study"], number, output_uri)
            result = outcome.result.model_dump(mode="json")
            sweeps.tell(
                sweep["study"],
                number,
                outcome.result.best_metric,
                {"result_uri": f"{output_uri}/result.json", "metrics": outcome.result.metrics},
            )
        value = {"trial": context.partition_key, "number": number, "params": trial.params, "result_uri": f"{output_uri}/result.json", **result}
        return Output(
            value,
            metadata={
                **{k: float(v) for k, v in result["metrics"].items()},
                spec.model.monitor: result["best_metric"],
                "params": MetadataValue.json(trial.params),
                "samples_per_second": result["samples_per_second"],
                "device_hours": result["device_hours"],
                "world_size": result["world_size"],
                "checkpoint": MetadataValue.path(result["checkpoint_uri"] or ""),
                "model": MetadataValue.path(result["model_uri"]),
                "tracker_run": result["tracker_run"] or "",
                "lineage": MetadataValue.json(record),
                "resumed_from": result.get("resumed_from") or "",
                "checkpoint_interval_seconds": result.get("checkpoint_interval_seconds") or 0.0,
                "checkpoint_interval_source": result.get("checkpoint_interval_source") or "",
                "goodput": MetadataValue.json(result.get("goodput") or {}),
            },
        )

    @asset(
        key=key("best_model"),
        group_name=group,
        code_version=code_version,
        deps=[trial_model],
        description="The best finished trial of the sweep, with its held-out test metrics.",
    )
    def best_model(context: AssetExecutionContext, sweep: dict, sweeps: SweepStore, store: ObjectStore) -> Output[dict]:
        study = sweeps.load(sweep["study"])
        done = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
        if not done:
            raise Failure(description=f"{spec.key}: study {sweep['study']} has no completed trial; materialize trial_model partitions first")
        best = max(done, key=lambda t: t.value) if spec.model.monitor_mode == "max" else min(done, key=lambda t: t.value)
        result = store.read_json(best.user_attrs["result_uri"])
        value = {"study": sweep["study"], "trial": trial_key(best.number), "number": best.number, "params": best.params,
                 "value": best.value, "result_uri": best.user_attrs["result_uri"], **result}
        rows = sorted(done, key=lambda t: t.value, reverse=spec.model.monitor_mode == "max")
        table = f"| trial | {spec.model.monitor} | params |\n|---|---|---|\n" + "\n".join(
            f"| {trial_key(t.number)} | {t.value:.4f} | {t.params} |" for t in rows
        )
        return Output(
            value,
            metadata={
                "trial": value["trial"],
                spec.model.monitor: best.value,
                **{k: float(v) for k, v in result["metrics"].items()},
                "completed_trials": len(done),
                "trials": MetadataValue.md(table),
            },
        )

    @asset(
        key=key("registered_model"),
        group_name=group,
        code_version=code_version,
        description="An MLflow model version with lineage tags; alias 'champion' moves only when the new version wins.",
    )
    def registered_model(
        context: AssetExecutionContext, best_model: dict, validated_data: dict, registry: ModelRegistry, store: ObjectStore
    ) -> Output[dict]:
        import pandas as pd

        with store.open(validated_data["test"], "rb") as f:
            test_df = pd.read_parquet(f)
        record = best_model["lineage"]
        tags = {f"trainyard.{k}": str(v) for k, v in lineage.flatten(record).items()}
        tags.update(
            {
                "trainyard.trial": best_model["trial"],
                "trainyard.study": best_model["study"],
                "trainyard.checkpoint_uri": str(best_model["checkpoint_uri"]),
                "trainyard.tracker_run": str(best_model["tracker_run"] or ""),
                "trainyard.validation": "passed",
                "trainyard.test_split": validated_data["split_id"],
            }
        )
        metrics = {k: float(v) for k, v in best_model["metrics"].items()}
        tags.update({f"trainyard.metric.{k}": repr(v) for k, v in metrics.items()})
        version = registry.register(
            spec.model_name,
            best_model["model_uri"],
            trial_key=f"{best_model['study']}/{best_model['trial']}",
            tags=tags,
            metrics=metrics,
            description=lineage.model_card(spec, best_model, validated_data),
            input_example=test_df[spec.features].head(5),
        )
        decision = decide_promotion(spec, registry, version, metrics, test_df, validated_data["split_id"])
        context.log.info(decision.reason)
        return Output(
            {"name": spec.model_name, "version": version.version, "model_uri": version.model_uri, "champion": decision.promoted or decision.already_champion,
             "created": version.created, **metrics},
            metadata={
                "model": spec.model_name,
                "version": version.version,
                "model_uri": version.model_uri,
                "new_version": version.created,
                "champion": decision.promoted or decision.already_champion,
                "decision": decision.reason,
                **metrics,
                "data_version": record.get("data_version", ""),
                "code_version": record.get("code_version", ""),
            },
        )

    return [raw_data, validated_data, sweep, trial_model, best_model, registered_model]
