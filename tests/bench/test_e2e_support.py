"""The end-to-end benchmarks' accounting: a run's phases from its events, the landing -> first step breakdown, the
instance config."""

from __future__ import annotations

import pytest
import yaml

from bench.e2e_support import ENQUEUED, START, STARTING, STEP_START, STEP_SUCCESS, SUCCESS, dagster_yaml, run_phases
from bench.time_to_first_step import breakdown

EVENTS = [
    (ENQUEUED, 100.0, None),
    (STARTING, 102.5, None),
    ("ENGINE_EVENT", 103.0, None),
    (START, 108.0, None),
    (STEP_START, 110.0, "a"),
    (STEP_SUCCESS, 111.0, "a"),
    (STEP_START, 111.5, "b"),
    (STEP_SUCCESS, 120.0, "b"),
    (SUCCESS, 121.0, None),
]


def test_run_phases_split_a_run_at_its_events_and_add_up() -> None:
    phases = run_phases(EVENTS)
    assert phases == {"queued": 2.5, "launch": 5.5, "to_first_step": 2.0, "steps": 10.0, "finish": 1.0, "total": 21.0}
    assert sum(v for k, v in phases.items() if k != "total") == pytest.approx(phases["total"])


def test_run_phases_count_from_the_submitters_clock_when_given() -> None:
    phases = run_phases(EVENTS, submitted=99.0)
    assert phases["queued"] == 3.5 and phases["total"] == 22.0


def test_run_phases_name_a_missing_event() -> None:
    with pytest.raises(ValueError, match="PIPELINE_START"):
        run_phases([e for e in EVENTS if e[0] != START])
    with pytest.raises(ValueError, match="no step"):
        run_phases([e for e in EVENTS if e[0] not in (STEP_START, STEP_SUCCESS)])


def test_run_phases_refuse_events_out_of_order() -> None:
    with pytest.raises(ValueError, match="out of order"):
        run_phases(EVENTS, submitted=105.0)


def test_landing_to_first_step_breakdown_adds_up_to_the_total() -> None:
    prepare = run_phases(EVENTS)  # created at 100, succeeded at 121
    train_events = [(ENQUEUED, 140.0, None), (STARTING, 141.0, None), (START, 146.0, None), (STEP_START, 148.0, "t")]
    attempt = {"started": 155.0, "first_step_at": 160.0}
    phases = breakdown(70.0, 100.0, prepare, 139.0, train_events, attempt)
    assert phases["landing_sensor_tick"] == 30.0
    assert phases["sweep_sensor_tick"] == 18.0  # prepare success (121) -> train run created (139)
    assert phases["train_queue_and_launch"] == 7.0 and phases["step_to_trial_process"] == 7.0
    assert phases["total"] == 90.0
    assert sum(v for k, v in phases.items() if k != "total") == pytest.approx(phases["total"])


def test_instance_config_is_the_shipped_one_on_postgres() -> None:
    config = yaml.safe_load(dagster_yaml("postgresql+psycopg2://postgres@127.0.0.1:5432/x"))
    assert config["storage"] == {"postgres": {"postgres_url": "postgresql+psycopg2://postgres@127.0.0.1:5432/x"}}
    assert config["run_coordinator"]["config"]["max_concurrent_runs"] == 3  # deploy/local/dagster.yaml's queue
    assert config["run_coordinator"]["class"] == "LocalRunQueue"
    assert config["telemetry"] == {"enabled": False}
