"""`SweepStore`: the Dagster resource over Optuna's RDB storage (SQLite locally, PostgreSQL on clusters)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from typing import Any, Iterator, Optional, Sequence, Union

from dagster import ConfigurableResource
from pydantic import Field

from resources.sweeps.batch import create_running, one_write, tpe_batch
from resources.sweeps.rules import (
    CLAIMED_BY,
    CREATED_AT,
    MODES,
    STOPPED,
    SweepError,
    SweepStatus,
    build_sampler,
    derive_seed,
    distributions,
    optuna_direction,
    sweep_status,
)
from resources.sweeps.store import cached_study, open_storage, remember_study, study_storage
from training.spec import OPTUNA_URL_ENV, same_database
from trainyard.redact import redact_url, strip_url_credentials, url_has_credentials
from trainyard.search import SearchSpec


class SweepStore(ConfigurableResource):
    """Optuna RDB storage, with heartbeats.

    Credentials only by reference: Dagster keeps a resource's configuration
    (the code location's snapshot, the UI's resource page), so a storage that
    needs a password is configured with the URL without it and the name of the
    environment variable that holds the full URL (`by_reference`). Training
    processes get the full URL from their environment too, never from the spec
    (`pod_environment`, `training.spec.OptunaSpec.connect_url`).

    Args:
        storage_url: SQLAlchemy URL, e.g. `sqlite:////abs/optuna.db` or
            `postgresql+psycopg2://user@host/db`; without credentials when
            `storage_url_env` is set.
        storage_url_env: environment variable of this process holding
            `storage_url` with its credentials (e.g. `TRAINYARD_OPTUNA_URL`).
        heartbeat_interval: seconds between heartbeats of a training trial.
        grace_period: seconds without a heartbeat after which a running trial
            is failed (its run crashed or was killed); default twice the interval.
    """

    storage_url: str
    storage_url_env: Optional[str] = None
    heartbeat_interval: int = Field(60, ge=1)
    grace_period: Optional[int] = Field(None, ge=1)

    @classmethod
    def by_reference(cls, url: str, env: str = OPTUNA_URL_ENV, **fields: Any) -> "SweepStore":
        """The store of `url`, configured with `url` without credentials and, when it had some, the variable `env` that
        holds it."""
        stripped = strip_url_credentials(url)
        return cls(storage_url=stripped, storage_url_env=env if stripped != url else None, **fields)

    def connect_url(self) -> str:
        """The URL to connect with: `storage_url`, or the full URL from the variable `storage_url_env`.

        Raises:
            SweepError: the variable is not set, or names another database than `storage_url`.
        """
        if self.storage_url_env is None:
            return self.storage_url
        value = os.environ.get(self.storage_url_env)
        if not value:
            raise SweepError(
                f"the Optuna storage {redact_url(self.storage_url)} takes its credentials from the environment "
                "variable "
                f"{self.storage_url_env}, which this process does not have; set it to the full URL"
            )
        if not same_database(value, self.storage_url):
            raise SweepError(
                f"{self.storage_url_env} points to {redact_url(value)}, but this SweepStore is configured for "
                f"{redact_url(self.storage_url)}; set {self.storage_url_env} to that database's URL"
            )
        return value

    def shown_url(self) -> str:
        """The storage as a message or metadata may show it: no credentials, no query."""
        return redact_url(self.storage_url.split("?")[0])

    def pod_environment(self) -> dict[str, str]:
        """What a training process started by this orchestrator needs in its environment to report to the study.

        `{OPTUNA_URL_ENV: url}` when the URL carries credentials (the spec names
        that variable instead), else nothing.
        """
        url = self.connect_url()
        return {OPTUNA_URL_ENV: url} if url_has_credentials(url) else {}

    @property
    def _key(self) -> tuple[str, int, Optional[int]]:
        return (self.connect_url(), self.heartbeat_interval, self.grace_period)

    def storage(self) -> Any:
        return open_storage(*self._key)

    def load_or_create(self, study_name: str, direction: Union[str, Sequence[str]], search: SearchSpec) -> Any:
        """Create the study, or resume it when it exists (same name, same directions).

        Args:
            direction: `max`/`min`, or one per objective.
        """
        import optuna

        modes = [direction] if isinstance(direction, str) else list(direction)
        wanted = [optuna_direction(m) for m in modes]
        storage = study_storage(self.storage())
        study = optuna.create_study(study_name=study_name, storage=storage, directions=wanted, load_if_exists=True)  # type: ignore[arg-type]
        have = [d.name.lower() for d in study.directions]
        if have != wanted:
            raise SweepError(f"study {study_name!r} exists with directions {have}; this sweep declares {wanted}")
        if CREATED_AT not in study.user_attrs:
            study.set_user_attr(CREATED_AT, time.time())
        remember_study(self._key, study)
        return self._with_sampler(study, search)

    def load(self, study_name: str, search: Optional[SearchSpec] = None) -> Any:
        """The existing study; with `search`, its sampler is the declared one, freshly seeded."""
        study = cached_study(self._key, study_name)
        return self._with_sampler(study, search) if search is not None else study

    @contextlib.contextmanager
    def reads_once(self, study_name: str) -> Iterator[None]:
        """Within (this thread): the study's trials are read from the database once per write through this process.

        A sweep sensor's tick looks at the same trials 7-8 times (the sampler's
        seed, its own look, status, stale heartbeats, TPE's search space and
        fit); inside this, once, and again after its own writes. Writes by
        other processes (runs telling their trials) are seen on the next tick.
        """
        with cached_study(self._key, study_name)._storage.reads_once():
            yield

    def _with_sampler(self, study: Any, search: Optional[SearchSpec]) -> Any:
        if search is not None:
            sampler = build_sampler(search, derive_seed(search.seed, len(study.get_trials(deepcopy=False))))
            _keep_search_space(study.sampler, sampler, study)
            study.sampler = sampler
        return study

    def ask(self, study: Any, search: SearchSpec, n: int, deadline: Optional[float] = None) -> list[int]:
        """Ask up to `n` trials; stops early at `deadline` (time.monotonic()). Returns their numbers.

        Random and TPE sweeps are asked as one batch, each trial created with
        its parameters in a single write: a random sampler's draws do not
        depend on other trials, and TPE's are drawn from one fit of the study
        per batch (`resources.sweeps.batch.tpe_batch`), not one per trial. Other
        samplers, and TPE where a batch does not apply (before its startup
        trials, a dynamic search space), go through `Study.ask`, which re-reads
        every trial per ask.
        """
        dists = distributions(search)
        if search.sampler == "random":
            return self._ask_random(study, search, dists, n, deadline)
        if search.sampler == "tpe":
            batch = tpe_batch(study, study.sampler, dists, n, deadline)
            if batch is not None:
                return create_running(study, batch, dists)
        numbers: list[int] = []
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
            for _ in range(n):
                if deadline is not None and time.monotonic() >= deadline:
                    break
                numbers.append(study.ask(dists).number)
        return numbers

    def _ask_random(
        self, study: Any, search: SearchSpec, dists: dict[str, Any], n: int, deadline: Optional[float]
    ) -> list[int]:
        from optuna.trial import TrialState, create_trial

        sampler = build_sampler(search, derive_seed(search.seed, len(study.get_trials(deepcopy=False))))
        placeholder = create_trial(state=TrialState.RUNNING)
        batch = []
        for _ in range(n):
            if deadline is not None and time.monotonic() >= deadline:
                break
            batch.append(
                {name: sampler.sample_independent(study, placeholder, name, dist) for name, dist in dists.items()}
            )
        return create_running(study, batch, dists)

    def ask_claimed(self, study: Any, search: SearchSpec, claim: str) -> Optional[int]:
        """Ask one trial for the run `claim` to train next, within the sweep's window and budget; None when none may be
        asked.

        The trial is created with its parameters and `CLAIMED_BY = claim` in
        one write, under the study's lock, and only while fewer than
        `search.window` trials run and fewer than the budget are live: a
        sweep sensor ticking at the same moment can neither take the slot
        too nor mistake the trial for one it asked and has still to start.
        None when the sweep has stopped or has nothing left to ask, when the
        window is full, or when the sampler's draw cannot be made apart
        from its ask (samplers other than random and TPE; TPE where its
        batch does not apply past its startup trials), which the sensor then
        asks as usual. Before TPE's startup trials are done, its draw is its
        own independent random draw, as `Study.ask` makes it.
        """
        from optuna.samplers import TPESampler
        from optuna.trial import TrialState, create_trial

        if not one_write(study):
            return None
        status = self.status(study, search)
        if status.stop_reason or status.remaining <= 0 or status.in_flight >= search.window:
            return None
        dists = distributions(search)
        params: Optional[list[dict[str, Any]]] = None
        if search.sampler == "random":
            source = build_sampler(search, derive_seed(search.seed, len(study.get_trials(deepcopy=False))))
        elif search.sampler == "tpe" and isinstance(study.sampler, TPESampler):
            params = tpe_batch(study, study.sampler, dists, 1)
            if params is None and status.finished >= study.sampler._n_startup_trials:
                return None
            source = study.sampler._random_sampler
        else:
            return None
        if params is None:
            placeholder = create_trial(state=TrialState.RUNNING)
            params = [{name: source.sample_independent(study, placeholder, name, dist) for name, dist in dists.items()}]
        created = create_running(
            study, params, dists, user_attrs={CLAIMED_BY: claim}, max_running=search.window, max_live=status.budget
        )
        return created[0] if created else None

    def status(self, study: Any, search: SearchSpec, now: Optional[float] = None) -> SweepStatus:
        attrs = study.user_attrs
        return sweep_status(
            study.get_trials(deepcopy=False),
            search,
            [MODES[d.name] for d in study.directions],
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
            raise SweepError(
                f"study {study_name!r} does not exist in {self.shown_url()}; materialize the sweep asset first"
            ) from e
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
        study = cached_study(self._key, study_name, teller=True)
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


def _keep_search_space(old: Any, new: Any, study: Any) -> None:
    """A TPE sampler rebuilt for this tick takes over its predecessor's intersection search space on the same study.

    Optuna's `IntersectionSearchSpace` is incremental: it remembers the
    intersection of the finished trials up to the first unfinished one and
    reads only the trials after that (finished trials never change their
    distributions). The sweep store builds a fresh sampler every tick (a new
    seed), which recomputed the intersection over every trial, an equality of
    distributions per trial and parameter: 10-25 ms a tick at 10,000 trials.
    """
    from optuna.samplers import TPESampler
    from optuna.search_space import IntersectionSearchSpace

    if not (isinstance(old, TPESampler) and isinstance(new, TPESampler)):
        return
    space = getattr(old, "_search_space", None)
    if (
        type(space) is IntersectionSearchSpace
        and type(getattr(new, "_search_space", None)) is IntersectionSearchSpace
        and space._include_pruned == new._search_space._include_pruned
        and space._study_id in (None, study._study_id)
    ):
        new._search_space = space
