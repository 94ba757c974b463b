"""`platform/gpu_usage`: where device time and money go, per run and per team.

Reads every trial's `result.json` under `<store>/runs/<team>/<pipeline>/<study>/<trial>/`
(written by the training process; see `training.spec.TrainResult`) with the
trial's `spec.json` (accelerator kind) and its attempt records (first start),
and summarizes:

- device-hours: `TrainResult.device_hours` (wall time x world size over all attempts);
- goodput: productive time / wall time from `TrainResult.goodput` (runs without
  an accounting record count as fully productive and are flagged);
- queue wait, where known: from the last launch (the launcher writes `spec.json`) to
  the start of its first attempt; on Kubernetes this includes Kueue admission;
- cost: device-hours x the configured price per device-hour of the run's accelerator;
- idle capacity, when the cluster's device count is configured.

The asset lives in its own `platform` code location (workspace.yaml), because
one asset key can be defined by only one code location.
"""

import base64
import io
from dataclasses import asdict, dataclass
from typing import Any, Optional

from dagster import AssetExecutionContext, AssetKey, Config, MaterializeResult, MetadataValue, asset
from pydantic import Field, field_validator

from resources.storage import ObjectStore
from trainyard import naming

USAGE_KEY = AssetKey(["platform", "gpu_usage"])


class UsageConfig(Config):
    """Prices and capacity; run config of the usage asset (defaults are list prices of a typical cloud)."""

    price_per_gpu_hour: float = Field(2.50, ge=0, description="price of one GPU for one hour")
    price_per_cpu_hour: float = Field(0.05, ge=0, description="price of one CPU training process for one hour")
    team_gpu_prices: dict[str, float] = Field(
        default_factory=dict,
        description="price of one GPU-hour per team where it differs (reserved capacity, internal chargeback); other "
                    "teams pay price_per_gpu_hour",
    )
    currency: str = "USD"
    capacity_devices: Optional[int] = Field(None, ge=1, description="devices in the cluster, for idle capacity")
    window_hours: Optional[float] = Field(
        None, gt=0, description="period for idle capacity; default: first launch to last finish"
    )

    @field_validator("team_gpu_prices")
    @classmethod
    def _team_prices(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {team: p for team, p in v.items() if not p >= 0}
        if bad:
            raise ValueError(f"team_gpu_prices must be >= 0 per GPU-hour for every team; got {bad}")
        return v


@dataclass(frozen=True)
class RunUsage:
    """One trial's use of devices."""

    team: str
    pipeline: str
    study: str
    trial: str
    accelerator: str
    world_size: int
    device_hours: float
    goodput: Optional[float]
    wall_seconds: float
    queue_wait_seconds: Optional[float]
    launched_at: Optional[float]
    finished_at: Optional[float]
    result_uri: str

    @property
    def productive_device_hours(self) -> float:
        return self.device_hours * (1.0 if self.goodput is None else self.goodput)


def collect_runs(store: ObjectStore) -> list[RunUsage]:
    """Every finished trial under `<store>/runs`, sorted by team, pipeline, study and trial."""
    runs = []
    for info in store.list_files(naming.trial_results_glob(store)):
        directory = info.uri.rsplit("/", 1)[0]
        team, pipeline, study, trial = directory.split("/")[-4:]
        result = store.read_json(info.uri)
        spec_uri = f"{directory}/spec.json"
        spec = store.read_json(spec_uri) if store.exists(spec_uri) else {}
        launched = store.stat(spec_uri).mtime if spec else None
        # The launcher rewrites spec.json at every launch: measure the wait of the last one.
        starts = [store.read_json(f)["started"] for f in store.glob(f"{directory}/attempts/*.json")]
        after = [s for s in starts if launched is not None and s >= launched]
        first_start = min(after) if after else None
        goodput = (result.get("goodput") or {}).get("goodput")
        runs.append(
            RunUsage(
                team=team,
                pipeline=pipeline,
                study=study,
                trial=trial,
                accelerator=((spec.get("distribution") or {}).get("accelerator")) or "cpu",
                world_size=int(result["world_size"]),
                device_hours=float(result["device_hours"]),
                goodput=None if goodput is None else float(goodput),
                wall_seconds=float(result["wall_seconds"]),
                queue_wait_seconds=max(0.0, first_start - launched)
                if first_start is not None and launched is not None
                else None,
                launched_at=launched,
                finished_at=info.mtime,
                result_uri=info.uri,
            )
        )
    return sorted(runs, key=lambda r: (r.team, r.pipeline, r.study, r.trial))


def price(run: RunUsage, config: UsageConfig) -> float:
    """Price of one device-hour of `run`: its team's GPU price, the platform's, or the CPU price."""
    if run.accelerator != "gpu":
        return config.price_per_cpu_hour
    return config.team_gpu_prices.get(run.team, config.price_per_gpu_hour)


def summarize(runs: list[RunUsage], config: UsageConfig) -> dict[str, Any]:
    """Totals per team and overall (pure; numbers unrounded)."""

    def totals(group: list[RunUsage]) -> dict[str, Any]:
        hours = sum(r.device_hours for r in group)
        productive = sum(r.productive_device_hours for r in group)
        waits = [r.queue_wait_seconds for r in group if r.queue_wait_seconds is not None]
        return {
            "runs": len(group),
            "device_hours": hours,
            "gpu_hours": sum(r.device_hours for r in group if r.accelerator == "gpu"),
            "productive_device_hours": productive,
            "goodput": productive / hours if hours else None,
            "mean_queue_wait_seconds": sum(waits) / len(waits) if waits else None,
            "runs_with_queue_wait": len(waits),
            "runs_without_goodput": sum(1 for r in group if r.goodput is None),
            "cost": sum(r.device_hours * price(r, config) for r in group),
        }

    teams = sorted({r.team for r in runs})
    summary: dict[str, Any] = {
        "currency": config.currency,
        "teams": {t: totals([r for r in runs if r.team == t]) for t in teams},
        "total": totals(runs),
    }
    if config.capacity_devices is not None and runs:
        starts = [r.launched_at for r in runs if r.launched_at is not None]
        ends = [r.finished_at for r in runs if r.finished_at is not None]
        window = config.window_hours or ((max(ends) - min(starts)) / 3600.0 if starts and ends else 0.0)
        capacity = config.capacity_devices * window
        summary["capacity"] = {
            "devices": config.capacity_devices,
            "window_hours": window,
            "device_hours": capacity,
            "idle_device_hours": max(0.0, capacity - summary["total"]["device_hours"]),
            "utilization": summary["total"]["device_hours"] / capacity if capacity else None,
        }
    return summary


def _fmt(v: Optional[float], digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def team_table(summary: dict[str, Any]) -> str:
    cur = summary["currency"]
    head = (
        f"| team | runs | device-hours | GPU-hours | productive | goodput | mean queue wait (s) | cost ({cur}) "
        "|\n|---|---|---|---|---|---|---|---|\n"
    )
    rows = [
        f"| {name} | {t['runs']} | {_fmt(t['device_hours'])} | {_fmt(t['gpu_hours'])} | "
        f"{_fmt(t['productive_device_hours'])} | "
        f"{_fmt(t['goodput'], 3)} | {_fmt(t['mean_queue_wait_seconds'], 1)} | {_fmt(t['cost'], 2)} |"
        for name, t in [*summary["teams"].items(), ("**total**", summary["total"])]
    ]
    return head + "\n".join(rows)


def run_table(runs: list[RunUsage], config: UsageConfig, limit: int = 200) -> str:
    head = (
        "| team/pipeline | study | trial | accelerator x world | device-hours | goodput | queue wait (s) | cost "
        f"({config.currency}) |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    rows = [
        f"| {r.team}/{r.pipeline} | {r.study} | {r.trial} | {r.accelerator} x {r.world_size} | {_fmt(r.device_hours)} "
        "| "
        f"{_fmt(r.goodput, 3)} | {_fmt(r.queue_wait_seconds, 1)} | {_fmt(r.device_hours * price(r, config), 4)} |"
        for r in runs[-limit:]
    ]
    note = f"\n\n(last {limit} of {len(runs)} runs)" if len(runs) > limit else ""
    return head + "\n".join(rows) + note


def usage_plot(summary: dict[str, Any]) -> bytes:
    """PNG: device-hours per team, productive and not, with the cost on each bar."""
    # matplotlib is heavy and only this asset draws: import it when the asset runs, not with every code location.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    teams = list(summary["teams"])
    productive = [summary["teams"][t]["productive_device_hours"] for t in teams]
    other = [summary["teams"][t]["device_hours"] - p for t, p in zip(teams, productive)]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(teams) + 2), 3.5), dpi=100)
    ax.bar(teams, productive, label="productive")
    ax.bar(teams, other, bottom=productive, label="startup, checkpoints, lost work")
    for i, t in enumerate(teams):
        ax.annotate(f"{summary['teams'][t]['cost']:.2f} {summary['currency']}", (i, productive[i] + other[i]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("device-hours")
    ax.set_title("Device-hours and cost per team")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


@asset(
    key=USAGE_KEY,
    group_name="platform",
    description="Device-hours, goodput, queue wait and cost per run and per team, from every trial's result.json.",
)
def gpu_usage(context: AssetExecutionContext, config: UsageConfig, store: ObjectStore) -> MaterializeResult:
    runs = collect_runs(store)
    summary = summarize(runs, config)
    png = usage_plot(summary)
    base = naming.usage_dir(store)
    store.write_bytes(f"{base}/usage.png", png)
    store.write_json(f"{base}/summary.json", {**summary, "runs": [asdict(r) for r in runs]})
    total = summary["total"]
    metadata: dict[str, Any] = {
        "runs": total["runs"],
        "device_hours": total["device_hours"],
        "gpu_hours": total["gpu_hours"],
        "productive_device_hours": total["productive_device_hours"],
        "goodput": total["goodput"] if total["goodput"] is not None else 0.0,
        f"cost_{config.currency.lower()}": total["cost"],
        "price_per_gpu_hour": config.price_per_gpu_hour,
        **({"team_gpu_prices": MetadataValue.json(dict(config.team_gpu_prices))} if config.team_gpu_prices else {}),
        "teams": MetadataValue.md(team_table(summary)),
        "per_run": MetadataValue.md(run_table(runs, config)),
        "plot": MetadataValue.md(f"![device-hours per team](data:image/png;base64,{base64.b64encode(png).decode()})"),
        "plot_file": MetadataValue.path(f"{base}/usage.png"),
        "summary": MetadataValue.path(f"{base}/summary.json"),
    }
    if "capacity" in summary:
        metadata["idle_device_hours"] = summary["capacity"]["idle_device_hours"]
        metadata["cluster_utilization"] = summary["capacity"]["utilization"] or 0.0
    context.log.info(
        f"{total['runs']} runs, {total['device_hours']:.4f} device-hours, {total['cost']:.2f} {config.currency}"
    )
    return MaterializeResult(metadata=metadata)
