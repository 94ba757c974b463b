"""One trial run in its own process, for the pool-limit test (test_team.py).

`python -m tests.pipelines.pool_drill HOME TRIAL_KEY` runs the drill pipeline's
`train` job for one partition against the instance in `DAGSTER_HOME`; the trial
writes `HOME/started/<key>` when it starts training, trains inside the barrier
`HOME/barrier` (open once two trials are in) and waits for `HOME/gates/<key>`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dagster import DagsterInstance

from pipelines.factory import build_definitions, job_names
from pipelines.sensors import TEAM_TAG
from tests.pipelines.sweep_drill import TrivialLauncher, drill_resources, drill_spec


def main(argv: list[str]) -> int:
    home, key = Path(argv[0]), argv[1]
    spec = drill_spec(n_trials=4, parallelism=4)
    launcher = TrivialLauncher(
        gate_dir=str(home / "gates"),
        started_dir=str(home / "started"),
        barrier_dir=str(home / "barrier"),
        timeout_seconds=450,
    )  # outlasts the test's own 400 s wait for two inside and two queued
    defs = build_definitions(spec, resources=drill_resources(home, launcher))
    with DagsterInstance.get() as instance:
        result = defs.resolve_job_def(job_names(spec)["train"]).execute_in_process(
            instance=instance, partition_key=key, tags={TEAM_TAG: spec.team}, raise_on_error=False
        )
    return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
