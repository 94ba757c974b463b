"""Optuna sweeps: study storage (SQLite locally, PostgreSQL on clusters) and the rules a sweep runs by.

`SweepStore` is the resource: it creates or resumes a study, asks trials in
bounded batches, tells results, records heartbeats while a trial trains and
fails trials whose heartbeat went stale. Around it, pure functions hold the
rules, each tested with exact values:

- `sweep_status`: counts by state and why a sweep stops asking (trial budget,
  failure budget, time budget, target reached);
- `objective_values`, `pareto_front`, `pick_trial`: multi-objective results and
  the declared policy that picks the trial to promote;
- `build_report`: best parameters, a trials table, optimization history,
  parameter importance and Pareto plots (PNG, matplotlib) for `sweep` metadata.

A study's trial numbers are its partition keys (`trial-0007` is trial 7), so a
study resumed after a crash continues with the next free number: no duplicate
partitions and no duplicate trials.
"""

from __future__ import annotations

import base64
import contextlib
import io
import math
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

from dagster import ConfigurableResource
from pydantic import Field

from trainyard.spec import CategoricalParam, FloatParam, IntParam, Objective, PickPolicy, PipelineSpec, SearchSpec

CREATED_AT = "trainyard.created_at"
STOPPED = "trainyard.stopped"
ERROR = "error"


class SweepError(Exception):
    """A sweep could not be created, resumed or updated."""


def distributions(search: SearchSpec) -> dict[str, Any]:
    """Optuna distributions for a declared search space."""
    import optuna.distributions as d

    out: dict[str, Any] = {}
    for name, p in search.params.items():
        if isinstance(p, FloatParam):
            out[name] = d.FloatDistribution(p.low, p.high, log=p.log)
        elif isinstance(p, IntParam):
            out[name] = d.IntDistribution(p.low, p.high, step=p.step, log=p.log)
        elif isinstance(p, CategoricalParam):
            out[name] = d.CategoricalDistribution(p.choices)
    return out


def grid_space(search: SearchSpec) -> dict[str, list[Any]]:
    """The values `GridSampler` walks through: every step of an int param, every choice of a categorical one."""
    space: dict[str, list[Any]] = {}
    for name, p in search.params.items():
        if isinstance(p, IntParam):
            space[name] = list(range(p.low, p.high + 1, p.step))
        elif isinstance(p, CategoricalParam):
            space[name] = list(p.choices)
        else:
            raise SweepError(f"param {name!r} is a FloatParam; sampler 'grid' needs IntParam or CategoricalParam")
    return space


def derive_seed(seed: int, n_trials_so_far: int) -> int:
    """Sampler seed for a batch of asks: deterministic, and different each time the study has grown.

    A sampler re-created with the same seed on every sensor tick would repeat
    its random draws; folding in the study's size gives every batch fresh ones.
    """
    return (seed * 1_000_003 + n_trials_so_far) % (2**32)


def build_sampler(search: SearchSpec, seed: int) -> Any:
    """The Optuna sampler a `SearchSpec` declares.

    TPE uses the constant-liar heuristic when trials run in parallel, so trials
    asked while others still train are not drawn next to them.
    """
    import optuna

    if search.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if search.sampler == "grid":
        return optuna.samplers.GridSampler(grid_space(search), seed=seed)
    if search.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, constant_liar=search.window > 1)


def objectives_of(spec: PipelineSpec) -> list[Objective]:
    """The sweep's objectives: the declared ones, or the model's monitor alone."""
    return list(spec.search.objectives) or [Objective(metric=spec.model.monitor, mode=spec.model.monitor_mode)]


def study_directions(spec: PipelineSpec) -> list[str]:
    """`max`/`min` per objective, in order."""
    return [o.mode for o in objectives_of(spec)]


_MODES = {"MAXIMIZE": "max", "MINIMIZE": "min"}


def _optuna_direction(mode: str) -> str:
    if mode not in ("max", "min"):
        raise SweepError(f"direction {mode!r} is not 'max' or 'min'")
    return "maximize" if mode == "max" else "minimize"


# -- status and stop rules -------------------------------------------------------------------


@dataclass(frozen=True)
class SweepStatus:
    """Where a sweep stands, from its trials.

    `live` trials count towards `budget` (finished or in flight); failed trials
    do not, they are replaced until the failure budget is spent.
    """

    budget: int
    complete: int
    pruned: int
    failed: int
    running: int
    waiting: int
    best: Optional[float]
    stop_reason: Optional[str]

    @property
    def live(self) -> int:
        return self.complete + self.pruned + self.running + self.waiting

    @property
    def finished(self) -> int:
        return self.complete + self.pruned

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting

    @property
    def remaining(self) -> int:
        """Trials still to ask; 0 once stopped."""
        return 0 if self.stop_reason else max(0, self.budget - self.live)

    @property
    def done(self) -> bool:
        """Nothing in flight and nothing more to ask."""
        return self.in_flight == 0 and self.remaining == 0

    def summary(self) -> str:
        text = (
            f"{self.finished}/{self.budget} finished ({self.complete} complete, {self.pruned} pruned), "
            f"{self.in_flight} in flight, {self.failed} failed"
        )
        if self.best is not None:
            text += f", best {self.best:.4g}"
        return text + (f"; stopped: {self.stop_reason}" if self.stop_reason else "")


def sweep_status(
    trials: Sequence[Any],
    search: SearchSpec,
    directions: Sequence[str],
    created_at: Optional[float],
    now: float,
    stopped: Optional[str] = None,
) -> SweepStatus:
    """Counts by state and the reason the sweep stops asking, if any.

    Stop rules, first match wins: an earlier recorded stop (`stopped`), the
    failure budget, the target on the first objective, the time budget. The
    trial budget is not a stop: it just leaves nothing to ask.

    Args:
        trials: the study's trials (FrozenTrial).
        search: budgets and stop rules.
        directions: `max`/`min` per objective.
        created_at: when the sweep started (epoch seconds), for the time budget.
        now: the current time (epoch seconds).
        stopped: a stop reason recorded earlier; a stopped sweep stays stopped.
    """
    counts = {"COMPLETE": 0, "PRUNED": 0, "FAIL": 0, "RUNNING": 0, "WAITING": 0}
    for t in trials:
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    sign = 1.0 if directions[0] == "max" else -1.0
    best = max((sign * t.values[0] for t in complete), default=None)
    best = None if best is None else sign * best
    budget = min(search.n_trials, search.grid_size) if search.sampler == "grid" else search.n_trials
    reason = stopped
    if reason is None and counts["FAIL"] >= search.failure_budget:
        errors = [failure_reason(t) for t in trials if t.state.name == "FAIL"]
        reason = f"failure budget spent: {counts['FAIL']} trials failed (max_failures {search.failure_budget}); last error: {errors[-1]}"
    if reason is None and search.target is not None and best is not None and sign * best >= sign * search.target:
        reason = f"target reached: best {best:.6g} {'>=' if sign > 0 else '<='} target {search.target:.6g}"
    if reason is None and search.timeout_seconds is not None and created_at is not None and now - created_at >= search.timeout_seconds:
        reason = f"time budget spent: {now - created_at:.0f} s since the sweep started (timeout_seconds {search.timeout_seconds:.0f})"
    return SweepStatus(
        budget=budget,
        complete=counts["COMPLETE"],
        pruned=counts["PRUNED"],
        failed=counts["FAIL"],
        running=counts["RUNNING"],
        waiting=counts["WAITING"],
        best=best,
        stop_reason=reason,
    )


def failure_reason(trial: Any) -> str:
    """Why a failed trial failed: its recorded error, else the heartbeat rule that failed it."""
    error = trial.user_attrs.get(ERROR)
    if error:
        return str(error).splitlines()[0][:200]
    return "stopped without reporting: no heartbeat within the grace period (its run crashed or was killed)"


# -- multi-objective -------------------------------------------------------------------------


def objective_values(result: dict[str, Any], objectives: Sequence[Objective], monitor: str, model_bytes: Optional[int] = None) -> list[float]:
    """The values a finished trial tells its study, one per objective.

    The monitor is the result's `best_metric`; other metrics come from
    `result["metrics"]`, then result fields (`fit_seconds`, ...), then
    `model_bytes` (the size of the exported model).

    Raises:
        SweepError: an objective the result does not carry, naming what it does carry.
    """
    values = []
    for o in objectives:
        if o.metric == monitor:
            v = result.get("best_metric")
        elif o.metric in result.get("metrics", {}):
            v = result["metrics"][o.metric]
        elif o.metric == "model_bytes":
            v = model_bytes
        else:
            v = result.get(o.metric)
        if v is None:
            available = sorted({monitor, *result.get("metrics", {}), "model_bytes", "fit_seconds", "wall_seconds", "device_hours", "samples_per_second"})
            raise SweepError(f"objective {o.metric!r} is not in the trial's result; available: {available}")
        values.append(float(v))
    return values


def _dominates(a: Sequence[float], b: Sequence[float], signs: Sequence[float]) -> bool:
    better_somewhere = False
    for x, y, s in zip(a, b, signs):
        if s * x < s * y:
            return False
        if s * x > s * y:
            better_somewhere = True
    return better_somewhere


def pareto_front(trials: Sequence[Any], directions: Sequence[str]) -> list[Any]:
    """Completed trials no other completed trial dominates, in trial-number order."""
    signs = [1.0 if d == "max" else -1.0 for d in directions]
    done = [t for t in trials if t.state.name == "COMPLETE"]
    return sorted(
        (t for t in done if not any(_dominates(o.values, t.values, signs) for o in done if o is not t)),
        key=lambda t: t.number,
    )


def pick_trial(front: Sequence[Any], objectives: Sequence[Objective], pick: PickPolicy) -> tuple[Any, str]:
    """The trial of the Pareto front to promote, and why (see `PickPolicy`).

    Raises:
        SweepError: the front is empty, or no trial is within `pick.limits`.
    """
    if not front:
        raise SweepError("the Pareto front is empty: no trial completed")
    index = {o.metric: i for i, o in enumerate(objectives)}
    signs = [1.0 if o.mode == "max" else -1.0 for o in objectives]
    within = []
    for t in front:
        ok = all((t.values[index[m]] >= bound) if objectives[index[m]].mode == "max" else (t.values[index[m]] <= bound) for m, bound in pick.limits.items())
        if ok:
            within.append(t)
    if not within:
        raise SweepError(f"no trial of the Pareto front ({len(front)} trials) is within the pick limits {pick.limits}")
    limits = f" within {pick.limits}" if pick.limits else ""
    if pick.rule == "primary":
        first = index[pick.metric] if pick.metric else 0
        order = [first] + [i for i in range(len(objectives)) if i != first]
        best = min(within, key=lambda t: (*[-signs[i] * t.values[i] for i in order], t.number))
        return best, f"best {objectives[first].metric} ({objectives[first].mode}) of {len(within)} Pareto-optimal trial(s){limits}"
    lows = [min(t.values[i] for t in within) for i in range(len(objectives))]
    highs = [max(t.values[i] for t in within) for i in range(len(objectives))]

    def distance(t: Any) -> float:
        total = 0.0
        for i, s in enumerate(signs):
            span = highs[i] - lows[i]
            scaled = 0.0 if span == 0 else (t.values[i] - lows[i]) / span
            total += (1.0 - scaled if s > 0 else scaled) ** 2
        return math.sqrt(total)

    best = min(within, key=lambda t: (distance(t), t.number))
    return best, f"closest to the ideal point (distance {distance(best):.3f}) of {len(within)} Pareto-optimal trial(s){limits}"


# -- the resource -------------------------------------------------------------------------------


class SweepStore(ConfigurableResource):
    """Optuna RDB storage, with heartbeats.

    Args:
        storage_url: SQLAlchemy URL, e.g. `sqlite:////abs/optuna.db` or
            `postgresql+psycopg2://user@host/db`.
        heartbeat_interval: seconds between heartbeats of a training trial.
        grace_period: seconds without a heartbeat after which a running trial
            is failed (its run crashed or was killed); default twice the interval.
    """

    storage_url: str
    heartbeat_interval: int = Field(60, ge=1)
    grace_period: Optional[int] = Field(None, ge=1)

    @property
    def _key(self) -> tuple[str, int, Optional[int]]:
        return (self.storage_url, self.heartbeat_interval, self.grace_period)

    def storage(self) -> Any:
        return _storage(*self._key)

    def load_or_create(self, study_name: str, direction: Union[str, Sequence[str]], search: SearchSpec) -> Any:
        """Create the study, or resume it when it exists (same name, same directions).

        Args:
            direction: `max`/`min`, or one per objective.
        """
        import optuna

        modes = [direction] if isinstance(direction, str) else list(direction)
        wanted = [_optuna_direction(m) for m in modes]
        study = optuna.create_study(study_name=study_name, storage=self.storage(), directions=wanted, load_if_exists=True)
        have = [d.name.lower() for d in study.directions]
        if have != wanted:
            raise SweepError(f"study {study_name!r} exists with directions {have}; this sweep declares {wanted}")
        if CREATED_AT not in study.user_attrs:
            study.set_user_attr(CREATED_AT, time.time())
        _remember(self._key, study)
        return self._with_sampler(study, search)

    def load(self, study_name: str, search: Optional[SearchSpec] = None) -> Any:
        """The existing study; with `search`, its sampler is the declared one, freshly seeded."""
        study = _cached_study(self._key, study_name)
        return self._with_sampler(study, search) if search is not None else study

    def _with_sampler(self, study: Any, search: Optional[SearchSpec]) -> Any:
        if search is not None:
            study.sampler = build_sampler(search, derive_seed(search.seed, len(study.get_trials(deepcopy=False))))
        return study

    def ask(self, study: Any, search: SearchSpec, n: int, deadline: Optional[float] = None) -> list[int]:
        """Ask up to `n` trials; stops early at `deadline` (time.monotonic()). Returns their numbers.

        Random sweeps are asked as one batch: the draws of a random sampler do
        not depend on other trials, so each trial is created with its
        parameters in a single write, at a flat cost per trial. Other samplers
        go through `Study.ask`, which re-reads every unfinished trial per ask.
        """
        dists = distributions(search)
        numbers: list[int] = []
        if search.sampler == "random":
            return self._ask_random(study, search, dists, n, deadline)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
            for _ in range(n):
                if deadline is not None and time.monotonic() >= deadline:
                    break
                numbers.append(study.ask(dists).number)
        return numbers

    def _ask_random(self, study: Any, search: SearchSpec, dists: dict[str, Any], n: int, deadline: Optional[float]) -> list[int]:
        from optuna.trial import TrialState, create_trial

        storage = self.storage()
        study_id = storage.get_study_id_from_name(study.study_name)
        sampler = build_sampler(search, derive_seed(search.seed, len(study.get_trials(deepcopy=False))))
        placeholder = create_trial(state=TrialState.RUNNING)
        numbers: list[int] = []
        for _ in range(n):
            if deadline is not None and time.monotonic() >= deadline:
                break
            params = {name: sampler.sample_independent(study, placeholder, name, dist) for name, dist in dists.items()}
            trial_id = storage.create_new_trial(study_id, template_trial=create_trial(state=TrialState.RUNNING, params=params, distributions=dists))
            numbers.append(storage.get_trial_number_from_id(trial_id))
        return numbers

    def status(self, study: Any, search: SearchSpec, now: Optional[float] = None) -> SweepStatus:
        attrs = study.user_attrs
        return sweep_status(
            study.get_trials(deepcopy=False),
            search,
            [_MODES[d.name] for d in study.directions],
            attrs.get(CREATED_AT),
            time.time() if now is None else now,
            attrs.get(STOPPED),
        )

    def ensure_trials(self, study: Any, search: SearchSpec) -> list[int]:
        """Top up the trials in flight to the sweep's window; returns the numbers of live (not failed) trials.

        Idempotent across restarts: trials already in the storage count, so a
        resumed sweep never duplicates trial numbers. Failed trials are replaced
        until the failure budget is spent.
        """
        self.fail_stale(study)
        st = self.status(study, search)
        want = min(search.window - st.in_flight, st.remaining)
        if want > 0:
            self.ask(study, search, want)
        return sorted(t.number for t in study.get_trials(deepcopy=False) if t.state.name != "FAIL")

    def fail_stale(self, study: Any) -> list[int]:
        """Fail running trials whose heartbeat is older than the grace period; returns their numbers.

        Optuna takes no attributes on a finished trial, so such a trial carries
        no `error`; reports name it by that (`failure_reason`).
        """
        import optuna

        before = {t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}
        if not before:
            return []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        after = {t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}
        return sorted(before - after)

    def record_stop(self, study: Any, reason: str) -> None:
        """Remember why the sweep stopped asking, so it stays stopped after restarts."""
        if study.user_attrs.get(STOPPED) is None:
            study.set_user_attr(STOPPED, reason)

    def _trial_id(self, study_name: str, number: int) -> int:
        storage = self.storage()
        try:
            study_id = storage.get_study_id_from_name(study_name)
        except KeyError as e:
            raise SweepError(f"study {study_name!r} does not exist in {self.storage_url.split('?')[0]}; materialize the sweep asset first") from e
        try:
            return storage.get_trial_id_from_study_id_trial_number(study_id, number)
        except KeyError as e:
            raise SweepError(f"study {study_name!r} has no trial number {number}") from e

    def trial(self, study_name: str, number: int) -> Any:
        """The trial as stored now (read from the database, not a cache)."""
        return self.storage().get_trial(self._trial_id(study_name, number))

    def tell(
        self,
        study_name: str,
        number: int,
        value: Union[None, float, Sequence[float]],
        attrs: dict[str, Any],
        failed: bool = False,
        pruned: bool = False,
    ) -> str:
        """Record a trial's outcome: complete with value(s), pruned, or failed; returns the trial's final state.

        Attributes are written first, so a finished trial always carries them.
        A trial that is already finished keeps its state and attributes (e.g.
        failed by a stale heartbeat while its run was cut off from the storage).
        """
        from optuna.trial import TrialState

        storage = self.storage()
        trial_id = self._trial_id(study_name, number)
        trial = storage.get_trial(trial_id)
        if trial.state.is_finished():
            return trial.state.name
        for k, v in attrs.items():
            storage.set_trial_user_attr(trial_id, k, v)
        study = _cached_study(self._key, study_name, teller=True)
        if failed:
            study.tell(number, state=TrialState.FAIL)
        elif pruned:
            study.tell(number, state=TrialState.PRUNED)
        else:
            study.tell(number, list(value) if isinstance(value, (list, tuple)) else value)
        return self.trial(study_name, number).state.name

    @contextlib.contextmanager
    def heartbeat(self, study_name: str, number: int) -> Iterator[None]:
        """Record heartbeats for a trial while the block runs (the trial's run is alive)."""
        storage = self.storage()
        trial_id = self._trial_id(study_name, number)
        stop = threading.Event()
        storage.record_heartbeat(trial_id)

        def beat() -> None:
            while not stop.wait(self.heartbeat_interval):
                storage.record_heartbeat(trial_id)

        thread = threading.Thread(target=beat, name=f"heartbeat-{study_name}-{number}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=10)


_LOCK = threading.Lock()
_STUDIES: "OrderedDict[tuple, Any]" = OrderedDict()


def _remember(key: tuple, study: Any) -> None:
    with _LOCK:
        _STUDIES[(key, study.study_name)] = study
        _STUDIES.move_to_end((key, study.study_name))
        while len(_STUDIES) > 64:
            _STUDIES.popitem(last=False)


def _cached_study(key: tuple, study_name: str, teller: bool = False) -> Any:
    """One Study object per storage and name in this process (and one to tell results with).

    Optuna caches finished trials inside a Study's storage wrapper, so a sensor
    that keeps its Study between ticks reads only new and unfinished trials
    instead of the whole study every tick. Results are told through a second
    Study whose sampler keeps no state: a sampler's `after_trial` may act on
    the study (GridSampler stops it once the grid is covered, which Optuna
    allows only inside `optimize`).
    """
    import optuna

    cache_key = (key, study_name, "tell") if teller else (key, study_name)
    with _LOCK:
        study = _STUDIES.get(cache_key)
    if study is not None:
        return study
    sampler = optuna.samplers.RandomSampler() if teller else None
    try:
        study = optuna.load_study(study_name=study_name, storage=_storage(*key), sampler=sampler)
    except KeyError as e:
        raise SweepError(f"study {study_name!r} does not exist in {key[0].split('?')[0]}; materialize the sweep asset first") from e
    with _LOCK:
        _STUDIES[cache_key] = study
        while len(_STUDIES) > 64:
            _STUDIES.popitem(last=False)
    return study


_STORAGES: "OrderedDict[tuple, Any]" = OrderedDict()


def _storage(url: str, heartbeat_interval: int = 60, grace_period: Optional[int] = None) -> Any:
    """One RDBStorage (one connection pool) per URL and heartbeat setting in this process."""
    import optuna

    key = (url, heartbeat_interval, grace_period)
    with _LOCK:
        if key in _STORAGES:
            _STORAGES.move_to_end(key)
            return _STORAGES[key]
    kwargs: dict[str, Any] = {"heartbeat_interval": heartbeat_interval, "grace_period": grace_period}
    if url.startswith("sqlite"):
        _sqlite_wal(url)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(url, **kwargs)
    if url.startswith("sqlite"):
        import sqlalchemy

        # WAL (set once per database file) lets trials write while the sensor reads;
        # synchronous=NORMAL is safe under WAL and cuts each commit's fsync.
        sqlalchemy.event.listen(storage.engine, "connect", lambda conn, _: conn.execute("PRAGMA synchronous=NORMAL"))
        storage.engine.dispose()
    with _LOCK:
        storage = _STORAGES.setdefault(key, storage)
        while len(_STORAGES) > 32:
            # Closes the pool's idle connections; a Study still holding this storage reconnects on use.
            _STORAGES.popitem(last=False)[1].engine.dispose()
        return storage


def _sqlite_wal(url: str) -> None:
    import sqlite3

    path = url.split("sqlite:///", 1)[1].split("?")[0]
    if not path or path == ":memory:":
        return
    with contextlib.closing(sqlite3.connect(path, timeout=60)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")


# -- reports ---------------------------------------------------------------------------------


def _fmt(values: Optional[Sequence[float]]) -> str:
    return "" if values is None else ", ".join(f"{v:.4g}" for v in values)


def trials_markdown(trials: Sequence[Any], objectives: Sequence[Objective], limit: int = 25) -> str:
    """A trials table: all trials of a small sweep, else the best `limit` completed plus those in flight."""
    names = ", ".join(o.metric for o in objectives)
    header = f"| trial | state | {names} | params | note |\n|---|---|---|---|---|\n"
    signs = [1.0 if o.mode == "max" else -1.0 for o in objectives]

    def row(t: Any) -> str:
        note = failure_reason(t)[:120] if t.state.name == "FAIL" else ""
        if t.state.name == "PRUNED" and t.intermediate_values:
            note = f"pruned at epoch {max(t.intermediate_values)}"
        return f"| trial-{t.number:04d} | {t.state.name} | {_fmt(t.values)} | {t.params} | {note} |"

    if len(trials) <= limit:
        return header + "\n".join(row(t) for t in sorted(trials, key=lambda t: t.number))
    done = sorted((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: tuple(-s * v for s, v in zip(signs, t.values)))
    shown = done[:limit] + [t for t in trials if not t.state.is_finished()][:limit]
    return f"showing the best {min(limit, len(done))} of {len(done)} completed trials and up to {limit} in flight\n\n" + header + "\n".join(row(t) for t in shown)


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def history_png(trials: Sequence[Any], objective: Objective) -> bytes:
    """Optimization history of the first objective: every finished trial and the best so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    done = sorted((t for t in trials if t.state.name in ("COMPLETE", "PRUNED") and t.values), key=lambda t: t.number)
    complete = [t for t in done if t.state.name == "COMPLETE"]
    pruned = [t for t in done if t.state.name == "PRUNED"]
    ax.scatter([t.number for t in complete], [t.values[0] for t in complete], s=14, label="complete")
    if pruned:
        ax.scatter([t.number for t in pruned], [t.values[0] for t in pruned], s=14, marker="x", color="grey", label="pruned (last report)")
    best, xs, ys = None, [], []
    for t in complete:
        v = t.values[0]
        best = v if best is None else (max(best, v) if objective.mode == "max" else min(best, v))
        xs.append(t.number)
        ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="tab:red", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(objective.metric)
    ax.set_title("optimization history")
    ax.legend(loc="best", fontsize=8)
    return _png(fig)


# fANOVA fits random forests: ~6 s for 500 trials, minutes for 10,000. Larger studies use PED-ANOVA (< 1 s).
FANOVA_MAX_TRIALS = 300


def importance_method(completed: int) -> str:
    return "fANOVA" if completed <= FANOVA_MAX_TRIALS else "PED-ANOVA"


def importance(study: Any, objective: Objective) -> dict[str, float]:
    """Parameter importances for the first objective (fANOVA, seeded; PED-ANOVA past 300 trials); needs 2+ completed trials.

    Raises:
        SweepError: fewer than two completed trials, or no searched parameter.
    """
    import optuna

    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) < 2:
        raise SweepError(f"parameter importance needs at least 2 completed trials, the study has {len(complete)}")
    if not complete[0].params:
        raise SweepError("parameter importance needs searched parameters; this sweep has none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        evaluator = (
            optuna.importance.FanovaImportanceEvaluator(seed=0)
            if len(complete) <= FANOVA_MAX_TRIALS
            else optuna.importance.PedAnovaImportanceEvaluator()
        )
        found = optuna.importance.get_param_importances(study, evaluator=evaluator, target=lambda t: t.values[0], normalize=True)
    return {k: float(v) for k, v in found.items()}


def importance_png(importances: dict[str, float], objective: Objective, method: str = "fANOVA") -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(importances)[::-1]
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(names)))
    ax.barh(names, [importances[n] for n in names])
    ax.set_xlabel(f"importance for {objective.metric} ({method})")
    ax.set_title("parameter importance")
    return _png(fig)


def pareto_png(trials: Sequence[Any], front: Sequence[Any], objectives: Sequence[Objective], picked: Optional[Any] = None) -> bytes:
    """The first two objectives of every completed trial, the Pareto front highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    done = [t for t in trials if t.state.name == "COMPLETE"]
    ax.scatter([t.values[0] for t in done], [t.values[1] for t in done], s=14, color="lightgrey", label="trials")
    ordered = sorted(front, key=lambda t: t.values[0])
    ax.plot([t.values[0] for t in ordered], [t.values[1] for t in ordered], "o-", color="tab:blue", label="Pareto front")
    if picked is not None:
        ax.scatter([picked.values[0]], [picked.values[1]], s=80, facecolors="none", edgecolors="tab:red", label=f"picked trial-{picked.number:04d}")
    ax.set_xlabel(f"{objectives[0].metric} ({objectives[0].mode})")
    ax.set_ylabel(f"{objectives[1].metric} ({objectives[1].mode})")
    ax.legend(loc="best", fontsize=8)
    return _png(fig)


def markdown_image(png: bytes, alt: str) -> str:
    """Markdown embedding a PNG, which the Dagster UI renders in asset metadata."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


@dataclass
class SweepReport:
    """What the `sweep` asset shows: numbers, tables and PNG plots."""

    status: SweepStatus
    best_params: dict[str, Any]
    best_values: Optional[list[float]]
    best_trial: Optional[int]
    trials_md: str
    pareto_md: Optional[str]
    importances: dict[str, float]
    importance_note: str
    plots: dict[str, bytes] = field(default_factory=dict)


def build_report(store: SweepStore, study: Any, spec: PipelineSpec) -> SweepReport:
    """Best parameters, trials table, history, importance and (multi-objective) Pareto plots."""
    trials = study.get_trials(deepcopy=False)
    objectives = objectives_of(spec)
    status = store.status(study, spec.search)
    plots: dict[str, bytes] = {}
    best_params: dict[str, Any] = {}
    best_values: Optional[list[float]] = None
    best_trial: Optional[int] = None
    pareto_md: Optional[str] = None
    if any(t.state.name in ("COMPLETE", "PRUNED") for t in trials):
        plots["history"] = history_png(trials, objectives[0])
    if spec.search.multi_objective:
        front = pareto_front(trials, [o.mode for o in objectives])
        if front:
            picked, reason = pick_trial(front, objectives, spec.search.pick)
            best_params, best_values, best_trial = dict(picked.params), list(picked.values), picked.number
            pareto_md = f"picked trial-{picked.number:04d}: {reason}\n\n" + trials_markdown(front, objectives, limit=len(front))
            plots["pareto"] = pareto_png(trials, front, objectives, picked)
    elif status.complete:
        sign = 1.0 if objectives[0].mode == "max" else -1.0
        best = max((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: (sign * t.values[0], -t.number))
        best_params, best_values, best_trial = dict(best.params), list(best.values), best.number
    importances: dict[str, float] = {}
    try:
        importances = importance(study, objectives[0])
        note = f"{importance_method(status.complete)} on the {status.complete} completed trials"
        plots["importance"] = importance_png(importances, objectives[0], importance_method(status.complete))
    except SweepError as e:
        note = str(e)
    return SweepReport(
        status=status,
        best_params=best_params,
        best_values=best_values,
        best_trial=best_trial,
        trials_md=trials_markdown(trials, objectives),
        pareto_md=pareto_md,
        importances=importances,
        importance_note=note,
        plots=plots,
    )


def report_metadata(report: SweepReport, store: Any, base_uri: str, objectives: Sequence[Objective]) -> dict[str, Any]:
    """Dagster metadata for a sweep report; the plots are written as PNGs under `base_uri` and embedded.

    Args:
        store: the object store (`resources.storage.ObjectStore`).
    """
    from dagster import MetadataValue

    st = report.status
    names = [o.metric for o in objectives]
    meta: dict[str, Any] = {
        "status": "stopped" if st.stop_reason else ("finished" if st.done else "running"),
        "stop_reason": st.stop_reason or "",
        "finished_trials": st.finished,
        "complete_trials": st.complete,
        "pruned_trials": st.pruned,
        "failed_trials": st.failed,
        "in_flight": st.in_flight,
        "budget": st.budget,
        "objectives": MetadataValue.json([o.model_dump() for o in objectives]),
        "best_trial": "" if report.best_trial is None else f"trial-{report.best_trial:04d}",
        "best_params": MetadataValue.json(report.best_params),
        "table": MetadataValue.md(report.trials_md),
        "param_importance": MetadataValue.json({k: float(v) for k, v in report.importances.items()}),
        "param_importance_note": report.importance_note,
    }
    for name, value in zip(names, report.best_values or []):
        meta[f"best_{name}"] = float(value)
    if report.pareto_md is not None:
        meta["pareto_front"] = MetadataValue.md(report.pareto_md)
    for name, png in report.plots.items():
        uri = f"{base_uri}/{name}.png"
        store.write_bytes(uri, png)
        meta[f"{name}_plot"] = MetadataValue.md(markdown_image(png, name))
        meta[f"{name}_png"] = MetadataValue.path(uri)
    return meta
