"""`make kind-e2e`'s driver: the vision/digits pipeline as a 2-node gang, through real Dagster runs on a real cluster.

Runs inside the orchestrator image on the kind network (deploy/kind/e2e.sh starts it
with the cluster environment's variables). The pipeline is vision/digits as shipped,
with two changes only: one trial, and its training spread over two nodes with one
process each (`Distribution(nodes=2, procs_per_node=1)`), so the trial is a JobSet of
two pods on the kind cluster's two workers, admitted by Kueue as one Workload.

Order as `trainyard demo`: write the digits landing file to the object store, the
`prepare` run (raw_data, validated_data, sweep), one `train` run per trial, then
`promote`. Exit status 0 when a champion was registered, 1 otherwise.

    python deploy/kind/run_gang.py          # TRAINYARD_ENV=cluster and its variables set
"""

from __future__ import annotations

import os
import sys

from dagster import DagsterInstance

from pipelines.environments import resources_for
from pipelines.factory import job_names
from pipelines.team import team_definitions
from pipelines.vision.definitions import team
from pipelines.vision.digits import digits
from training.spec import Distribution
from trainyard import naming
from trainyard.search import SearchSpec

NODES = 2


def gang_pipeline():
    """vision/digits with one trial on `NODES` nodes of one process each."""
    return digits.model_copy(update={
        "distribution": Distribution(nodes=NODES, procs_per_node=1, strategy="ddp"),
        "search": SearchSpec(params=digits.search.params, n_trials=1, parallelism=1),
    })


def write_landing(store) -> str:
    from sklearn.datasets import load_digits

    frame = load_digits(as_frame=True).frame.rename(columns={"target": "label"})
    uri = store.uri(digits.source.prefix, "digits.csv")
    store.write_bytes(uri, frame.to_csv(index=False).encode())
    return uri


def run(job_name: str, defs, instance, partition_key: str | None = None):
    result = defs.resolve_job_def(job_name).execute_in_process(
        instance=instance, partition_key=partition_key, raise_on_error=False
    )
    print(
        f"run {result.run_id[:8]} {job_name}{f' [{partition_key}]' if partition_key else ''}: "
        f"{'ok' if result.success else 'FAILED'}",
        flush=True,
    )
    for event in result.all_events:
        error = getattr(event.event_specific_data, "error", None) if event.is_failure else None
        if error is not None:
            print(error.message.strip()[:4000], file=sys.stderr)
    return result


def main() -> int:
    if os.environ.get("TRAINYARD_ENV") != "cluster":
        print(
            "run_gang: set TRAINYARD_ENV=cluster and the cluster environment's variables (deploy/kind/e2e.sh does)",
            file=sys.stderr,
        )
        return 2
    pipeline = gang_pipeline()
    defs = team_definitions(team, pipeline)
    print(f"landing file: {write_landing(resources_for()['store'])}")
    names = job_names(pipeline)
    instance = DagsterInstance.get()
    prepare = run(names["prepare"], defs, instance)
    if not prepare.success:
        return 1
    sweep = prepare.output_for_node(naming.node_name(pipeline, naming.SWEEP))
    for key in sweep.trials:
        if not run(names["train"], defs, instance, partition_key=key).success:
            return 1
    promote = run(names["promote"], defs, instance)
    if not promote.success:
        return 1
    reg = promote.output_for_node(naming.node_name(pipeline, naming.REGISTERED_MODEL))
    print(
        f"registered {reg.name} version {reg.version}; champion {reg.champion}; test accuracy "
        f"{reg.metrics['test_acc']:.4f}"
    )
    return 0 if reg.champion else 1


if __name__ == "__main__":
    sys.exit(main())
