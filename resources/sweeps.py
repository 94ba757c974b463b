"""Optuna study storage: where sweeps keep their trials (SQLite locally, PostgreSQL on clusters)."""

from __future__ import annotations

import functools
from typing import Any, Optional

from dagster import ConfigurableResource

from pipelines.spec import CategoricalParam, FloatParam, IntParam, SearchSpec


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


class SweepStore(ConfigurableResource):
    """Optuna RDB storage.

    Args:
        storage_url: SQLAlchemy URL, e.g. `sqlite:////abs/optuna.db` or
            `postgresql+psycopg2://user@host/db`.
    """

    storage_url: str

    def storage(self) -> Any:
        return _storage(self.storage_url)

    def load_or_create(self, study_name: str, direction: str, search: SearchSpec) -> Any:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = (
            optuna.samplers.RandomSampler(seed=search.seed)
            if search.sampler == "random"
            else optuna.samplers.TPESampler(seed=search.seed)
        )
        return optuna.create_study(
            study_name=study_name,
            storage=self.storage(),
            direction="maximize" if direction == "max" else "minimize",
            sampler=sampler,
            load_if_exists=True,
        )

    def ensure_trials(self, study: Any, search: SearchSpec) -> list[int]:
        """Ask the study for trials until it holds `n_trials` that have not failed.

        Asking is idempotent across restarts: trials already in the storage are
        reused, so a resumed sweep never duplicates trial numbers.
        """
        from optuna.trial import TrialState

        dists = distributions(search)
        live = [t.number for t in study.get_trials(deepcopy=False) if t.state != TrialState.FAIL]
        while len(live) < search.n_trials:
            live.append(study.ask(dists).number)
        return sorted(live)

    def load(self, study_name: str) -> Any:
        import optuna

        try:
            return optuna.load_study(study_name=study_name, storage=self.storage())
        except KeyError as e:
            raise SweepError(f"study {study_name!r} does not exist in {self.storage_url}; materialize the sweep asset first") from e

    def trial(self, study_name: str, number: int) -> Any:
        study = self.load(study_name)
        for t in study.get_trials(deepcopy=False):
            if t.number == number:
                return t
        raise SweepError(f"study {study_name!r} has no trial number {number}")

    def tell(self, study_name: str, number: int, value: Optional[float], attrs: dict[str, Any], failed: bool = False) -> None:
        from optuna.trial import TrialState

        study = self.load(study_name)
        trial = self.trial(study_name, number)
        storage = self.storage()
        trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study_name), number)
        for k, v in attrs.items():
            storage.set_trial_user_attr(trial_id, k, v)
        if trial.state.is_finished():
            return
        if failed:
            study.tell(number, state=TrialState.FAIL)
        else:
            study.tell(number, value)


@functools.lru_cache(maxsize=8)
def _storage(url: str) -> Any:
    import optuna

    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    return optuna.storages.RDBStorage(url, **kwargs)
