"""A Dagster run of `trial-0000` whose launcher is the Kubernetes launcher on an emulated cluster, as its own process.

`python -m tests.resources.k8s_orchestrator HOME API_URL MASTER_PORT` materializes
`trial_model` for `trial-0000` of `orchestrated_spec(HOME)` on the Dagster instance and
home at HOME (which `prepared_home` prepared), against the emulated cluster's API
at API_URL. It is the orchestrator a drill SIGKILLs mid-trial: its gang lives on in
the cluster, and the run it leaves STARTED is retried the way Dagster does (a new
run tagged with the retry number), in the test's own process, by `run_trial`.

The emulated-cluster tests (`test_k8s_emulated`) build their launchers and
pipelines from the same helpers: `k8s_launcher`, `pipeline_spec`, `slow_model`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from pipelines.factory import build_definitions, job_names
from resources.k8s.launcher import KubernetesLauncher
from tests.pipelines.pipeline_fixtures import small_spec
from tests.pipelines.sweep_drill import drill_resources, open_instance
from training.spec import CheckpointPolicy, Distribution
from trainyard.search import FloatParam, SearchSpec
from trainyard.spec import ModelSpec, PipelineSpec

NAMESPACE = "vision"
IMAGE = "registry.example.com/trainyard/trainer@sha256:" + "0" * 64
CHECKPOINT_EVERY = 5
# 60 steps of 0.5 s (2 steps per epoch per rank: 210 training rows, batch 64, 2 ranks): the orphan gang still
# trains while the retried run starts, so the retry has a live gang to delete. Steps stop waiting once the file
# `fast_file(HOME)` exists: the drill creates it when the retry's own gang exists (the orphan is gone by then).
STEP_SECONDS = 0.5
EPOCHS = 30


def fast_file(home: Path) -> Path:
    """The file whose existence ends `SlowSteps`' wait for the orchestrated trial at HOME (see `slow_model`)."""
    return home / "steps-at-full-speed"


def pipeline_spec(**over: Any) -> PipelineSpec:
    """The small digits pipeline as a 2-node gang of one process each, one trial (random sampler, seed 7)."""
    base: dict[str, Any] = dict(
        search=SearchSpec(
            params={"lr": FloatParam(low=5e-3, high=5e-2, log=True)}, n_trials=1, sampler="random", seed=7
        ),
        distribution=Distribution(nodes=2, procs_per_node=1),
    )
    base.update(over)
    return small_spec(**base)


def slow_model(step_seconds: float, max_epochs: int = 50, until: Optional[Path] = None) -> ModelSpec:
    """`SlowSteps` digits (2 steps per epoch and rank): a window for a disruption to land mid-training on any machine.

    With `until`, steps stop waiting once that file exists (the test creates it after the disruption).
    """
    hparams: dict[str, Any] = {"hidden": 16, "step_seconds": step_seconds}
    if until is not None:
        hparams["until"] = str(until)
    return ModelSpec(path="tests.support.gang_models:SlowSteps", hparams=hparams, max_epochs=max_epochs, batch_size=64)


def orchestrated_spec(home: Path) -> PipelineSpec:
    """`pipeline_spec` with a checkpoint every 5 steps and 0.5 s per step until `fast_file(home)` exists."""
    return pipeline_spec(model=slow_model(STEP_SECONDS, EPOCHS, until=fast_file(home)),
                         checkpoint=CheckpointPolicy(every_n_steps=CHECKPOINT_EVERY, async_save=False))


def k8s_launcher(api_url: str, master_port: int, **over: Any) -> KubernetesLauncher:
    """The Kubernetes launcher of the emulated-cluster tests, at `api_url`; `over` replaces its options."""
    options: dict[str, Any] = dict(
        namespace=NAMESPACE,
        image=IMAGE,
        api_url=api_url,
        poll_interval_seconds=0.5,
        cpu="1",
        memory="1Gi",
        master_port=master_port,
        termination_grace_seconds=15,
        run_timeout_seconds=400,
        queue_timeout_seconds=120,
    )
    options.update(over)
    return KubernetesLauncher(**options)


def run_trial(home: Path, api_url: str, master_port: int, tags: Optional[dict[str, str]] = None) -> Any:
    """Execute the train job for `trial-0000` on HOME's instance; the `ExecuteInProcessResult`."""
    spec = orchestrated_spec(home)
    resources = drill_resources(home, k8s_launcher(api_url, master_port))
    job = build_definitions(spec, resources=resources).resolve_job_def(job_names(spec)["train"])
    return job.execute_in_process(
        instance=open_instance(home), partition_key="trial-0000", tags=tags, raise_on_error=False
    )


if __name__ == "__main__":
    result = run_trial(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
    sys.exit(0 if result.success else 1)
