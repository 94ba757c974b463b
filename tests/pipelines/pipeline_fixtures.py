"""A small digits pipeline on a temporary TRAINYARD_HOME, run through real Dagster jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from dagster import DagsterInstance, Definitions

from pipelines.environments import local_resources
from pipelines.factory import build_definitions, job_names
from tests.digits import digits_frame
from training.spec import Distribution
from trainyard.search import FloatParam, SearchSpec
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec


def small_spec(**over: Any) -> PipelineSpec:
    frame = digits_frame(1)
    columns = {c: ColumnSpec(dtype="float", min=0, max=16) for c in frame.columns if c != "label"}
    columns["label"] = ColumnSpec(dtype="int", domain=list(range(10)))
    base: dict[str, Any] = dict(
        team="test",
        name="digits",
        source=SourceSpec(prefix="landing/test/digits", pattern="*.csv"),
        columns=columns,
        target="label",
        min_rows=100,
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP", max_epochs=2, batch_size=64),
        search=SearchSpec(params={"lr": FloatParam(low=5e-3, high=5e-2, log=True)}, n_trials=2),
        distribution=Distribution(procs_per_node=1),
    )
    base.update(over)
    return PipelineSpec(**base)


def write_landing(home: Path, frame=None, name: str = "part-0.csv", prefix: str = "landing/test/digits") -> Path:
    frame = digits_frame(400) if frame is None else frame
    landing = home / "store" / prefix
    landing.mkdir(parents=True, exist_ok=True)
    path = landing / name
    frame.to_csv(path, index=False)
    return path


class Harness:
    """Runs a pipeline's jobs like `trainyard demo` does, on its own instance and home."""

    def __init__(self, home: Path, spec: PipelineSpec) -> None:
        self.home = home
        self.spec = spec
        self.resources = local_resources(home)
        self.defs: Definitions = build_definitions(spec, resources=self.resources)
        (home / "dagster").mkdir(parents=True, exist_ok=True)
        self.instance = DagsterInstance.local_temp(str(home / "dagster"), overrides={"telemetry": {"enabled": False}})
        self.names = job_names(spec)

    def run(self, job: str, partition_key: Optional[str] = None, run_config: Optional[dict] = None):
        return self.defs.resolve_job_def(self.names[job]).execute_in_process(
            instance=self.instance, partition_key=partition_key, raise_on_error=False, run_config=run_config
        )

    def node(self, asset: str) -> str:
        return f"{self.spec.team}__{self.spec.name}__{asset}"

    def run_all(self) -> dict[str, Any]:
        prepare = self.run("prepare")
        assert prepare.success, failure_text(prepare)
        sweep = prepare.output_for_node(self.node("sweep"))
        for key in sweep.trials:
            train = self.run("train", key)
            assert train.success, failure_text(train)
        promote = self.run("promote")
        assert promote.success, failure_text(promote)
        return {  # as plain JSON, the form the IO manager stores
            "sweep": sweep.model_dump(mode="json"),
            "best": promote.output_for_node(self.node("best_model")).model_dump(mode="json"),
            "registered": promote.output_for_node(self.node("registered_model")).model_dump(mode="json"),
        }


def failure_text(result) -> str:
    """The run's failures, each error with its causes (what the Dagster UI shows)."""
    out = []
    for event in result.all_events:
        if event.is_failure and event.event_specific_data is not None:
            error = getattr(event.event_specific_data, "error", None)
            if error is not None:
                out.append(error.to_string())
    return "\n".join(out)
