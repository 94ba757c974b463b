"""SweepStore against SQLite (and PostgreSQL in test_sensors): resume, windows, tells, heartbeats."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from resources.sweeps import (
    SweepError,
    build_sampler,
)
from tests.resources.sweeps.fakes import LR, store_at
from tests.support.heartbeats import age_heartbeats, heartbeats
from trainyard.search import CategoricalParam, FloatParam, IntParam, Objective, SearchSpec


def test_resumed_batches_draw_fresh_parameters(tmp_path: Path) -> None:
    search = SearchSpec(params=LR, n_trials=6, sampler="random", parallelism=2)
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("s", "max", search)
    assert sweeps.ensure_trials(study, search) == [0, 1]
    for n in (0, 1):
        sweeps.tell("s", n, 0.5, {})
    again = store_at(tmp_path).load_or_create("s", "max", search)  # a restarted process resumes
    assert sweeps.ensure_trials(again, search) == [0, 1, 2, 3]
    lrs = [t.params["lr"] for t in again.get_trials()]
    assert len(set(lrs)) == 4


def test_grid_sweep_visits_every_point_once(tmp_path: Path) -> None:
    search = SearchSpec(
        params={"h": IntParam(low=16, high=64, step=16), "act": CategoricalParam(choices=["relu", "tanh"])},
        n_trials=8,
        sampler="grid",
        parallelism=3,
    )
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("g", "max", search)
    while sweeps.status(study, search).remaining:
        for n in sweeps.ensure_trials(study, search):
            if sweeps.trial("g", n).state.name == "RUNNING":
                sweeps.tell("g", n, 0.1, {})
    points = sorted((t.params["h"], t.params["act"]) for t in study.get_trials())
    assert points == sorted((h, a) for h in (16, 32, 48, 64) for a in ("relu", "tanh"))


# -- the store ----------------------------------------------------------------------------------


def test_window_refills_and_failed_trials_are_replaced_until_the_budget(tmp_path: Path) -> None:
    search = SearchSpec(params=LR, n_trials=4, parallelism=2, max_failures=2, sampler="random")
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("s", "max", search)
    assert sweeps.ensure_trials(study, search) == [0, 1]
    assert sweeps.tell("s", 0, None, {"error": "boom"}, failed=True) == "FAIL"
    assert sweeps.ensure_trials(study, search) == [1, 2]
    assert sweeps.tell("s", 1, None, {"error": "boom again"}, failed=True) == "FAIL"
    assert sweeps.ensure_trials(study, search) == [2]  # failure budget spent: no replacement
    st = sweeps.status(study, search)
    assert st.stop_reason == "failure budget spent: 2 trials failed (max_failures 2); last error: boom again"
    assert sweeps.tell("s", 1, 0.9, {"late": True}) == "FAIL"  # a finished trial keeps its state
    assert "late" not in sweeps.trial("s", 1).user_attrs


def test_a_recorded_failure_stop_counts_the_trials_that_fail_after_it(tmp_path: Path) -> None:
    search = SearchSpec(params=LR, n_trials=6, parallelism=3, max_failures=2, sampler="random")
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("s", "max", search)
    assert sweeps.ensure_trials(study, search) == [0, 1, 2]
    sweeps.tell("s", 0, None, {"error": "boom"}, failed=True)
    sweeps.tell("s", 1, None, {"error": "boom again"}, failed=True)
    stopped = sweeps.status(study, search)
    sweeps.record_stop(study, stopped.stop_reason)  # what the sweep sensor does
    assert stopped.stop_reason == "failure budget spent: 2 trials failed (max_failures 2); last error: boom again"

    sweeps.tell("s", 2, None, {"error": "in flight, failed later"}, failed=True)
    st = sweeps.status(store_at(tmp_path).load_or_create("s", "max", search), search)
    assert st.failed == 3
    assert (
        st.stop_reason == "failure budget spent: 3 trials failed (max_failures 2); last error: in flight, failed later"
    )
    assert st.summary().endswith(f"0 in flight, 3 failed; stopped: {st.stop_reason}")


def test_directions_must_match_an_existing_study(tmp_path: Path) -> None:
    search = SearchSpec(params=LR)
    sweeps = store_at(tmp_path)
    sweeps.load_or_create("s", "max", search)
    with pytest.raises(
        SweepError, match=r"study 's' exists with directions \['maximize'\]; this sweep declares \['minimize'\]"
    ):
        sweeps.load_or_create("s", "min", search)
    with pytest.raises(SweepError, match="study 'nope' does not exist"):
        sweeps.trial("nope", 0)


def test_pruned_and_multi_objective_tells(tmp_path: Path) -> None:
    sweeps = store_at(tmp_path)
    search = SearchSpec(params=LR, n_trials=2)
    study = sweeps.load_or_create("p", "max", search)
    sweeps.ensure_trials(study, search)
    sweeps.storage().set_trial_intermediate_value(sweeps.storage().get_trial_id_from_study_id_trial_number(
        sweeps.storage().get_study_id_from_name("p"), 0), 3, 0.42)
    assert sweeps.tell("p", 0, None, {"result_uri": "r"}, pruned=True) == "PRUNED"
    assert sweeps.trial("p", 0).values == [0.42]
    multi = SearchSpec(
        params=LR, objectives=[Objective(metric="val_acc", mode="max"), Objective(metric="model_bytes", mode="min")]
    )
    m = sweeps.load_or_create("m", ["max", "min"], multi)
    sweeps.ensure_trials(m, multi)
    assert sweeps.tell("m", 0, [0.9, 1200.0], {}) == "COMPLETE"
    assert sweeps.trial("m", 0).values == [0.9, 1200.0]


def test_stale_heartbeat_fails_the_trial(tmp_path: Path) -> None:
    """Heartbeat ages are moved in the database (its clock judges them), so nothing waits out a grace period."""
    sweeps = store_at(tmp_path, heartbeat_interval=1, grace_period=600)
    db = tmp_path / "optuna.db"
    search = SearchSpec(params=LR, n_trials=3, parallelism=2)
    study = sweeps.load_or_create("h", "max", search)
    sweeps.ensure_trials(study, search)
    with sweeps.heartbeat("h", 0):
        assert age_heartbeats(db, 3600) == 1  # as if the last beat was an hour ago ...
        aged = heartbeats(db)
        deadline = time.monotonic() + 30
        while heartbeats(db) == aged:  # ... until the beating thread records the next one
            assert time.monotonic() < deadline, "no heartbeat recorded while the block ran"
            time.sleep(0.05)
        assert sweeps.fail_stale(study) == []  # beating: alive
    assert sweeps.fail_stale(study) == []  # its last beat is within the grace period
    age_heartbeats(db, 601)
    assert sweeps.fail_stale(study) == [0]  # stopped beating: its run is gone
    assert sweeps.fail_stale(study) == []  # trial 1 never beat (its run has not started): not stale
    assert sweeps.trial("h", 0).state.name == "FAIL"


def test_cmaes_sweep_adapts_across_fresh_samplers(tmp_path: Path) -> None:
    """Every ask builds a fresh sampler (as a sensor tick does); CMA-ES keeps its state in the study and converges."""
    search = SearchSpec(
        params={"x": FloatParam(low=-5, high=5), "y": FloatParam(low=-5, high=5)},
        n_trials=40,
        sampler="cmaes",
        parallelism=1,
    )
    assert type(build_sampler(search, 1)).__name__ == "CmaEsSampler"
    sweeps = store_at(tmp_path)
    sweeps.load_or_create("c", "min", search)
    values = []
    for _ in range(40):
        (number,) = sweeps.ask(sweeps.load("c", search), search, 1)
        p = sweeps.trial("c", number).params
        values.append((p["x"] - 1) ** 2 + (p["y"] + 2) ** 2)
        sweeps.tell("c", number, values[-1], {})
    assert any(k.startswith("cma:") for t in sweeps.load("c").get_trials() for k in t.system_attrs)
    assert sum(values[-10:]) < 0.25 * sum(values[:10]), (
        values
    )  # the search distribution moved to the optimum and narrowed
