"""The sweep_10k benchmark's accounting: tick statistics, the registration figure, and tiny real sweeps with run
records."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import sweep_10k as sb


def test_tick_stats() -> None:
    stats = sb.tick_stats([0.5, 3.0, 1.0])
    assert stats == {
        "ticks": 3,
        "slowest_tick_seconds": 3.0,
        "median_tick_seconds": 1.0,
        "slowest_tick_share_of_timeout": 0.05,
    }
    with pytest.raises(ValueError, match="no ticks"):
        sb.tick_stats([])


def test_registration_value_is_measured_when_the_full_sweep_ran_and_a_lower_bound_otherwise() -> None:
    seeded = {"tick_seconds": [9.0, 4.0, 6.0, 1.0], "asked_per_tick": [64, 64, 64, 10]}
    curve = {"n1000": {"full": {"registration_seconds": 100.0}, "seeded": seeded}, "n10000": {"full": None}}
    value, said = sb.registration_value(curve, 10_000)
    assert value == 100.0 + math.ceil(9000 / 64) * 4.0 and said.startswith(
        "lower bound"
    )  # 1.0 asked only 10: not a full tick
    curve["n10000"]["full"] = {"registration_seconds": 700.0}
    assert sb.registration_value(curve, 10_000) == (700.0, "measured: a full 10000-trial sweep")
    value, said = sb.registration_value({"n50000": {"full": None, "seeded": seeded}}, 10_000)
    assert math.isnan(value) and said.startswith("not measured")


def test_the_sweep_uses_the_default_sampler_and_the_digits_space() -> None:
    from pipelines.vision.digits import digits
    from trainyard.search import SearchSpec

    spec = sb.sweep_spec(100)
    assert spec.search.sampler == SearchSpec.model_fields["sampler"].default == "tpe"
    assert spec.search.params == digits.search.params and spec.search.window == 64


def _check_records(sweep: sb.Sweep, trials: int) -> None:
    """One finished train run per trial, tagged with its partition and run key, and one partition per trial."""
    from dagster import DagsterRunStatus, RunsFilter

    runs = sweep.instance.get_runs(RunsFilter(job_name=sweep.names["train"]))
    keys = sorted(r.tags["dagster/partition"] for r in runs)
    assert len(runs) == trials and len(set(keys)) == trials and all(r.status == DagsterRunStatus.SUCCESS for r in runs)
    assert all(r.tags["dagster/run_key"] == f"{sweep.study}/{r.tags['dagster/partition']}" for r in runs)
    assert all(r.tags["trainyard/team"] == sweep.spec.team for r in runs)
    partitions = sorted(sweep.instance.get_dynamic_partitions(f"{sweep.spec.team}__{sweep.spec.name}__trials"))
    assert partitions == keys


def captured_sweeps(monkeypatch: pytest.MonkeyPatch) -> list[sb.Sweep]:
    """Every `Sweep` the benchmark builds from now on, in order."""
    made: list[sb.Sweep] = []
    init = sb.Sweep.__init__

    def keep(self: sb.Sweep, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(sb.Sweep, "__init__", keep)
    return made


@pytest.mark.slow
def test_a_tiny_full_sweep_registers_every_trial_with_a_run_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sb, "REAL_RUNS", 4)  # 4 runs the real way, the rest copied
    made = captured_sweeps(monkeypatch)
    full = sb.full_sweep(tmp_path, 12, None)
    assert full["partitions"] == 12 and full["train_runs"] == 12 and full["daemon_runs_timed"] == 4
    assert 0 < full["registration_seconds"] <= full["tick_seconds_total"]
    (sweep,) = made
    _check_records(sweep, 12)
    trials = sweep.sweeps.load(sweep.study).get_trials(deepcopy=False)
    assert len(trials) == 12 and all(t.state.name == "COMPLETE" for t in trials)


@pytest.mark.slow
def test_ticks_on_a_seeded_study_see_every_seeded_trial_and_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = captured_sweeps(monkeypatch)
    seeded = sb.seeded_ticks(tmp_path, 100, None, ticks=2)
    assert seeded["ticks"] == 2 and len(seeded["tick_seconds"]) == 2
    total = 100 + sum(seeded["asked_per_tick"])
    assert seeded["trials_in_study"] == total == seeded["train_runs"] == seeded["partitions"]
    (sweep,) = made
    _check_records(sweep, total)
    trials = sweep.sweeps.load(sweep.study).get_trials(deepcopy=False)
    assert len(trials) == total and all(t.state.name == "COMPLETE" for t in trials)
    numbers = sorted(t.number for t in trials)
    assert numbers == list(range(total))
    with pytest.raises(ValueError, match="more than 64"):
        sb.seeded_ticks(tmp_path / "small", 64, None)
