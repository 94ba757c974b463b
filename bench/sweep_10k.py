"""A 10,000-trial sweep with a trivial trial: seconds to register every partition, and the slowest sensor tick.

The sweep sensor's evaluation (`pipelines.sensors.run_tick`: the same code the
daemon runs, plus the daemon's partition add) is driven back to back on a real
Dagster instance and a real SQLite Optuna study (WAL). A trivial trial finishes
the moment it is requested: the benchmark writes its value straight to the
study (a value derived from its number), standing in for 10,000 runs, each of
which would tell its own result from its own process. Run creation by the
daemon (after the evaluation, outside the tick timeout) is not simulated.
Value: wall seconds until 10,000 partitions exist (no baseline); `details`
carries the slowest tick and its share of Dagster's default 60 s sensor timeout.

Also measured: the per-ask cost of TPE on the finished 10,000-trial study (the
sampler's own work grows with the study; random's does not).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import write_result

ROOT = Path(__file__).resolve().parent.parent
N_TRIALS = 10_000
PARALLELISM = 64
SENSOR_TIMEOUT = 60.0  # Dagster's default DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS


def main() -> dict:
    sys.path.insert(0, str(ROOT))
    from optuna.trial import TrialState

    from pipelines.factory import job_names
    from pipelines.sensors import run_tick
    from resources.sweeps import SweepStore
    from tests.pipelines.sweep_drill import TrivialLauncher, drill_resources, drill_spec, open_instance, prepared_home

    spec = drill_spec(n_trials=N_TRIALS, parallelism=PARALLELISM, sampler="random")
    names = job_names(spec)
    with tempfile.TemporaryDirectory(prefix="sweep10k-") as tmp:
        home = Path(tmp)
        url = f"sqlite:///{home / 'optuna.db'}"
        resources = drill_resources(home, TrivialLauncher(), SweepStore(storage_url=url))
        instance = open_instance(home)
        sweep = prepared_home(home, spec, resources, instance)
        sweeps = resources["sweeps"]
        storage = sweeps.storage()
        study_id = storage.get_study_id_from_name(sweep["study"])
        ticks: list[float] = []
        cursor = None
        started = time.perf_counter()
        registered_at = None
        requested = 0
        while True:
            tick = run_tick(spec, instance, sweeps, cursor, train_job=names["train"], prepare_job=names["prepare"])
            ticks.append(tick.seconds)
            cursor = tick.cursor.dump()
            for request in tick.run_requests:
                if request.partition_key:
                    number = int(request.partition_key.split("-")[1])
                    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
                    storage.set_trial_state_values(trial_id, TrialState.COMPLETE, [((number * 7919) % 1000) / 1000.0])
                    requested += 1
            if registered_at is None and requested >= N_TRIALS:
                registered_at = time.perf_counter() - started
            if any(r.job_name == names["prepare"] for r in tick.run_requests) or not tick.run_requests:
                break
        total = time.perf_counter() - started
        partitions = len(instance.get_dynamic_partitions(f"{spec.team}__{spec.name}__trials"))
        study = sweeps.load(sweep["study"])
        states = {s: sum(1 for t in study.get_trials(deepcopy=False) if t.state.name == s) for s in ("COMPLETE", "FAIL", "RUNNING")}
        tpe = spec.search.model_copy(update={"sampler": "tpe"})
        study = sweeps.load(sweep["study"], tpe)
        t0 = time.perf_counter()
        sweeps.ask(study, tpe, 5)
        tpe_ask_ms = (time.perf_counter() - t0) / 5 * 1000
        busy = [t for t in ticks if t > 0.01]
    assert registered_at is not None and partitions == N_TRIALS, (partitions, states)
    return write_result(
        "sweep_10k",
        round(registered_at, 2),
        "seconds",
        None,
        {
            "what": "wall seconds until 10,000 trial partitions were registered by the sweep sensor (random sampler, "
            f"parallelism {PARALLELISM}, ticks back to back, each requested trivial trial finished at once)",
            "slowest_tick_seconds": round(max(ticks), 3),
            "sensor_timeout_seconds": SENSOR_TIMEOUT,
            "slowest_tick_share_of_timeout": round(max(ticks) / SENSOR_TIMEOUT, 4),
            "median_busy_tick_seconds": round(statistics.median(busy), 3) if busy else 0.0,
            "ticks": len(ticks),
            "trials_per_second": round(N_TRIALS / registered_at, 1),
            "sweep_seconds_to_report": round(total, 2),
            "partitions": partitions,
            "trial_states": states,
            "tpe_ask_ms_at_10k_trials": round(tpe_ask_ms, 1),
            "limits": {"max_asks_per_tick": 64, "tick_budget_seconds": 20.0},
            "not_simulated": "run creation by the daemon (it happens after the evaluation, outside the tick timeout)",
        },
    )


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=2))
