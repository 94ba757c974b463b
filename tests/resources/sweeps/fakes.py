"""Stand-in trials and a SQLite-backed store shared by the sweep tests."""

from __future__ import annotations

from pathlib import Path

from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from resources.sweeps import SweepStore
from trainyard.search import FloatParam, Objective

LR = {"lr": FloatParam(low=1e-3, high=1e-1, log=True)}
DIST = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}

MAXMIN = [Objective(metric="val_acc", mode="max"), Objective(metric="model_bytes", mode="min")]


def done(number: int, *values: float, state: TrialState = TrialState.COMPLETE, **attrs):
    """A finished trial (complete by default) with `values`, numbered `number`."""
    t = create_trial(state=state, values=list(values) if values and state == TrialState.COMPLETE else None,
                     params={"lr": 0.01}, distributions=DIST, user_attrs=attrs,
                     intermediate_values={0: values[0]} if state == TrialState.PRUNED and values else None)
    t.number = number
    return t


def running(number: int):
    """A trial in flight, numbered `number`."""
    t = create_trial(state=TrialState.RUNNING, params={"lr": 0.01}, distributions=DIST)
    t.number = number
    return t


def store_at(tmp_path: Path, **kw) -> SweepStore:
    """A store on a fresh SQLite database under `tmp_path`."""
    return SweepStore(storage_url=f"sqlite:///{tmp_path / 'optuna.db'}", **kw)
