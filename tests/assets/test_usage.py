"""`platform/gpu_usage`: exact sums over hand-written results, then over real GBT trials, through `materialize`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import pytest
from dagster import materialize

from assets.usage import UsageConfig, collect_runs, gpu_usage, summarize, team_table
from resources.storage import ObjectStore

T0 = 1_700_000_000.0


def write_run(root: Path, key: str, device_hours: float, accelerator: Optional[str], goodput: Optional[float],
              wait: Optional[float], launched: float = T0) -> Path:
    d = root / "runs" / key
    d.mkdir(parents=True)
    result = {
        "world_size": 2,
        "device_hours": device_hours,
        "wall_seconds": device_hours * 1800,
        "goodput": {} if goodput is None else {"goodput": goodput},
    }
    (d / "result.json").write_text(json.dumps(result))
    if accelerator is not None:
        (d / "spec.json").write_text(json.dumps({"distribution": {"accelerator": accelerator}}))
        os.utime(d / "spec.json", (launched, launched))
    if wait is not None:
        (d / "attempts").mkdir()
        (d / "attempts" / "old.json").write_text(json.dumps({"started": launched - 500.0}))  # an earlier launch
        (d / "attempts" / "new.json").write_text(json.dumps({"started": launched + wait}))
    return d


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    write_run(tmp_path, "vision/digits/s1/trial-0000", 0.5, "gpu", 0.8, 30.0)
    write_run(tmp_path, "vision/digits/s1/trial-0001", 0.25, "gpu", None, None)
    write_run(tmp_path, "tabular/bc/s2/trial-0000", 0.1, "cpu", 0.5, 2.0)
    return ObjectStore(root=str(tmp_path))


CONFIG = UsageConfig(price_per_gpu_hour=2.0, price_per_cpu_hour=0.1, capacity_devices=4, window_hours=10.0)


def test_runs_are_read_with_team_accelerator_goodput_and_wait(store: ObjectStore) -> None:
    runs = collect_runs(store)
    assert [(r.team, r.pipeline, r.study, r.trial) for r in runs] == [
        ("tabular", "bc", "s2", "trial-0000"),
        ("vision", "digits", "s1", "trial-0000"),
        ("vision", "digits", "s1", "trial-0001"),
    ]
    assert [r.accelerator for r in runs] == ["cpu", "gpu", "gpu"]
    assert [r.queue_wait_seconds for r in runs] == [2.0, 30.0, None]  # the wait of the last launch
    assert [r.goodput for r in runs] == [0.5, 0.8, None]


def test_summary_numbers_are_exact(store: ObjectStore) -> None:
    s = summarize(collect_runs(store), CONFIG)
    vision, tabular, total = s["teams"]["vision"], s["teams"]["tabular"], s["total"]
    assert vision["device_hours"] == pytest.approx(0.75) and vision["gpu_hours"] == pytest.approx(0.75)
    assert vision["productive_device_hours"] == pytest.approx(0.5 * 0.8 + 0.25)  # no accounting: counted productive
    assert vision["goodput"] == pytest.approx(0.65 / 0.75) and vision["runs_without_goodput"] == 1
    assert vision["mean_queue_wait_seconds"] == 30.0 and vision["runs_with_queue_wait"] == 1
    assert vision["cost"] == pytest.approx(1.5) and tabular["cost"] == pytest.approx(0.01)
    assert total["runs"] == 3 and total["device_hours"] == pytest.approx(0.85) and total["cost"] == pytest.approx(1.51)
    assert total["mean_queue_wait_seconds"] == pytest.approx(16.0)
    assert s["capacity"] == pytest.approx(
        {"devices": 4, "window_hours": 10.0, "device_hours": 40.0, "idle_device_hours": 39.15, "utilization": 0.85 / 40}
    )
    table = team_table(s)
    assert "| vision | 2 | 0.7500 | 0.7500 | 0.6500 | 0.867 | 30.0 | 1.50 |" in table
    assert "| **total** | 3 | 0.8500 |" in table


def test_a_team_price_overrides_the_gpu_price_for_that_team_only(store: ObjectStore) -> None:
    config = UsageConfig(
        price_per_gpu_hour=2.0, price_per_cpu_hour=0.1, team_gpu_prices={"vision": 1.2, "tabular": 9.0}
    )
    s = summarize(collect_runs(store), config)
    assert s["teams"]["vision"]["cost"] == pytest.approx(0.75 * 1.2)
    assert s["teams"]["tabular"]["cost"] == pytest.approx(0.01)  # its run is on CPU: the CPU price applies
    assert s["total"]["cost"] == pytest.approx(0.9 + 0.01)
    with pytest.raises(Exception, match=r"team_gpu_prices must be >= 0.*'vision': -1.0"):
        UsageConfig(team_gpu_prices={"vision": -1.0})


def test_no_runs_summarize_to_zero(tmp_path: Path) -> None:
    s = summarize(collect_runs(ObjectStore(root=str(tmp_path))), CONFIG)
    assert s["total"]["runs"] == 0 and s["total"]["goodput"] is None and "capacity" not in s


def _materialize(store: ObjectStore, config: dict[str, Any]) -> dict[str, Any]:
    result = materialize(
        [gpu_usage], resources={"store": store}, run_config={"ops": {"platform__gpu_usage": {"config": config}}}
    )
    assert result.success
    (event,) = result.get_asset_materialization_events()
    return {k: v.value for k, v in event.materialization.metadata.items()}


def test_asset_reports_table_plot_and_cost(store: ObjectStore, tmp_path: Path) -> None:
    meta = _materialize(
        store,
        {
            "price_per_gpu_hour": 2.0,
            "price_per_cpu_hour": 0.1,
            "capacity_devices": 4,
            "window_hours": 10.0,
            "team_gpu_prices": {"tabular": 3.0},
        },
    )
    assert meta["runs"] == 3 and meta["device_hours"] == pytest.approx(0.85) and meta["cost_usd"] == pytest.approx(1.51)
    assert meta["idle_device_hours"] == pytest.approx(39.15) and meta["team_gpu_prices"] == {"tabular": 3.0}
    assert "| tabular | 1 |" in meta["teams"] and "trial-0001" in meta["per_run"]
    assert meta["plot"].startswith("![device-hours per team](data:image/png;base64,")
    assert (tmp_path / "platform" / "gpu_usage" / "usage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "platform" / "gpu_usage" / "summary.json").read_text())
    assert len(summary["runs"]) == 3


def test_negative_price_is_rejected_naming_the_field(store: ObjectStore) -> None:
    result = materialize([gpu_usage], resources={"store": store}, raise_on_error=False,
                         run_config={"ops": {"platform__gpu_usage": {"config": {"price_per_gpu_hour": -1.0}}}})
    assert not result.success
    messages = []
    for event in result.all_events:
        error = getattr(event.event_specific_data, "error", None) if event.is_failure else None
        while error is not None:
            messages.append(error.message)
            error = error.cause
    assert any("price_per_gpu_hour" in m and "greater than or equal to 0" in m for m in messages)


def test_usage_matches_real_trials(tmp_path: Path) -> None:
    """Two real LightGBM trials through the training entrypoint; the asset's sums are theirs."""
    from tests.support.gbt import make_spec, run

    results = []
    for i in range(2):
        out = f"store/runs/tabular/test/study-1/trial-000{i}"
        (tmp_path / out).mkdir(parents=True)
        spec = make_spec(tmp_path, out=out, max_epochs=20 + 10 * i)
        (tmp_path / out / "spec.json").write_text(spec.to_json())  # as the launcher writes it, before the launch
        assert run(tmp_path, out, launch=f"launch-{i}") == 0
        results.append(json.loads((tmp_path / out / "result.json").read_text()))
    store = ObjectStore(root=str(tmp_path / "store"))
    runs = collect_runs(store)
    assert [r.device_hours for r in runs] == [r["device_hours"] for r in results]
    assert [r.goodput for r in runs] == [r["goodput"]["goodput"] for r in results]
    assert all(r.accelerator == "cpu" and r.queue_wait_seconds is not None and r.queue_wait_seconds >= 0 for r in runs)
    meta = _materialize(store, {"price_per_cpu_hour": 0.5})
    assert meta["device_hours"] == pytest.approx(sum(r["device_hours"] for r in results), rel=1e-12)
    assert meta["productive_device_hours"] == pytest.approx(
        sum(r["device_hours"] * r["goodput"]["goodput"] for r in results), rel=1e-12
    )
    assert meta["cost_usd"] == pytest.approx(0.5 * sum(r["device_hours"] for r in results), rel=1e-12)


def test_platform_is_its_own_code_location_with_a_daily_schedule() -> None:
    import yaml

    from assets.usage import USAGE_KEY
    from pipelines.platform.definitions import defs

    root = Path(__file__).resolve().parents[2]
    locations = {
        e["python_module"]["location_name"]: e["python_module"]["module_name"]
        for e in yaml.safe_load((root / "workspace.yaml").read_text())["load_from"]
    }
    assert locations["platform"] == "pipelines.platform.definitions"
    assert USAGE_KEY in defs.resolve_asset_graph().get_all_asset_keys()
    assert defs.resolve_schedule_def("platform__usage_schedule").cron_schedule == "0 6 * * *"
    defs.get_repository_def().load_all_definitions()  # what a code server does: names must not clash
