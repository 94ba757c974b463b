"""The `gbt` task: a LightGBM trial, run by `training.entrypoint` in one process.

Same contract as a Lightning trial: read the Parquet splits of `spec.data`,
train, evaluate the best iteration on the full validation and test splits,
export a serving model and return a `TrainResult` (the entrypoint writes it).

- Objective: `spec.model.kwargs["objective"]` when given (binary, multiclass,
  multiclassova or a regression objective), otherwise inferred from the target
  column's type: float -> `regression`; int, str or bool -> `binary` with two
  classes, `multiclass` with more.
- Parameters: every other key of `spec.model.kwargs` goes to LightGBM, except
  `early_stopping_rounds` (platform, default 20). Boosting rounds are
  `spec.max_epochs`; `seed` and `deterministic` come from the spec.
- Monitored metric (`spec.monitor`): `val_acc` (max) or `val_logloss` (min) for
  classification, `val_rmse` (min) for regression. Early stopping, the best
  iteration, Optuna reports and `best_metric` all use it.
- Checkpoint: the LightGBM model file `<output>/checkpoints/model.txt` with every
  iteration so far, plus `state.json` holding the monitored value per iteration;
  each is written under a temporary name and renamed. A new attempt continues
  boosting from the model file (`init_model`); iterations the state file does not
  cover yet are re-scored from the model, so early stopping resumes exactly.
  Saves happen every `checkpoint.every_n_steps` iterations, else every
  `checkpoint.every_seconds` (default 30 s), at the end, and on SIGTERM (then the
  process exits as preempted).
- Pruning: with `spec.optuna`, the monitored value is reported to the trial every
  `REPORT_EVERY` iterations; when the study's pruner says so, boosting stops, the trial is
  told PRUNED and the run still exports and reports its best iteration.
- Serving model: `<output>/model/model.txt` (the best iteration only) and
  `meta.json` with `"format": "lightgbm"`, served by `training/serving_model.py`.

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
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import fsspec
import lightgbm as lgb
import numpy as np
import pyarrow.parquet as pq
import pyarrow.types as pat

from training.attempts import AttemptLog, FaultMarkers, attempt_id, goodput, read_attempts
from training.errors import ConfigError, Preempted
from training.reporting import Reporter
from training.spec import CHECKPOINT_DIR, TrainResult, TrainSpec

log = logging.getLogger("trainyard.training")

MODEL_FILE = "model.txt"
STATE_FILE = "state.json"
META_FILE = "meta.json"
SERVING_FORMAT = "lightgbm"
DEFAULT_EARLY_STOPPING_ROUNDS = 20
DEFAULT_SAVE_SECONDS = 30.0
HEARTBEAT_SECONDS = 2.0
# Optuna reports every this many iterations: a report is an RDB write (~20 ms on SQLite), and
# pruners compare trials at equal steps, so the interval is fixed rather than timed.
REPORT_EVERY = 10

CLASSIFICATION_OBJECTIVES = ("binary", "multiclass", "multiclassova")
REGRESSION_OBJECTIVES = ("regression", "regression_l1", "huber", "fair", "poisson", "quantile", "mape", "gamma", "tweedie")
# monitor -> (task it needs, the direction that is better)
MONITORS = {"val_acc": ("classification", "max"), "val_logloss": ("classification", "min"), "val_rmse": ("regression", "min")}
# Round counts are `spec.max_epochs`; LightGBM would silently let these override it.
_ROUND_KEYS = ("num_iterations", "num_iteration", "n_iter", "num_tree", "num_trees", "num_round", "num_rounds",
               "nrounds", "num_boost_round", "n_estimators", "max_iter")
_PLATFORM_KEYS = ("seed", "deterministic", "num_class", "verbosity", "verbose", "metric")


# -- data -----------------------------------------------------------------------------


@dataclass
class Splits:
    """Feature matrices (float64) and encoded targets of the three splits."""

    x: dict[str, np.ndarray]
    y: dict[str, np.ndarray]
    task: str  # classification | regression
    classes: list[Any]  # original labels in index order; empty for regression


def _read_split(uri: str, features: list[str], target: str) -> tuple[np.ndarray, np.ndarray, str]:

    try:
        with fsspec.open(uri, "rb") as f:
            table = pq.read_table(f, columns=[*features, target])
    except FileNotFoundError as e:
        raise ConfigError(f"data split {uri!r} does not exist") from e
    except (KeyError, ValueError) as e:
        raise ConfigError(f"data split {uri!r} lacks a column of features {features} / target {target!r}: {e}") from e
    x = np.column_stack([table.column(c).to_numpy(zero_copy_only=False).astype("float64") for c in features])
    column = table.column(target)
    kind = "regression" if pat.is_floating(column.type) else "classification"
    return x, column.to_numpy(zero_copy_only=False), kind


def load_splits(spec: TrainSpec, objective: Optional[str]) -> Splits:
    """Read train/val/test and encode class labels as 0..K-1 (sorted over all splits)."""
    raw = {s: _read_split(u, spec.data.features, spec.data.target) for s, u in
           (("train", spec.data.train_uri), ("val", spec.data.val_uri), ("test", spec.data.test_uri))}
    task = raw["train"][2]
    if objective is not None:
        task = "classification" if objective in CLASSIFICATION_OBJECTIVES else "regression"
    x = {s: r[0] for s, r in raw.items()}
    if task == "regression":
        return Splits(x, {s: r[1].astype("float64") for s, r in raw.items()}, task, [])
    classes = np.unique(np.concatenate([r[1] for r in raw.values()]))
    if len(classes) < 2:
        raise ConfigError(f"target {spec.data.target!r} has a single class {classes.tolist()}; classification needs at least two")
    y = {s: np.searchsorted(classes, r[1]).astype("int64") for s, r in raw.items()}
    return Splits(x, y, task, classes.tolist())


# -- parameters -----------------------------------------------------------------------


def resolve_objective(kwargs: dict[str, Any]) -> Optional[str]:
    """The declared objective, validated; None means infer it from the data."""
    objective = kwargs.get("objective")
    if objective is None:
        return None
    if objective not in CLASSIFICATION_OBJECTIVES + REGRESSION_OBJECTIVES:
        raise ConfigError(
            f"model.kwargs.objective={objective!r} is not supported; use one of "
            f"{list(CLASSIFICATION_OBJECTIVES + REGRESSION_OBJECTIVES)} or leave it unset to infer it from the target"
        )
    return objective


def lightgbm_params(spec: TrainSpec, splits: Splits, objective: Optional[str]) -> tuple[dict[str, Any], int]:
    """LightGBM parameters and early-stopping patience from the spec (pure).

    Layers, later wins: platform defaults (`verbosity=-1`, column-wise histograms
    when deterministic) < `spec.model.kwargs` < values the platform owns
    (objective, `num_class`, `seed`, `deterministic`, `metric`).

    Raises:
        ConfigError: a round-count key (use `max_epochs`), a platform-owned key,
            a monitor that does not fit the task, or a bad `early_stopping_rounds`.
    """
    kwargs = dict(spec.model.kwargs)
    rounds_keys = sorted(k for k in kwargs if k in _ROUND_KEYS)
    if rounds_keys:
        raise ConfigError(f"model.kwargs sets {rounds_keys}; the number of boosting rounds is max_epochs (now {spec.max_epochs})")
    owned = sorted(k for k in kwargs if k in _PLATFORM_KEYS)
    if owned:
        raise ConfigError(f"model.kwargs sets {owned}, which the platform owns (seed and determinism come from the spec, "
                          f"the metric from monitor={spec.monitor!r})")
    patience = kwargs.pop("early_stopping_rounds", DEFAULT_EARLY_STOPPING_ROUNDS)
    if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
        raise ConfigError(f"model.kwargs.early_stopping_rounds={patience!r} must be an integer >= 1")
    if objective is None:
        objective = "regression" if splits.task == "regression" else ("binary" if len(splits.classes) == 2 else "multiclass")
    if objective == "binary" and len(splits.classes) != 2:
        raise ConfigError(f"objective 'binary' needs two classes; target {spec.data.target!r} has {len(splits.classes)}: {splits.classes}")
    check_monitor(spec.monitor, spec.monitor_mode, splits.task)
    params: dict[str, Any] = {"verbosity": -1}
    if spec.deterministic and not ({"force_row_wise", "force_col_wise"} & set(kwargs)):
        params["force_col_wise"] = True
    params.update(kwargs)
    params.update(objective=objective, seed=spec.seed, deterministic=spec.deterministic, metric="None")
    if objective in ("multiclass", "multiclassova"):
        params["num_class"] = len(splits.classes)
    return params, patience


def check_monitor(monitor: str, mode: str, task: str) -> None:
    """Raise ConfigError unless `monitor` is a GBT metric of `task` with its natural direction."""
    if monitor not in MONITORS:
        raise ConfigError(f"monitor={monitor!r} is not a GBT metric; use one of {sorted(MONITORS)}")
    needs, direction = MONITORS[monitor]
    if needs != task:
        fits = sorted(m for m, (t, _) in MONITORS.items() if t == task)
        raise ConfigError(f"monitor={monitor!r} measures {needs}, but this is a {task} task; use one of {fits}")
    if mode != direction:
        raise ConfigError(f"monitor_mode={mode!r} does not fit monitor={monitor!r}; it is better when {'higher' if direction == 'max' else 'lower'} (use {direction!r})")


# -- metrics ----------------------------------------------------------------------------


def predict_labels(pred: np.ndarray) -> np.ndarray:
    """Class indices from LightGBM's transformed predictions (probabilities)."""
    return pred.argmax(axis=1) if pred.ndim == 2 else (pred > 0.5).astype("int64")


def metric_value(name: str, pred: np.ndarray, y: np.ndarray) -> float:
    """`acc`, `logloss` or `rmse` of predictions `pred` (as `Booster.predict` returns them)."""
    if name == "acc":
        return float((predict_labels(pred) == y).mean())
    if name == "logloss":
        p = pred[np.arange(len(y)), y] if pred.ndim == 2 else np.where(y == 1, pred, 1.0 - pred)
        return float(-np.log(np.clip(p, 1e-15, 1.0)).mean())
    if name == "rmse":
        return float(math.sqrt(np.mean((pred - y) ** 2)))
    raise ValueError(f"unknown metric {name!r}")


def evaluate(booster: Any, splits: Splits, iteration: int) -> dict[str, float]:
    names = ("acc", "logloss") if splits.task == "classification" else ("rmse",)
    out = {}
    for split in ("val", "test"):
        pred = booster.predict(splits.x[split], num_iteration=iteration)
        out.update({f"{split}_{n}": metric_value(n, pred, splits.y[split]) for n in names})
    return out


# -- checkpoint -------------------------------------------------------------------------


def _write_atomic(uri: str, data: str) -> None:
    """Write under a temporary name in the same directory, then rename (a whole object on object stores)."""
    fs, path = fsspec.core.url_to_fs(uri)
    directory = path.rsplit("/", 1)[0]
    fs.makedirs(directory, exist_ok=True)
    tmp = f"{directory}/.tmp-{uuid.uuid4().hex}"
    try:
        with fs.open(tmp, "w") as f:
            f.write(data)
        fs.mv(tmp, path)
    finally:
        if fs.exists(tmp):
            fs.rm(tmp)


def _read_text(uri: str) -> Optional[str]:
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return f.read()


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
        _write_atomic(self.model_uri, text)
        # The state lags the model on a crash between the two writes; `load` re-scores the gap.
        state = {"iterations": booster.current_iteration(), "history": history, "model_sha256": hashlib.sha256(text.encode()).hexdigest()}
        _write_atomic(self.state_uri, json.dumps(state))
        self.blocking_seconds += time.perf_counter() - started
        self.saves += 1

    def load(self) -> tuple[Optional[Any], list[float]]:
        """The saved booster (or None) and the monitored values the state file holds for it."""
        text = _read_text(self.model_uri)
        if text is None:
            return None, []
        try:
            booster = lgb.Booster(model_str=text)
        except lgb.basic.LightGBMError as e:
            log.warning("checkpoint %s is unreadable (%s); starting from scratch", self.model_uri, e)
            return None, []
        state_text = _read_text(self.state_uri)
        history: list[float] = []
        if state_text is not None:
            # Trees are only ever appended, so the first n values describe the first n iterations of this model.
            history = list(json.loads(state_text).get("history", []))[: booster.current_iteration()]
        return booster, history


# -- the training loop --------------------------------------------------------------------


class OptunaReporter:
    """Reports the monitored value to the spec's Optuna trial and asks its pruner (single process: no broadcast)."""

    def __init__(self, storage_url: str, study_name: str, number: int) -> None:
        import optuna  # loaded only for trials of a sweep

        kwargs: dict[str, Any] = {"engine_kwargs": {"connect_args": {"timeout": 60}}} if storage_url.startswith("sqlite") else {}
        storage = optuna.storages.RDBStorage(storage_url, **kwargs)
        try:
            self.study = optuna.load_study(study_name=study_name, storage=storage)
        except KeyError as e:
            raise ConfigError(f"optuna study {study_name!r} does not exist in {storage_url.split('?')[0]}") from e
        self.number = number
        trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study_name), number)
        self.active = not storage.get_trial(trial_id).state.is_finished()
        self.trial = optuna.trial.Trial(self.study, trial_id)

    def should_prune(self, value: float, step: int) -> bool:
        if not self.active:
            return False
        self.trial.report(value, step)
        return self.trial.should_prune()

    def mark_pruned(self) -> None:
        from optuna.trial import TrialState  # loaded only for trials of a sweep

        self.study.tell(self.number, state=TrialState.PRUNED)
        self.active = False


class _Loop:
    """The LightGBM callback: monitor, early stopping, pruning, progress, checkpoints, preemption, faults."""

    order = 100  # after LightGBM's own callbacks

    def __init__(self, spec: TrainSpec, patience: int, history: list[float], ckpt: ModelFileCheckpoint, attempt: AttemptLog,
                 reporter: Reporter, optuna: Optional[OptunaReporter]) -> None:
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
            self.reporter.info(f"trial {self.spec.trial_id}: pruned at iteration {it} ({self.spec.monitor}={value:.4f})")
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
            raise lgb.callback.EarlyStopException(best_i - 1, [("val", self.spec.monitor, best_v, self.spec.monitor_mode == "max")])

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
            log.warning("fault injection: SIGTERM %s at iteration %d", "the launcher agent" if agent != os.getpid() else "this process", it)
            os.kill(agent, signal.SIGTERM)
            deadline = time.monotonic() + 5.0
            while not self.preempt_requested and time.monotonic() < deadline:
                time.sleep(0.05)  # the agent forwards SIGTERM to this process


def _replay(booster: Any, history: list[float], score_at: Callable[[Any, int], float]) -> list[float]:
    """Monitored values of iterations the state file missed, re-scored from the model."""
    return history + [score_at(booster, i) for i in range(len(history) + 1, booster.current_iteration() + 1)]


def export_model(booster: Any, best_iteration: int, spec: TrainSpec, splits: Splits, objective: str, dest_uri: str) -> None:
    """Write `model.txt` (best iteration only) and `meta.json` for `training/serving_model.py`."""
    meta: dict[str, Any] = {
        "format": SERVING_FORMAT,
        "features": spec.data.features,
        "target": spec.data.target,
        "task": splits.task,
        "objective": objective,
        "best_iteration": best_iteration,
    }
    if splits.task == "classification":
        meta["classes"] = splits.classes
    with tempfile.TemporaryDirectory() as tmp:
        booster.save_model(os.path.join(tmp, MODEL_FILE), num_iteration=best_iteration)
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        fs, path = fsspec.core.url_to_fs(dest_uri)
        fs.makedirs(path, exist_ok=True)
        for name in (MODEL_FILE, META_FILE):
            fs.put_file(os.path.join(tmp, name), f"{path}/{name}")


def _tracker(spec: TrainSpec) -> Any:
    t = spec.tracker
    if t.kind == "none" or t.mode == "disabled":
        return None
    import wandb  # loaded only when the trial is tracked

    os.environ.setdefault("WANDB_SILENT", "true")
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
    params, patience = lightgbm_params(spec, splits, objective)
    objective = params["objective"]
    metric = spec.monitor.removeprefix("val_")

    def score_at(booster: Any, iteration: int) -> float:
        return metric_value(metric, booster.predict(splits.x["val"], num_iteration=iteration), splits.y["val"])

    def feval(pred: np.ndarray, data: Any) -> tuple[str, float, bool]:
        return spec.monitor, metric_value(metric, pred, splits.y["val"]), spec.monitor_mode == "max"

    ckpt = ModelFileCheckpoint(f"{out}/{CHECKPOINT_DIR}")
    init_model, history = ckpt.load()
    attempt = AttemptLog(out, attempt_id(), started_wall, every=HEARTBEAT_SECONDS)
    done = 0
    if init_model is not None:
        history = _replay(init_model, history, score_at)
        done = init_model.current_iteration()
        attempt.record.update(resumed_from=ckpt.model_uri, resumed_from_step=done)
    # Raw data is kept: continuing from a model file scores it with that model first.
    train_set = lgb.Dataset(splits.x["train"], label=splits.y["train"], feature_name=list(spec.data.features), params=params, free_raw_data=False)
    val_set = lgb.Dataset(splits.x["val"], label=splits.y["val"], reference=train_set, free_raw_data=False)
    optuna = OptunaReporter(spec.optuna.storage_url, spec.optuna.study_name, spec.optuna.trial_number) if spec.optuna else None
    tracker = _tracker(spec)
    with Reporter(0) as reporter:
        loop = _Loop(spec, patience, history, ckpt, attempt, reporter, optuna)
        previous = signal.signal(signal.SIGTERM, lambda *_: setattr(loop, "preempt_requested", True))
        best_i, _ = loop.best
        remaining = spec.max_epochs - done
        if init_model is not None:
            reporter.info(f"trial {spec.trial_id}: resuming from {ckpt.model_uri} at iteration {done}")
        stopped_early = init_model is not None and done - best_i >= patience
        attempt.update(force=True)
        fit_started = time.perf_counter()
        try:
            if remaining > 0 and not stopped_early:
                reporter.info(f"trial {spec.trial_id}: LightGBM {objective}, up to {spec.max_epochs} rounds on data {spec.data.version[:12]}")
                loop.start()
                try:
                    booster = lgb.train(params, train_set, num_boost_round=remaining, valid_sets=[val_set], valid_names=["val"],
                                        feval=feval, init_model=init_model, callbacks=[loop],
                                        keep_training_booster=True)  # the whole model, not cut at the best iteration
                except lgb.basic.LightGBMError as e:
                    raise ConfigError(f"LightGBM rejected the data or parameters {params}: {e}") from e
            else:
                booster = init_model
        except BaseException as e:
            status = "preempted" if loop.preempt_requested else "failed"
            attempt.update(force=True, status=status, error=f"{type(e).__name__}: {e}"[:500])
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        fit_seconds = time.perf_counter() - fit_started
        loop.finish(booster)
        if loop.pruned_at is not None and optuna is not None:
            optuna.mark_pruned()
        best_i, best_v = loop.best
        metrics = evaluate(booster, splits, best_i)
        metrics["best_iteration"] = float(best_i)
        model_uri = f"{out}/model"
        export_model(booster, best_i, spec, splits, objective, model_uri)
        attempt.update(force=True, status="completed", last_step=booster.current_iteration())
        tracker_run = None
        if tracker is not None:
            tracker.summary.update({**metrics, "pruned_at": loop.pruned_at or 0})
            tracker_run = f"{tracker.project}/{tracker.id}"
            tracker.finish()
        iterations = booster.current_iteration()
        trained = attempt.record["steps"]
        accounts = goodput(read_attempts(out), 1, time.time())
        reporter.info(f"trial {spec.trial_id}: done after {iterations} iterations (best {best_i}), {metrics}")
        return TrainResult(
            trial_id=spec.trial_id,
            metrics=metrics,
            best_metric=best_v if best_v is not None else metrics[spec.monitor],
            epochs=iterations,
            global_step=iterations,
            train_samples=trained * len(splits.y["train"]),
            fit_seconds=fit_seconds,
            samples_per_second=trained * len(splits.y["train"]) / fit_seconds if fit_seconds > 0 else 0.0,
            wall_seconds=time.perf_counter() - started,
            world_size=1,
            device_hours=accounts["device_hours"],
            model_uri=model_uri,
            checkpoint_uri=ckpt.model_uri,
            tracker_run=tracker_run,
            lineage=spec.lineage,
            resumed_from=ckpt.model_uri if done else None,
            checkpoint_interval_seconds=None if spec.checkpoint.every_n_steps else loop.save_every_seconds,
            checkpoint_interval_source="every_n_steps" if spec.checkpoint.every_n_steps else "every_seconds",
            goodput=accounts,
        )

