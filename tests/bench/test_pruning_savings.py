"""The pruning_savings benchmark: its accounting on tiny inputs, its pipeline, and one real pruned trial."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import pruning_savings as ps


def _trial(acc: float, seconds: float, status: str = "completed", epochs: int = 12, params: dict | None = None) -> dict:
    return {
        "best_val_acc": acc,
        "device_seconds": seconds,
        "status": status,
        "epochs": epochs,
        "params": params or {"lr": acc},
    }


def test_spent_to_counts_every_trial_up_to_the_first_reach() -> None:
    trials = [_trial(0.5, 10.0), _trial(0.9, 20.0), _trial(0.95, 30.0)]
    assert ps.spent_to(trials, 0.9) == 30.0
    assert ps.spent_to(trials, 0.95) == 60.0
    assert ps.spent_to(trials, 0.99) is None
    assert ps.spent_to(trials, 0.9, "epochs") == 24


def test_a_pruned_sweep_that_reaches_the_target_is_charged_what_it_spent_to_reach_it() -> None:
    full = [_trial(0.90, 40.0), _trial(0.97, 40.0), _trial(0.95, 40.0)]
    cut = [_trial(0.90, 40.0), _trial(0.97, 40.0), _trial(0.50, 8.0, "pruned", 1)]
    run = ps.charge(full, cut)
    assert run["unpruned_best"] == 0.97 and run["unpruned_seconds_to_best"] == 80.0
    assert run["reached"] and run["pruned_charged"] == run["pruned_seconds_to_best"] == 80.0
    assert run["pruned_trials"] == 1 and run["pruned_seconds_spent"] == 88.0 and run["unpruned_seconds_spent"] == 120.0


def test_a_pruned_sweep_that_misses_the_target_saves_nothing() -> None:
    full = [_trial(0.90, 40.0), _trial(0.97, 40.0)]
    cheap_miss = [_trial(0.90, 10.0), _trial(0.80, 5.0, "pruned", 1)]
    assert ps.charge(full, cheap_miss)["pruned_charged"] == 80.0  # charged the unpruned figure, not the 15 s it spent
    dear_miss = [_trial(0.90, 60.0), _trial(0.96, 60.0)]
    run = ps.charge(full, dear_miss)
    assert not run["reached"] and run["pruned_charged"] == 120.0  # charged all it spent
    with pytest.raises(ValueError, match="no trials"):
        ps.charge([], cut=full)


def test_the_cost_of_the_same_completed_trials_gauges_load_drift() -> None:
    full = [_trial(0.9, 100.0), _trial(0.8, 100.0), _trial(0.7, 100.0)]
    cut = [_trial(0.9, 80.0), _trial(0.8, 10.0, "pruned", 1), _trial(0.6, 50.0)]  # trial 2 drew other params
    assert ps.same_trials_cost_ratio(full, cut) == 0.8  # only trial 0 is the same trial completed in both
    assert ps.charge(full, cut)["same_trials_cost_ratio"] == 0.8
    assert ps.same_trials_cost_ratio(full, [_trial(0.1, 5.0, "pruned", 1)]) is None


def test_the_sweeps_are_the_digits_pipeline_with_default_sampler_and_pruner() -> None:
    from pipelines.vision.digits import digits

    full, cut = ps.pipeline(False, 8, 0), ps.pipeline(True, 8, 0)
    for spec in (full, cut):
        assert spec.search.params == digits.search.params and spec.search.sampler == "tpe"
        assert spec.model == digits.model and spec.distribution == digits.distribution
        assert spec.search.n_trials == 8 and spec.search.parallelism == 1
    assert not full.search.pruner.enabled
    assert (
        cut.search.pruner.kind == "median"
        and cut.search.pruner.n_startup_trials == 5
        and cut.search.pruner.n_warmup_steps == 0
    )


@pytest.mark.slow
def test_a_trial_below_the_median_is_pruned_through_the_launcher_and_charged(tmp_path: Path) -> None:
    """Five finished trials at val_acc 1.0 every epoch: the median pruner stops the next real trial after its first
    epoch."""
    from optuna.distributions import FloatDistribution, IntDistribution
    from optuna.trial import create_trial

    from resources.sweeps import SweepStore

    spec = ps.pipeline(True, 8, 0)
    sweeps = SweepStore(storage_url=f"sqlite:///{tmp_path / 'optuna.db'}")
    study = sweeps.load_or_create("digits-test", "max", spec.search)
    dists = {"lr": FloatDistribution(1e-3, 5e-2, log=True), "hidden": IntDistribution(16, 128, step=16)}
    for _ in range(5):
        study.add_trial(create_trial(value=1.0, params={"lr": 1e-2, "hidden": 64}, distributions=dists,
                                     intermediate_values={epoch: 1.0 for epoch in range(13)}))
    data = ps.write_digits(tmp_path / "data")
    assert sum(data.rows.values()) == 1797
    trial = ps.run_trial(spec, sweeps, "digits-test", data, tmp_path)
    assert trial["number"] == 5 and trial["status"] == "pruned" and trial["epochs"] < 12
    assert trial["world_size"] == 2 and trial["device_seconds"] > trial["fit_seconds"] > 0
    assert sweeps.trial("digits-test", 5).state.name == "PRUNED"
