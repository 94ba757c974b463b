"""GBT platform overhead: one LightGBM trial through Dagster vs the same training as a bare script.

Platform: on a fresh TRAINYARD_HOME, the `prepare` job (raw_data with its DVC pin,
validated_data with its Great Expectations suite and split, sweep) and one
`train` run (trial_model: TrainSpec, local launcher, `training.gbt` in its own
process, W&B offline, result), timed as wall clock from the first run's start
to the second run's end in a warm orchestrator process (imports done, as in a
running code server).

Bare: a fresh Python process that reads the same validated Parquet splits,
trains LightGBM with the same parameters, rounds, early stopping and thread
count, evaluates on the test split and saves the model file.

Value: median platform seconds; baseline: median bare seconds; ratio =
platform / bare (lower is better). Target: `details.added_seconds` (median
platform minus median bare) at most 10 s. Details break the platform time
down per asset and per pod phase. (The issue's figure through the real run
launcher and daemon, target 5 s, is not this benchmark: this one executes in
process.)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from bench.harness import Target, write_result

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 3
TARGET_SECONDS = 10.0
HPARAMS = {"objective": "binary", "early_stopping_rounds": 30, "num_leaves": 15, "learning_rate": 0.1}

BARE_SCRIPT = r"""
import json, sys, time
started = time.perf_counter()
import lightgbm as lgb
import numpy as np
import pyarrow.parquet as pq

cfg = json.loads(sys.argv[1])
def load(name):
    t = pq.read_table(cfg[name])
    x = np.column_stack([t.column(c).to_numpy().astype("float64") for c in cfg["features"]])
    return x, t.column(cfg["target"]).to_numpy()
(xt, yt), (xv, yv), (xs, ys) = load("train"), load("val"), load("test")
params = {**cfg["params"], "verbosity": -1, "num_threads": 1, "seed": 0, "deterministic": True, "force_col_wise": True, "metric": "binary_logloss"}
booster = lgb.train(params, lgb.Dataset(xt, yt), num_boost_round=cfg["rounds"], valid_sets=[lgb.Dataset(xv, yv)],
                    callbacks=[lgb.early_stopping(cfg["patience"], verbose=False)])
acc = float(((booster.predict(xs, num_iteration=booster.best_iteration) > 0.5) == ys).mean())
booster.save_model(cfg["out"], num_iteration=booster.best_iteration)
print(json.dumps({"seconds": time.perf_counter() - started, "test_acc": acc, "best_iteration": booster.best_iteration}))
"""


def _spec() -> Any:
    from pipelines.tabular.breast_cancer import breast_cancer
    from trainyard.search import SearchSpec

    model = breast_cancer.model.model_copy(update={"hparams": HPARAMS})
    return breast_cancer.model_copy(update={"model": model, "search": SearchSpec()})


def _step_seconds(instance: Any, run_id: str) -> dict[str, float]:
    started: dict[str, float] = {}
    out: dict[str, float] = {}
    for record in instance.all_logs(run_id):
        event = record.dagster_event
        if event is None or event.step_key is None:
            continue
        if event.event_type_value == "STEP_START":
            started[event.step_key] = record.timestamp
        elif event.event_type_value == "STEP_SUCCESS":
            out[event.step_key.split("__")[-1]] = record.timestamp - started[event.step_key]
    return out


def platform_once(home: Path) -> dict[str, Any]:
    """One fresh-home materialization of prepare + trial-0000; returns timings and the validated split."""
    from dagster import DagsterInstance

    from pipelines.environments import local_resources
    from pipelines.factory import build_definitions, job_names
    from pipelines.tabular.breast_cancer import landing_frame

    spec = _spec()
    landing = home / "store" / spec.source.prefix
    landing.mkdir(parents=True)
    landing_frame().to_csv(landing / "part-0.csv", index=False)
    defs = build_definitions(spec, resources=local_resources(home))
    (home / "dagster").mkdir()
    instance = DagsterInstance.local_temp(str(home / "dagster"), overrides={"telemetry": {"enabled": False}})
    names = job_names(spec)
    quiet = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
    started = time.perf_counter()
    prepare = defs.resolve_job_def(names["prepare"]).execute_in_process(instance=instance, run_config=quiet, raise_on_error=True)
    prepared = time.perf_counter()
    train = defs.resolve_job_def(names["train"]).execute_in_process(
        instance=instance, partition_key="trial-0000", run_config=quiet, raise_on_error=True
    )
    ended = time.perf_counter()
    node = f"{spec.team}__{spec.name}__"
    trial = train.output_for_node(f"{node}trial_model")
    return {
        "seconds": ended - started,
        "prepare_seconds": prepared - started,
        "train_seconds": ended - prepared,
        "steps": {**_step_seconds(instance, prepare.run_id), **_step_seconds(instance, train.run_id)},
        "pod_wall_seconds": trial.wall_seconds,
        "pod_startup_seconds": trial.goodput.get("startup_seconds"),
        "pod_fit_seconds": trial.fit_seconds,
        "test_acc": trial.metrics["test_acc"],
        "best_iteration": trial.metrics["best_iteration"],
        "validated": prepare.output_for_node(f"{node}validated_data").model_dump(),
    }


def bare_once(validated: dict[str, Any], out: Path) -> dict[str, Any]:
    spec = _spec()
    cfg = {"train": validated["train"], "val": validated["val"], "test": validated["test"], "features": spec.features,
           "target": spec.target, "params": {k: v for k, v in HPARAMS.items() if k != "early_stopping_rounds"},
           "rounds": spec.model.max_epochs, "patience": HPARAMS["early_stopping_rounds"], "out": str(out)}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", BARE_SCRIPT, json.dumps(cfg)], check=True, capture_output=True, text=True,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return {"seconds": time.perf_counter() - started, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> dict:
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    platform_runs, bare_runs = [], []
    with tempfile.TemporaryDirectory(prefix="gbt-overhead-") as tmp:
        for i in range(REPEATS):
            run = platform_once(Path(tmp) / f"home-{i}")
            bare_runs.append(bare_once(run.pop("validated"), Path(tmp) / f"bare-{i}.txt"))
            platform_runs.append(run)
    platform = statistics.median(r["seconds"] for r in platform_runs)
    bare = statistics.median(r["seconds"] for r in bare_runs)
    steps = {k: round(statistics.median(r["steps"][k] for r in platform_runs), 3) for k in platform_runs[0]["steps"]}
    return write_result(
        "gbt_overhead",
        platform,
        "s",
        bare,
        {
            "added_seconds": platform - bare,
            "median_step_seconds": steps,
            "platform_runs": platform_runs,
            "bare_runs": bare_runs,
            "data": "scikit-learn breast cancer, 569 rows x 30 features",
            "params": HPARAMS,
            "note": "the first platform run also pays first-use imports in the orchestrator; the median excludes that; "
            "execute_in_process: no run launcher, run worker, queue or sensor tick",
        },
        targets=[Target("details.added_seconds", "<=", TARGET_SECONDS, unit="s")],
        better="lower",
        runs=[r["seconds"] for r in platform_runs],
        baseline_runs=[r["seconds"] for r in bare_runs],
    )


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
