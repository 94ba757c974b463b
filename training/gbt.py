"""The `gbt` task: a LightGBM trial, run by `training.entrypoint` in one process.

Same contract as a Lightning trial: read the Parquet splits of `spec.data`,
train, evaluate the best iteration on the full validation and test splits,
export a serving model and return a `TrainResult` (the entrypoint writes it).
The splits and parameters are read and checked first, in `training.gbt_inputs`.

- Objective: `spec.model.kwargs["objective"]` when given (binary, multiclass,
  multiclassova or a regression objective; it must fit `spec.prediction_task`
  when that is set), otherwise from the task: `regression`, or `binary` with two
  classes and `multiclass` with more. Without a task the target column's type
  decides: float -> regression; int, str or bool -> classification.
- Parameters: every other key of `spec.model.kwargs` goes to LightGBM, except
  `early_stopping_rounds` (platform, default 20). Boosting rounds are
  `spec.max_epochs`; `seed` and `deterministic` come from the spec.
- Monitored metric (`spec.monitor`): `val_acc`, `val_roc_auc`, `val_pr_auc`,
  `val_f1`, `val_balanced_acc` (max) or `val_logloss` (min) for classification,
  `val_rmse` or `val_mae` (min) for regression. Early stopping, the best
  iteration, Optuna reports and `best_metric` all use it.
- Features: the platform's preprocessing (`training.preprocessing`, fitted on the
  train split) turns categoricals into LightGBM's native categorical features
  and dates into their parts; missing numbers stay NaN (LightGBM's own handling).
  `class_weight="balanced"` weighs each training row by its class.
- Final metrics (`training.metrics`): on the full validation and test splits,
  with the train prior's (`baseline_*`) beside them.
- Checkpoint: the LightGBM model file `<output>/checkpoints/model.txt` with every
  iteration so far, plus `state.json` holding the monitored value per iteration;
  each is written atomically (`training.storage.write_atomic`). A new attempt continues
  boosting from the model file (`init_model`); iterations the state file does not
  cover yet are re-scored from the model, so early stopping resumes exactly.
  Saves happen every `checkpoint.every_n_steps` iterations, else every
  `checkpoint.every_seconds` (default 30 s), at the end, and on SIGTERM (then the
  process exits as preempted).
- Pruning: with `spec.optuna`, the monitored value is reported to the trial every
  `REPORT_EVERY` iterations; when the study's pruner says so, boosting stops and the run
  still exports its best iteration and writes `result.json` with status `pruned`. The
  pod never ends the trial: the orchestrator, reading the result, tells the study PRUNED
  with the result's location and metrics (`assets.sweeps.trials.tell_result`), as for a
  Lightning trial, so a pruned trial keeps its results (`trainyard compare --trials`).
- Serving model: `<output>/model/model.txt` (the best iteration only),
  `preprocessing.json` (the fitted state) and `meta.json` with
  `"format": "lightgbm"`, served by `training/serving_model.py`.

Continuing from a model file reproduces an uninterrupted run exactly when no
row or feature subsampling is used (`bagging_fraction`, `feature_fraction` at
1.0): LightGBM restarts its sampling generators on a new `train` call.

Example:
    >>> spec = TrainSpec(pipeline="tabular/breast_cancer", trial_id="trial-0000", task="gbt",
    ...                  model=ImportTarget(path="lightgbm:train", kwargs={"num_leaves": 15}),
    ...                  data=data, output_uri="/runs/trial-0000", max_epochs=200)
    >>> run_gbt(spec).metrics["test_acc"]
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import fsspec
import lightgbm as lgb
import numpy as np

from training import metrics, preprocessing
from training.attempts import AttemptLog, FaultMarkers, attempt_id, goodput, private_wandb_unless_first, read_attempts
from training.errors import ConfigError, Preempted
from training.gbt_inputs import Splits, lightgbm_params, load_splits, resolve_objective
from training.pruners import build_pruner, open_trial_storage
from training.reporting import Reporter
from training.spec import CHECKPOINT_DIR, OptunaSpec, TrainResult, TrainSpec, redact_url
from training.storage import read_text, write_atomic
from training.threads import trial_threads

log = logging.getLogger("trainyard.training")

MODEL_FILE = "model.txt"
STATE_FILE = "state.json"
META_FILE = "meta.json"
SERVING_FORMAT = "lightgbm"
DEFAULT_SAVE_SECONDS = 30.0
HEARTBEAT_SECONDS = 2.0
# Optuna reports every this many iterations: a report is an RDB write (~20 ms on SQLite), and
# pruners compare trials at equal steps, so the interval is fixed rather than timed.
REPORT_EVERY = 10


# -- metrics ----------------------------------------------------------------------------


def predict_labels(pred: np.ndarray) -> np.ndarray:
    """Class indices from LightGBM's transformed predictions (probabilities)."""
    return pred.argmax(axis=1) if pred.ndim == 2 else (pred > 0.5).astype("int64")


def probabilities(pred: np.ndarray) -> np.ndarray:
    """Class probabilities `[n, K]` from LightGBM's predictions (binary: the probability of class 1)."""
    return pred if pred.ndim == 2 else np.column_stack([1.0 - pred, pred])


def metric_value(name: str, pred: np.ndarray, y: np.ndarray, positive: int = 1) -> float:
    """`acc`, `logloss`, `roc_auc`, `pr_auc`, `f1`, `balanced_acc`, `rmse` or `mae` of predictions `pred` (as
    `Booster.predict` returns them)."""
    if name == "acc":
        return float((predict_labels(pred) == y).mean())
    if name == "logloss":
        p = pred[np.arange(len(y)), y] if pred.ndim == 2 else np.where(y == 1, pred, 1.0 - pred)
        return float(-np.log(np.clip(p, 1e-15, 1.0)).mean())
    if name == "rmse":
        return float(math.sqrt(np.mean((pred - y) ** 2)))
    if name == "mae":
        return float(np.mean(np.abs(pred - y)))
    if name in metrics.CLASSIFICATION:
        proba = probabilities(pred)
        value = metrics.classification_metrics(y, proba, list(range(proba.shape[1])), positive).get(name)
        return float("nan") if value is None else value  # undefined (one class in the split): never the best
    raise ValueError(f"unknown metric {name!r}")


def evaluate(booster: Any, splits: Splits, iteration: int) -> dict[str, float]:
    """The platform's metrics (`training.metrics`) on the full validation and test splits, and the train prior's beside
    them."""
    out = {}
    for split in ("val", "test"):
        pred = booster.predict(splits.x[split], num_iteration=iteration)
        y = splits.y[split]
        if splits.task == "classification":
            values = metrics.classification_metrics(y, probabilities(pred), splits.classes, splits.positive)
            baseline = metrics.baseline_classification(y, splits.y["train"], splits.classes, splits.positive)
            values.update(
                {n: metric_value(n, pred, y) for n in ("acc", "logloss")}
            )  # exactly as before the other metrics
        else:
            values = metrics.regression_metrics(y, pred)
            baseline = metrics.baseline_regression(y, splits.y["train"])
            values["rmse"] = metric_value("rmse", pred, y)
        out.update(metrics.split_metrics(split, values, baseline))
    return out


# -- checkpoint -------------------------------------------------------------------------


class ModelFileCheckpoint:
    """`model.txt` (the whole model so far) and `state.json` (monitored value per iteration)."""

    def __init__(self, directory_uri: str) -> None:
        self.model_uri = f"{directory_uri.rstrip('/')}/{MODEL_FILE}"
        self.state_uri = f"{directory_uri.rstrip('/')}/{STATE_FILE}"
        self.blocking_seconds = 0.0
        self.saves = 0

    def save(self, booster: Any, history: list[float]) -> None:
        started = time.perf_counter()
        text = booster.model_to_string(num_iteration=-1)
        write_atomic(self.model_uri, text.encode())
        # The state lags the model on a crash between the two writes; `load` re-scores the gap.
        state = {
            "iterations": booster.current_iteration(),
            "history": history,
            "model_sha256": hashlib.sha256(text.encode()).hexdigest(),
        }
        write_atomic(self.state_uri, json.dumps(state).encode())
        self.blocking_seconds += time.perf_counter() - started
        self.saves += 1

    def load(self) -> tuple[Optional[Any], list[float]]:
        """The saved booster (or None) and the monitored values the state file holds for it."""
        text = read_text(self.model_uri)
        if text is None:
            return None, []
        try:
            booster = lgb.Booster(model_str=text)
        except lgb.basic.LightGBMError as e:
            log.warning("checkpoint %s is unreadable (%s); starting from scratch", self.model_uri, e)
            return None, []
        state_text = read_text(self.state_uri)
        history: list[float] = []
        if state_text is not None:
            # Trees are only ever appended, so the first n values describe the first n iterations of this model.
            history = list(json.loads(state_text).get("history", []))[: booster.current_iteration()]
        return booster, history


# -- the training loop --------------------------------------------------------------------


class OptunaReporter:
    """Reports the monitored value to the spec's Optuna trial and asks its declared pruner (single process: no
    broadcast).

    Made only when the pipeline declares a pruner (`spec.pruner.enabled`), as for Lightning trials: the
    study is loaded with that pruner, never Optuna's default `MedianPruner`.
    """

    def __init__(self, spec: OptunaSpec, max_rounds: Optional[int] = None) -> None:
        import optuna  # loaded only for trials of a sweep

        try:
            storage_url = spec.connect_url()  # credentials only by reference: from the environment, never the spec
        except ValueError as e:
            raise ConfigError(str(e)) from e
        study_name, number = spec.study_name, spec.trial_number
        storage = open_trial_storage(storage_url)
        try:
            self.study = optuna.load_study(
                study_name=study_name, storage=storage, pruner=build_pruner(spec.pruner, max_rounds)
            )
        except KeyError as e:
            raise ConfigError(
                f"optuna study {study_name!r} does not exist in {redact_url(storage_url.split('?')[0])}"
            ) from e
        self.number = number
        trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study_name), number)
        self.active = not storage.get_trial(trial_id).state.is_finished()
        self.trial = optuna.trial.Trial(self.study, trial_id)

    def should_prune(self, value: float, step: int) -> bool:
        if not self.active:
            return False
        self.trial.report(value, step)
        return self.trial.should_prune()


class _Loop:
    """The LightGBM callback: monitor, early stopping, pruning, progress, checkpoints, preemption, faults."""

    order = 100  # after LightGBM's own callbacks

    def __init__(
        self,
        spec: TrainSpec,
        patience: int,
        history: list[float],
        ckpt: ModelFileCheckpoint,
        attempt: AttemptLog,
        reporter: Reporter,
        optuna: Optional[OptunaReporter],
    ) -> None:
        self.markers = FaultMarkers(spec.output_uri)
        self.spec = spec
        self.patience = patience
        self.history: list[float] = []
        self.better = (lambda a, b: a > b) if spec.monitor_mode == "max" else (lambda a, b: a < b)
        self.best: tuple[int, Optional[float]] = (0, None)  # (1-based best iteration, its value)
        for value in history:
            self._observe(value)
        self.ckpt = ckpt
        self.attempt = attempt
        self.reporter = reporter
        self.optuna = optuna
        self.policy = spec.checkpoint
        self.save_every_seconds = self.policy.every_seconds or DEFAULT_SAVE_SECONDS
        self.last_save = (time.monotonic(), len(history))
        self.pruned_at: Optional[int] = None
        self.preempt_requested = False
        self._tick = time.perf_counter()

    def _observe(self, value: float) -> None:
        self.history.append(value)
        if self.best[1] is None or self.better(value, self.best[1]):
            self.best = (len(self.history), value)

    def start(self) -> None:
        self._tick = time.perf_counter()

    def __call__(self, env: Any) -> None:
        rec = self.attempt.record
        now = time.perf_counter()
        rec["productive_seconds"] += now - self._tick
        rec["steps"] += 1
        if rec["first_step_at"] is None:
            rec["first_step_at"] = time.time() - (now - self._tick)
        it = env.iteration + 1
        rec["last_step"] = it
        value = float(next(r[2] for r in env.evaluation_result_list if r[0] == "val"))
        self._observe(value)
        best_i, best_v = self.best
        if it % self.spec.log_every_n_steps == 0 or it == env.end_iteration:
            self.reporter.progress({"epoch": it, "max_epochs": env.end_iteration, "step": it,
                                    "metrics": {self.spec.monitor: value, f"best_{self.spec.monitor}": best_v}})
        self._inject(it)
        stop = it - best_i >= self.patience
        if self.optuna is not None and not stop and it % REPORT_EVERY == 0 and self.optuna.should_prune(value, it):
            self.pruned_at = it
            self.reporter.info(
                f"trial {self.spec.trial_id}: pruned at iteration {it} ({self.spec.monitor}={value:.4f})"
            )
            stop = True
        if self.preempt_requested:
            self._save(env.model, it)
            self.attempt.update(force=True, last_step=it, status="preempted")

            raise Preempted(f"SIGTERM: model file at iteration {it} committed")
        if self._save_due(it):
            self._save(env.model, it)
        self.attempt.update(last_step=it)
        self._tick = time.perf_counter()
        if stop:
            assert best_v is not None  # `_observe(value)` above recorded at least one value
            raise lgb.callback.EarlyStopException(
                best_i - 1, [("val", self.spec.monitor, best_v, self.spec.monitor_mode == "max")]
            )

    def _save_due(self, it: int) -> bool:
        if self.policy.every_n_steps is not None:
            return it - self.last_save[1] >= self.policy.every_n_steps
        return time.monotonic() - self.last_save[0] >= self.save_every_seconds

    def _save(self, booster: Any, it: int) -> None:
        self.ckpt.save(booster, self.history)
        self.attempt.record["checkpoint_blocking_seconds"] = self.ckpt.blocking_seconds
        self.last_save = (time.monotonic(), it)
        self.attempt.update(force=True, last_step=it)

    def finish(self, booster: Any) -> None:
        if self.last_save[1] != len(self.history):
            self._save(booster, len(self.history))

    def _inject(self, it: int) -> None:
        f = self.spec.faults
        if f.raise_at_step == it and not self.markers.fired("raise"):
            self.markers.mark("raise")
            raise RuntimeError(f"injected fault at iteration {it}")
        if f.kill_at_step == it and f.kill_rank == 0 and not self.markers.fired("kill"):
            self.markers.mark("kill")
            log.warning("fault injection: SIGKILL at iteration %d", it)
            os.kill(os.getpid(), signal.SIGKILL)
        if f.sigterm_at_step == it and not self.markers.fired("sigterm"):
            self.markers.mark("sigterm")
            agent = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else os.getpid()
            log.warning(
                "fault injection: SIGTERM %s at iteration %d",
                "the launcher agent" if agent != os.getpid() else "this process",
                it,
            )
            os.kill(agent, signal.SIGTERM)
            deadline = time.monotonic() + 5.0
            while not self.preempt_requested and time.monotonic() < deadline:
                time.sleep(0.05)  # the agent forwards SIGTERM to this process


def _replay(booster: Any, history: list[float], score_at: Callable[[Any, int], float]) -> list[float]:
    """Monitored values of iterations the state file missed, re-scored from the model."""
    return history + [score_at(booster, i) for i in range(len(history) + 1, booster.current_iteration() + 1)]


def export_model(
    booster: Any, best_iteration: int, spec: TrainSpec, splits: Splits, objective: str, dest_uri: str
) -> None:
    """Write `model.txt` (best iteration only) and `meta.json` for `training/serving_model.py`."""
    meta: dict[str, Any] = {
        "format": SERVING_FORMAT,
        "features": spec.data.features,
        "target": spec.data.target,
        "task": splits.task,
        "objective": objective,
        "best_iteration": best_iteration,
        "preprocessing": preprocessing.STATE_FILE,
        "inputs": splits.feature_names,
        "keep": spec.data.keep,
        "feature_types": spec.data.feature_types,
    }
    if splits.task == "classification":
        meta["classes"] = splits.classes
        meta["positive_label"] = splits.classes[splits.positive] if len(splits.classes) == 2 else None
    with tempfile.TemporaryDirectory() as tmp:
        booster.save_model(os.path.join(tmp, MODEL_FILE), num_iteration=best_iteration)
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        with open(os.path.join(tmp, preprocessing.STATE_FILE), "w") as f:
            json.dump(splits.preprocessing, f, indent=2, sort_keys=True)
        fs, path = fsspec.core.url_to_fs(dest_uri)
        fs.makedirs(path, exist_ok=True)
        for name in (MODEL_FILE, META_FILE, preprocessing.STATE_FILE):
            fs.put_file(os.path.join(tmp, name), f"{path}/{name}")


def _tracker(spec: TrainSpec) -> Any:
    t = spec.tracker
    if t.kind == "none" or t.mode == "disabled":
        return None
    import wandb  # loaded only when the trial is tracked

    os.environ.setdefault("WANDB_SILENT", "true")
    private_wandb_unless_first(spec.output_uri, t.mode)
    if t.dir:
        os.makedirs(t.dir, exist_ok=True)
    return wandb.init(
        project=t.project, entity=t.entity, group=t.group, name=t.name, dir=t.dir, mode=t.mode,
        id=t.name and f"{t.group or t.project}-{t.name}".replace("/", "-")[:64], resume="allow",
        config={**t.config, "trial_id": spec.trial_id, "task": "gbt"},
    )


def run_gbt(spec: TrainSpec) -> TrainResult:
    """Train one LightGBM trial; see the module docstring. Called by `training.entrypoint.train`.

    Raises:
        ConfigError: the spec cannot work (bad objective, parameter or monitor, missing data).
        training.errors.Preempted: SIGTERM arrived; the model file was committed first.
    """
    started_wall, started = time.time(), time.perf_counter()
    out = spec.output_uri.rstrip("/")
    objective = resolve_objective(spec.model.kwargs)
    splits = load_splits(spec, objective)
    params, patience = lightgbm_params(spec, splits, objective, threads=trial_threads())
    val_metric = _val_metric(spec, splits)
    ckpt = ModelFileCheckpoint(f"{out}/{CHECKPOINT_DIR}")
    init_model, history = ckpt.load()
    attempt = AttemptLog(out, attempt_id(started_wall), started_wall, every=HEARTBEAT_SECONDS)
    done = 0
    if init_model is not None:
        history = _replay(
            init_model, history, lambda booster, i: val_metric(booster.predict(splits.x["val"], num_iteration=i))
        )
        done = init_model.current_iteration()
        attempt.record.update(resumed_from=ckpt.model_uri, resumed_from_step=done)
    # Raw data is kept: continuing from a model file scores it with that model first.
    train_set = lgb.Dataset(
        splits.x["train"],
        label=splits.y["train"],
        weight=splits.weights,
        feature_name=splits.feature_names,
        categorical_feature=splits.categorical or "auto",
        params=params,
        free_raw_data=False,
    )
    val_set = lgb.Dataset(splits.x["val"], label=splits.y["val"], reference=train_set, free_raw_data=False)
    optuna = OptunaReporter(spec.optuna, spec.max_epochs) if spec.optuna and spec.optuna.pruner.enabled else None
    tracker = _tracker(spec)
    with Reporter(0) as reporter:
        loop = _Loop(spec, patience, history, ckpt, attempt, reporter, optuna)
        fit = _fit(spec, params, train_set, val_set, val_metric, loop, init_model)
        loop.finish(fit.booster)
        best_i, best_v = loop.best
        metrics = evaluate(fit.booster, splits, best_i)
        metrics["best_iteration"] = float(best_i)
        model_uri = f"{out}/model"
        export_model(fit.booster, best_i, spec, splits, params["objective"], model_uri)
        attempt.update(force=True, status="completed", last_step=fit.booster.current_iteration())
        tracker_run = _finish_tracker(tracker, metrics, loop.pruned_at)
        reporter.info(
            f"trial {spec.trial_id}: done after {fit.booster.current_iteration()} iterations (best {best_i}), {metrics}"
        )
        return _result(
            spec,
            fit,
            loop,
            attempt,
            len(splits.y["train"]),
            started,
            metrics=metrics,
            best_value=best_v,
            model_uri=model_uri,
            tracker_run=tracker_run,
            resumed=done > 0,
        )


def _val_metric(spec: TrainSpec, splits: Splits) -> Callable[[np.ndarray], float]:
    """The monitored metric of validation predictions (as `Booster.predict` returns them)."""
    metric = spec.monitor.removeprefix("val_")
    return lambda pred: metric_value(metric, pred, splits.y["val"], splits.positive)


@dataclass
class _Fit:
    """The outcome of boosting: the whole model (every iteration) and the seconds spent fitting."""

    booster: Any
    seconds: float


def _fit(spec: TrainSpec, params: dict[str, Any], train_set: lgb.Dataset, val_set: lgb.Dataset,
         val_metric: Callable[[np.ndarray], float], loop: _Loop, init_model: Optional[Any]) -> _Fit:
    """Boost the rounds left after `init_model`, with SIGTERM turned into a save and a `Preempted` exit.

    A resumed model that already holds every round, or that early stopping had
    already stopped, is returned as it is. A failure is recorded in the attempt
    log (`preempted` when SIGTERM caused it, else `failed`) and re-raised.

    Raises:
        ConfigError: LightGBM rejected the data or the parameters.
    """
    attempt, reporter = loop.attempt, loop.reporter
    previous = signal.signal(signal.SIGTERM, lambda *_: setattr(loop, "preempt_requested", True))
    best_i, _ = loop.best
    done = init_model.current_iteration() if init_model is not None else 0
    if init_model is not None:
        reporter.info(f"trial {spec.trial_id}: resuming from {loop.ckpt.model_uri} at iteration {done}")
    # Only a resumed run can have nothing left: TrainSpec requires max_epochs >= 1.
    finished = init_model is not None and (done >= spec.max_epochs or done - best_i >= loop.patience)
    attempt.update(force=True)
    fit_started = time.perf_counter()
    try:
        if init_model is not None and finished:
            booster = init_model
        else:
            reporter.info(
                f"trial {spec.trial_id}: LightGBM {params['objective']}, up to {spec.max_epochs} rounds on data "
                f"{spec.data.version[:12]}"
            )
            loop.start()
            try:
                booster = lgb.train(
                    params,
                    train_set,
                    num_boost_round=spec.max_epochs - done,
                    valid_sets=[val_set],
                    valid_names=["val"],
                    feval=lambda pred, data: (spec.monitor, val_metric(pred), spec.monitor_mode == "max"),
                    init_model=init_model,
                    callbacks=[loop],
                    keep_training_booster=True,
                )  # the whole model, not cut at the best iteration
            except lgb.basic.LightGBMError as e:
                raise ConfigError(f"LightGBM rejected the data or parameters {params}: {e}") from e
    except BaseException as e:
        status = "preempted" if loop.preempt_requested else "failed"
        attempt.update(force=True, status=status, error=f"{type(e).__name__}: {e}"[:500])
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return _Fit(booster, time.perf_counter() - fit_started)


def _finish_tracker(tracker: Any, metrics: dict[str, float], pruned_at: Optional[int]) -> Optional[str]:
    """Write the final metrics to the W&B run (if any), close it and return its `project/id`."""
    if tracker is None:
        return None
    tracker.summary.update({**metrics, "pruned_at": pruned_at or 0})
    run = f"{tracker.project}/{tracker.id}"
    tracker.finish()
    return run


def _result(
    spec: TrainSpec,
    fit: _Fit,
    loop: _Loop,
    attempt: AttemptLog,
    train_rows: int,
    started: float,
    *,
    metrics: dict[str, float],
    best_value: Optional[float],
    model_uri: str,
    tracker_run: Optional[str],
    resumed: bool,
) -> TrainResult:
    """The trial's `TrainResult`, with goodput over every attempt so far."""
    iterations = fit.booster.current_iteration()
    trained = attempt.record["steps"]
    accounts = goodput(read_attempts(spec.output_uri.rstrip("/")), 1, time.time())
    return TrainResult(
        trial_id=spec.trial_id,
        metrics=metrics,
        best_metric=best_value if best_value is not None else metrics[spec.monitor],
        epochs=iterations,
        global_step=iterations,
        train_samples=trained * train_rows,
        fit_seconds=fit.seconds,
        samples_per_second=trained * train_rows / fit.seconds if fit.seconds > 0 else 0.0,
        wall_seconds=time.perf_counter() - started,
        world_size=1,
        device_hours=accounts["device_hours"],
        model_uri=model_uri,
        checkpoint_uri=loop.ckpt.model_uri,
        tracker_run=tracker_run,
        lineage=spec.lineage,
        resumed_from=loop.ckpt.model_uri if resumed else None,
        checkpoint_interval_seconds=None if spec.checkpoint.every_n_steps else loop.save_every_seconds,
        checkpoint_interval_source="every_n_steps" if spec.checkpoint.every_n_steps else "every_seconds",
        goodput=accounts,
        status="pruned" if loop.pruned_at is not None else "completed",
    )
