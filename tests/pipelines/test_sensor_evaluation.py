"""The platform's sensors evaluated as the code server evaluates them for the daemon, on a real PostgreSQL instance.

`get_external_sensor_execution` is what the code server runs for each tick: a context made from the daemon's
instance ref, the sensor's declared resources built on `context.instance`, which the context makes from the ref.
What is asserted is read from PostgreSQL itself (sessions established, `pg_stat_database`) and from the instance's
compute logs (what the UI shows for a tick).
"""

from pathlib import Path
from typing import Any, Iterator

import pytest
from dagster import (
    DagsterInstance,
    DagsterInvalidDefinitionError,
    Definitions,
    SensorEvaluationContext,
    SkipReason,
    build_sensor_context,
    sensor,
)
from dagster._core.definitions.sensor_definition import SensorExecutionData
from dagster._grpc.impl import get_external_sensor_execution

from instance import storage_connections
from instance.storage_connections import evaluation_resources
from pipelines.environments import local_resources
from pipelines.factory import build_definitions
from resources.sweeps import SweepStore
from tests.instance.test_storage_connections import sessions_opened
from tests.pipelines.pipeline_fixtures import small_spec
from trainyard.spec import RetrainPolicy


@pytest.fixture()
def pg_home(tmp_path: Path, pg_databases: list[str], monkeypatch: Any) -> Iterator[tuple[Path, str]]:
    home = tmp_path / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        f"telemetry:\n  enabled: false\nstorage:\n  postgres:\n    postgres_url: {pg_databases[0]}\n"
    )
    shared: dict = {}
    monkeypatch.setattr(storage_connections, "_SHARED", shared)  # this test's pooled instances only
    yield home, pg_databases[0]
    for instance in shared.values():
        instance.dispose()


@sensor(name="declares_its_resource")
def declares_its_resource(context: SensorEvaluationContext, sweeps: SweepStore) -> SkipReason:
    """A sensor written the way Dagster's docs write one: its resource a parameter."""
    context.log.info(f"study storage {sweeps.storage_url}")
    return SkipReason("nothing to do")


def tick(repository: Any, ref: Any, name: str, log_key: list[str]) -> SensorExecutionData:
    data = get_external_sensor_execution(repository, None, ref, name, None, None, None, log_key, None)  # type: ignore[arg-type]
    assert isinstance(data, SensorExecutionData), data
    return data


def test_platform_sensors_make_no_instance_per_tick_and_keep_their_logs(
    pg_home: tuple[Path, str], tmp_path: Path
) -> None:
    """The sweep sensor (resources, a log line every tick), the landing sensor (two resources) and the drift sensor
    (three, and its own queries) establish no session after their first tick, and the sweep tick's log is in the daemon
    instance's compute logs, as the UI
    reads it. The control, a sensor declaring its resource as a parameter, establishes sessions on every tick:
    Dagster builds an instance from the ref for it each time, which is what the platform's sensors would show
    if they declared theirs."""
    home, url = pg_home
    database = url.rsplit("/", 1)[1]
    spec = small_spec(retrain=RetrainPolicy(drift_psi=0.25))  # drift-gated: the drift sensor too
    defs = Definitions.merge(
        build_definitions(spec, resources=local_resources(tmp_path / "pipeline")),
        Definitions(sensors=[declares_its_resource]),
    )
    repository = defs.get_repository_def()
    with DagsterInstance.from_config(str(home)) as daemon:
        ref = daemon.get_ref()
        opened: dict[str, list[int]] = {}
        for name in ("test__digits__sweep", "test__digits__landing", "test__digits__drift", "declares_its_resource"):
            counts = []
            for i in range(3):
                before = sessions_opened(database)
                data = tick(repository, ref, name, ["sensor-test", name, str(i)])
                counts.append(sessions_opened(database) - before)
            opened[name] = counts
            assert data.skip_message, data
        assert opened["test__digits__sweep"][1:] == [0, 0], opened
        assert opened["test__digits__landing"][1:] == [0, 0], opened
        assert opened["test__digits__drift"][1:] == [0, 0], opened
        assert all(n >= 3 for n in opened["declares_its_resource"]), opened
        logged = daemon.compute_log_manager.get_log_data(["sensor-test", "test__digits__sweep", "2"])
        assert logged.stderr and b"test/digits" in logged.stderr, logged


def test_evaluation_resources_name_what_is_missing(tmp_path: Path) -> None:
    """A code location without a resource a sensor needs gets the sensor's name, the missing key and what it does
    define; a context given resources (a test's) uses those."""
    resources = local_resources(tmp_path)
    defs = build_definitions(small_spec(), resources=resources)
    with build_sensor_context(resources={"sweeps": resources["sweeps"]}) as context:
        with evaluation_resources(context, "sweeps") as built:
            assert built.sweeps.storage_url == resources["sweeps"].storage_url
    with build_sensor_context(repository_def=defs.get_repository_def(), sensor_name="test__digits__sweep") as context:
        with (
            pytest.raises(DagsterInvalidDefinitionError) as missing,
            evaluation_resources(context, "sweeps", "feature_store"),
        ):
            pass
    assert "test__digits__sweep needs the resources ['feature_store'], which the code location does not define" in str(
        missing.value
    )
    assert "'sweeps'" in str(missing.value) and "Definitions(resources=...)" in str(missing.value)
    with build_sensor_context(sensor_name="lonely") as context:
        with pytest.raises(
            DagsterInvalidDefinitionError,
            match=r"lonely needs the resources \['sweeps'\]: evaluate it in its code location",
        ):
            with evaluation_resources(context, "sweeps"):
                pass


def test_evaluation_resources_build_what_a_resource_depends_on(tmp_path: Path) -> None:
    """A resource needing another by key (`required_resource_keys`) and one holding another (`ResourceDependency`)
    get the ones the code location configured, as Dagster builds them for a sensor that declares them; a resource
    nobody needs is not built."""
    from dagster import ConfigurableResource, InitResourceContext, ResourceDependency, resource

    built: list[str] = []

    class Inner(ConfigurableResource):
        v: int = 3

        def setup_for_execution(self, context: Any) -> None:
            built.append(f"inner {self.v}")

    class Outer(ConfigurableResource):
        inner: ResourceDependency[Inner]

    @resource(required_resource_keys={"inner"})
    def by_key(init_context: InitResourceContext) -> str:
        return f"by key over {init_context.resources.inner.v}"

    @sensor(name="uses_both")
    def uses_both(context: SensorEvaluationContext) -> SkipReason:
        with evaluation_resources(context, "outer", "by_key") as resources:
            return SkipReason(f"outer over {resources.outer.inner.v}; {resources.by_key}")

    defs = Definitions(
        sensors=[uses_both],
        resources={"outer": Outer(inner=Inner(v=7)), "by_key": by_key, "inner": Inner(v=5), "other": Inner(v=9)},
    )
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        data = tick(defs.get_repository_def(), instance.get_ref(), "uses_both", ["t", "0"])
    assert data.skip_message == "outer over 7; by key over 5"
    assert sorted(built) == ["inner 5", "inner 7"]
