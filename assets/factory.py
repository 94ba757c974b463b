"""The six-asset chain every team pipeline gets, built from a `PipelineSpec`.

raw_data -> validated_data -> sweep -> trial_model[trial-NNNN] -> best_model -> registered_model

Assets are thin: they resolve inputs, call a resource and return metadata a
person wants to see. Values passed between assets are small JSON pointers kept
by `ObjectStoreJsonIOManager`; data and models live in the object store.
"""


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

from assets import promotion
from trainyard import lineage
from trainyard import planner
from trainyard.spec import PipelineSpec
from resources.handoff import HandoffPublisher
from resources.launcher import Launcher, LaunchError, TrainingPreempted
from resources.registry import ModelRegistry
from resources.storage import ObjectStore
from resources.sweeps import (
    SweepError,
    SweepStore,
    build_report,
    failure_reason,
    objective_values,
    objectives_of,
    pareto_front,
    pick_trial,
    report_metadata,
    study_directions,
    trials_markdown,
)
from resources.tracking import Tracking
from resources.versioning import DataVersioning
from training.spec import DataSpec, Distribution, FaultInjection, ImportTarget, OptunaSpec, PrunerSpec, TrainSpec

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


def trial_comparison(store: ObjectStore, trials: list[Any]) -> str:
    """The `trainyard compare --trials` table (fields that differ between trials) for the UI."""
    from trainyard.compare import render, trial_rows

    results = [store.read_json(t.user_attrs["result_uri"]) for t in trials if "result_uri" in t.user_attrs]
    return render(trial_rows(results), "markdown", only_differences=True)


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
        description=f"Incremental snapshot of {spec.source.prefix}/{spec.source.pattern} as canonical Parquet, pinned with DVC.",
    )
    def raw_data(context: AssetExecutionContext, store: ObjectStore, versioning: DataVersioning) -> Output[dict]:
        from trainyard.data import quality as dq
        from assets import ingest

        try:
            result = ingest.ingest(store, spec, versioning, log=context.log.warning)
        except ingest.IngestRejected as e:
            raise Failure(
                description=f"{spec.key}: raw data rejected: {e}",
                metadata={
                    "files": MetadataValue.md(ingest.records_markdown(e.records)),
                    "quarantine": MetadataValue.path(dq.quarantine_root(store, spec.team, spec.name)),
                },
            ) from e
        except ingest.LandingFileChanged as e:
            raise Failure(description=f"{spec.key}: landing data is still changing, try again once uploads finish: {e}") from e
        except dq.DataQualityError as e:
            raise Failure(description=f"{spec.key}: raw data rejected: {e}") from e
        snap = result.snapshot
        value = {"uri": snap.uri, "md5": snap.md5, "rows": snap.rows, "dvc_file": snap.dvc_file, "files": len(snap.files), "warnings": result.warnings}
        return Output(
            value,
            data_version=DataVersion(snap.md5),
            metadata={
                "dvc_md5": snap.md5,
                "rows": snap.rows,
                "columns": len(spec.columns),
                "files": len(snap.files),
                "new_files": len(result.ingested),
                "rejected_files": len(result.rejected),
                "reused_snapshot": result.reused_snapshot,
                "warnings": len(result.warnings),
                "ingest": MetadataValue.md(result.files_markdown()),
                "uri": MetadataValue.path(snap.uri),
                "manifest": MetadataValue.path(ingest.manifest_uri(store, spec)),
                "restore": MetadataValue.md(f"`dvc pull` with this pin:\n```\n{snap.dvc_file}```"),
            },
        )

    @asset(
        key=key("validated_data"),
        group_name=group,
        code_version=code_version,
        check_specs=[AssetCheckSpec(CHECK_NAME, asset=key("validated_data"), blocking=True, description="Great Expectations suite, platform checks and drift")],
        description="Great Expectations suite, platform checks and drift, then a deterministic train/val/test split.",
    )
    def validated_data(context: AssetExecutionContext, raw_data: dict, store: ObjectStore) -> Iterator[Any]:
        from trainyard.data import quality as dq
        from trainyard.data.expectations import UnsupportedExpectation

        try:
            outcome = dq.validate_version(store, spec, raw_data)
        except (dq.DataQualityError, UnsupportedExpectation) as e:
            raise Failure(description=f"{spec.key}: cannot validate data version {raw_data['md5']}: {e}") from e
        report, verdict = outcome.validation.report, outcome.verdict
        check_meta: dict[str, Any] = {
            "expectations": report.evaluated,
            "failed": report.failed,
            "rows": report.rows,
            "policy": spec.on_bad_data,
            "results": MetadataValue.md(report.to_markdown()),
            "failing_rows": MetadataValue.md(report.failing_rows_markdown()),
            "drift": MetadataValue.md(dq.drift_markdown(outcome.drift, spec)),
            "max_psi": max((d["psi"] for d in outcome.drift if d["psi"] is not None), default=0.0),
            "max_ks": max((d["ks"] for d in outcome.drift if d["ks"] is not None), default=0.0),
            "data_docs": MetadataValue.path(outcome.docs_uri),
        }
        if not verdict.accepted:
            check_meta["quarantine"] = MetadataValue.path(outcome.quarantine)
            yield AssetCheckResult(check_name=CHECK_NAME, passed=False, severity=AssetCheckSeverity.ERROR, metadata=check_meta)
            raise Failure(
                description=f"{spec.key}: data version {raw_data['md5']} rejected ({'; '.join(verdict.reasons[:6])}); "
                f"kept in quarantine at {outcome.quarantine}",
                metadata=check_meta,
            )
        if verdict.warnings:
            # The rows that go on passed every row-level check; what did not is set aside or released.
            for line in verdict.warnings:
                context.log.warning(f"{spec.key}: {line}")
            check_meta["warnings"] = MetadataValue.md("\n".join(f"- {w}" for w in verdict.warnings))
        if outcome.quarantine:
            check_meta["set_aside"] = MetadataValue.path(outcome.quarantine)
        if verdict.release:
            check_meta["released_by"] = verdict.release["released_by"]
            check_meta["release_reason"] = verdict.release["reason"]
        yield AssetCheckResult(check_name=CHECK_NAME, passed=True, metadata=check_meta)
        value = outcome.value
        assert value is not None
        yield Output(
            value,
            data_version=DataVersion(value["split_id"]),
            metadata={
                "train_rows": value["rows"]["train"],
                "val_rows": value["rows"]["val"],
                "test_rows": value["rows"]["test"],
                "set_aside_rows": value["set_aside"],
                "data_version": raw_data["md5"],
                "profile": MetadataValue.path(value["profile"]),
            },
        )

    @asset(
        key=key("sweep"),
        group_name=group,
        code_version=code_version,
        description=f"Optuna study of {spec.search.n_trials} trial(s), {spec.search.window} in flight; registers them as "
        "partitions of trial_model (the sweep sensor asks the rest) and reports best parameters, history and importance.",
    )
    def sweep(
        context: AssetExecutionContext, validated_data: dict, sweeps: SweepStore, store: ObjectStore, tracking: Tracking
    ) -> Output[dict]:
        name = study_name(spec, validated_data["md5"])
        study = sweeps.load_or_create(name, study_directions(spec), spec.search)
        numbers = sweeps.ensure_trials(study, spec.search)
        keys = [trial_key(n) for n in numbers]
        existing = set(context.instance.get_dynamic_partitions(partitions.name))
        new = [k for k in keys if k not in existing]
        if new:
            context.instance.add_dynamic_partitions(partitions.name, new)
        report = build_report(sweeps, study, spec)
        meta = report_metadata(report, store, store.uri("reports", spec.team, spec.name, name), objectives_of(spec))
        if report.status.stop_reason:
            context.log.warning(f"{spec.key}: sweep {name} stopped: {report.status.stop_reason}")
        wandb = {"wandb_project": f"{spec.team}-{spec.name}", "wandb_group": name, "wandb_mode": tracking.resolved_mode()}
        if tracking.resolved_mode() == "online" and tracking.entity:
            wandb["wandb_url"] = MetadataValue.url(f"https://wandb.ai/{tracking.entity}/{spec.team}-{spec.name}/groups/{name}")
        return Output(
            {"study": name, "trials": keys, "data_md5": validated_data["md5"]},
            metadata={"study": name, "storage": sweeps.storage_url.split("?")[0], "trials": len(keys), "new_partitions": len(new), **meta, **wandb},
        )

    @asset(
        key=key("trial_model"),
        group_name=group,
        code_version=code_version,
        partitions_def=partitions,
        pool=spec.gpu_pool,  # per-team limit on trials training at once (TeamSpec.gpu_pool_limit)
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
        # The capacity plan (strategy 'auto' resolved here, before any TrainSpec exists), shown for every trial.
        plan = planner.plan_trial(spec, {**spec.model.hparams, **trial.params}, lambda: planner.count_classes(spec, validated_data, store), launcher)
        record["strategy"] = plan.distribution.strategy
        if trial.state.name in ("COMPLETE", "PRUNED") and store.exists(f"{output_uri}/result.json"):
            context.log.info(f"{context.partition_key} already {trial.state.name.lower()} with these inputs; reusing its result")
            result = store.read_json(f"{output_uri}/result.json")
        elif trial.state.name in ("FAIL", "PRUNED"):
            raise Failure(
                description=f"{context.partition_key}: trial {number} of study {sweep['study']} is {trial.state.name} "
                f"({failure_reason(trial) if trial.state.name == 'FAIL' else 'stopped early by the pruner'}) and has no result; "
                "finished trials are not trained again (the sweep asks a new trial in its place)"
            )
        else:
            if plan.error:
                sweeps.tell(sweep["study"], number, None, {"error": plan.error[:2000]}, failed=True)
                raise Failure(description=f"{context.partition_key}: {plan.error}", metadata=plan.metadata())
            for warning in plan.warnings:
                context.log.warning(f"{context.partition_key}: {warning}")
            train_spec = TrainSpec(
                pipeline=spec.key,
                trial_id=context.partition_key,
                task=spec.model.task,
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
                distribution=plan.distribution,
                seed=spec.model.seed,
                checkpoint=spec.checkpoint,
                tracker=tracking.tracker_spec(
                    project=f"{spec.team}-{spec.name}", group=sweep["study"], name=context.partition_key, config=record
                ),
                optuna=OptunaSpec(
                    storage_url=sweeps.storage_url,
                    study_name=sweep["study"],
                    trial_number=number,
                    # A finished trial (retrained because its result is gone) takes no more reports.
                    pruner=spec.search.pruner if trial.state.name == "RUNNING" else PrunerSpec(),
                ),
                lineage=record,
            )
            try:
                with sweeps.heartbeat(sweep["study"], number):
                    outcome = launcher.launch(train_spec, context=context)
            except LaunchError as e:
                handle_launch_error(context, e, spec, store, sweeps, sweep["study"], number, output_uri)
            result = outcome.result.model_dump(mode="json")
            attrs = {"result_uri": f"{output_uri}/result.json", "metrics": outcome.result.metrics}
            if outcome.result.status == "pruned" or sweeps.trial(sweep["study"], number).state.name == "PRUNED":
                sweeps.tell(sweep["study"], number, None, attrs, pruned=True)
                result["status"] = "pruned"
            else:
                needs_size = any(o.metric == "model_bytes" for o in objectives_of(spec))
                model_bytes = sum(f.size for f in store.list_files(f"{result['model_uri']}/**")) if needs_size else None
                try:
                    values = objective_values(result, objectives_of(spec), spec.model.monitor, model_bytes)
                except SweepError as e:
                    sweeps.tell(sweep["study"], number, None, {**attrs, "error": str(e)}, failed=True)
                    raise Failure(description=f"{context.partition_key}: {e}") from e
                result["objectives"] = dict(zip([o.metric for o in objectives_of(spec)], values))
                sweeps.tell(sweep["study"], number, values if spec.search.multi_objective else values[0], attrs)
        value = {"trial": context.partition_key, "number": number, "params": trial.params, "result_uri": f"{output_uri}/result.json", **result}
        pruned = result.get("status") == "pruned"
        return Output(
            value,
            metadata={
                "status": result.get("status", "completed"),
                **({"pruned_at_epoch": result["epochs"]} if pruned else {}),
                **{f"objective_{k}": float(v) for k, v in (result.get("objectives") or {}).items()},
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
                **plan.metadata(),
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
        trials = study.get_trials(deepcopy=False)
        done = [t for t in trials if t.state.name == "COMPLETE"]
        if not done:
            raise Failure(description=f"{spec.key}: study {sweep['study']} has no completed trial; materialize trial_model partitions first")
        objectives = objectives_of(spec)
        extra: dict[str, Any] = {}
        if spec.search.multi_objective:
            front = pareto_front(trials, [o.mode for o in objectives])
            try:
                best, reason = pick_trial(front, objectives, spec.search.pick)
            except SweepError as e:
                raise Failure(description=f"{spec.key}: study {sweep['study']}: {e}; relax search.pick.limits") from e
            extra = {"pareto_front": MetadataValue.md(trials_markdown(front, objectives, limit=len(front))), "pareto_size": len(front)}
        else:
            sign = 1.0 if spec.model.monitor_mode == "max" else -1.0
            best = max(done, key=lambda t: (sign * t.values[0], -t.number))
            reason = f"best {spec.model.monitor} ({spec.model.monitor_mode}) of {len(done)} completed trial(s)"
        result = store.read_json(best.user_attrs["result_uri"])
        value = {"study": sweep["study"], "trial": trial_key(best.number), "number": best.number, "params": best.params,
                 "value": best.values[0], "values": list(best.values), "result_uri": best.user_attrs["result_uri"], **result}
        rows = sorted(done, key=lambda t: t.values[0], reverse=objectives[0].mode == "max")
        table = f"| trial | {', '.join(o.metric for o in objectives)} | params |\n|---|---|---|\n" + "\n".join(
            f"| {trial_key(t.number)} | {', '.join(f'{v:.4f}' for v in t.values)} | {t.params} |" for t in rows
        )
        return Output(
            value,
            metadata={
                "trial": value["trial"],
                spec.model.monitor: result["best_metric"],
                **{f"objective_{o.metric}": float(v) for o, v in zip(objectives, best.values)},
                **{k: float(v) for k, v in result["metrics"].items()},
                "completed_trials": len(done),
                "pick": reason,
                "trials": MetadataValue.md(table),
                "comparison": MetadataValue.md(trial_comparison(store, rows)),
                **extra,
            },
        )

    @asset(
        key=key("registered_model"),
        group_name=group,
        code_version=code_version,
        description="An MLflow model version with lineage tags and a model card; it becomes 'challenger', and "
        "'champion' only when the pipeline's promotion policy passes (metric vs threshold and champion on the same "
        "test split, data validation, serving smoke test). Champion changes are published as handoff events.",
    )
    def registered_model(
        context: AssetExecutionContext,
        best_model: dict,
        validated_data: dict,
        registry: ModelRegistry,
        store: ObjectStore,
        handoff: HandoffPublisher,
    ) -> Output[dict]:
        import pandas as pd

        metrics = {k: float(v) for k, v in best_model["metrics"].items()}
        if spec.promotion.metric not in metrics:
            raise Failure(
                description=f"{spec.key}: promotion.metric {spec.promotion.metric!r} is not among the trial's metrics "
                f"{sorted(metrics)}; declare one of them in PromotionSpec(metric=...)"
            )
        with store.open(validated_data["test"], "rb") as f:
            test_df = pd.read_parquet(f)
        validation = promotion.validation_evidence(
            context.instance, key("validated_data"), CHECK_NAME, validated_data["md5"],
            promotion.is_quarantined(store, spec.key, validated_data["md5"]),
        )
        record = best_model["lineage"]
        tags = {f"trainyard.{k}": str(v) for k, v in lineage.flatten(record).items()}
        tags.update(
            {
                "trainyard.trial": best_model["trial"],
                "trainyard.study": best_model["study"],
                "trainyard.checkpoint_uri": str(best_model["checkpoint_uri"]),
                "trainyard.tracker_run": str(best_model["tracker_run"] or ""),
                promotion.TEST_SPLIT_TAG: validated_data["split_id"],
                promotion.TEST_URI_TAG: validated_data["test"],
                promotion.TARGET_TAG: spec.target,
                promotion.POLICY_TAG: spec.promotion.model_dump_json(),
                **validation.tags(),
            }
        )
        tags.update({f"{promotion.METRIC_TAG}{k}": repr(v) for k, v in metrics.items()})
        version = registry.register(
            spec.model_name,
            best_model["model_uri"],
            trial_key=f"{best_model['study']}/{best_model['trial']}",
            tags=tags,
            metrics=metrics,
            description=promotion.model_card(spec, best_model, validated_data, validation),
            input_example=test_df[spec.features].head(5),
        )
        candidate = promotion.Candidate(
            version=version, policy=spec.promotion, metrics=metrics, split_id=validated_data["split_id"],
            test_df=test_df[[*spec.features, spec.target]], target=spec.target, validation=validation,
        )
        decision = promotion.decide(registry, handoff, candidate, action="register", decided_by=f"dagster run {context.run_id}")
        context.log.info(f"{spec.model_name} v{version.version}: {decision.outcome}: {decision.reason}")
        return Output(
            {"name": spec.model_name, "version": version.version, "model_uri": version.model_uri, "champion": decision.champion,
             "created": version.created, "decision": decision.outcome, **metrics},
            metadata={
                "model": spec.model_name,
                "version": version.version,
                "model_uri": version.model_uri,
                "new_version": version.created,
                **decision.metadata(),
                **metrics,
                "data_version": record.get("data_version", ""),
                "code_version": record.get("code_version", ""),
                "validation": validation.detail,
            },
        )

    return [raw_data, validated_data, sweep, trial_model, best_model, registered_model]
