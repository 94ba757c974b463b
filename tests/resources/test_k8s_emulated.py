"""The Kubernetes launcher against the process-backed cluster (`tests.support.cluster`).

Every trial here is a 2-node x 1-process digits gang run through the real
`KubernetesLauncher`, by default as a JobSet: Kueue admits it as one Workload,
the JobSet controller makes the child Job `<jobset>-node-0` and the headless
Service, the Job controller one pod per completion index, and each pod is a
local process group running the rendered container command (`python -m
training.gang ... torchrun ... training.entrypoint`). Exit codes, pod phases,
Job and JobSet conditions and restarts come from the processes and the
controllers' rules; the tests only act as a user or the cluster would (a
SIGKILL to a pod's process, a Kueue preemption, a model that raises on rank 1,
a nodeSelector no node matches, a SIGKILL to the Dagster run worker). One
scenario runs the Indexed Job option (`gang_kind="job"`): a user error on node 1
fails the Job at once. A gang that restarted or resumed ends with weights bitwise
equal to the same trial trained undisturbed (2 local processes).

The Indexed Job option's scenarios and the orchestrator killed mid-trial are in
`test_k8s_emulated_retries.py` (a file of their own, so that xdist's `loadfile`
can run them beside these).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

from resources.k8s.errors import StuckGang
from resources.k8s.launcher import KubernetesLauncher
from tests.resources.k8s_orchestrator import IMAGE, NAMESPACE, k8s_launcher, pipeline_spec, slow_model
from tests.support.cluster import EmulatedCluster, KueueSettings, Node
from tests.support.cluster.controllers import COMPLETION_INDEX, conditions, exit_code
from tests.support.cluster.jobset import JOB_INDEX, JOBSET_NAME, REPLICATED_JOB, RESTART_ATTEMPT
from tests.support.cluster.kubelet import expand, resolve_names
from tests.support.cluster.server import launcher_requests_outside_its_role
from tests.support.train_specs import make_spec
from training.spec import CheckpointPolicy, Distribution, TrainSpec
from trainyard.spec import ModelSpec, PipelineSpec

NS = NAMESPACE
# Threads per process: this machine's setting, given by the emulated nodes (not by the trial).
NODE_ENV = {"OMP_NUM_THREADS": "1"}
CHECKPOINT_EVERY = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def emulated_cluster(tmp_path: Path) -> Iterator[EmulatedCluster]:
    """The default emulated cluster of these tests (`cluster`); on the way out, every pod process ended and the launcher
    kept its role."""
    with EmulatedCluster(tmp_path / "cluster", node_env=NODE_ENV) as c:
        yield c
        c.wait_for("every pod process to end", lambda: not c.live_processes(), timeout=60)
        # Whatever the scenario, the launcher stayed inside the access deploy/k8s gives it.
        assert launcher_requests_outside_its_role(c.server, NS) == []


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmulatedCluster]:
    yield from emulated_cluster(tmp_path)


def launcher(c: EmulatedCluster, **kw: Any) -> KubernetesLauncher:
    return k8s_launcher(c.url, free_port(), **kw)


def gang_spec(tmp: Path, **over: Any) -> TrainSpec:
    return make_spec(tmp, distribution=Distribution(nodes=2, procs_per_node=1),
                     checkpoint=CheckpointPolicy(every_n_steps=CHECKPOINT_EVERY, async_save=False), **over)


def index(pod: dict[str, Any]) -> int:
    return int(pod["metadata"]["annotations"][COMPLETION_INDEX])


GANG_LABEL = "trainyard.io/job-name"  # on every pod of a gang: the JobSet's (or the Job's) name


def gang_pods(c: EmulatedCluster, gang: str) -> list[dict[str, Any]]:
    """Every pod of the gang, of every child Job and restart, oldest first."""
    return [p for p in c.pods() if p["metadata"]["labels"].get(GANG_LABEL) == gang]


def jobset(c: EmulatedCluster, name: str) -> dict[str, Any]:
    js = c.jobset(name, NS)
    assert js is not None, f"no JobSet {name}"
    return js


def in_thread(fn: Callable[..., Any], *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `fn(*args)` in a thread; the dict gets "outcome" (its value) or "error"."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["outcome"] = fn(*args)
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


@dataclass
class DagsterTrial:
    """A real Dagster run of `trial_model` for `trial-0000` (`run_trial_model`): its result, instance and spec."""

    result: Any
    instance: Any
    spec: PipelineSpec

    @property
    def value(self) -> Any:
        return self.result.output_for_node(f"{self.spec.team}__{self.spec.name}__trial_model")

    def trained(self) -> dict[str, Any]:
        """The trial's result.json (a `TrainResult`)."""
        return dict(json.loads(Path(self.value.result_uri).read_text()))

    def train_spec(self) -> TrainSpec:
        return TrainSpec.model_validate_json((Path(self.value.result_uri).parent / "spec.json").read_text())

    def messages(self) -> list[str]:
        """Every message the run logged, in order (what the Dagster UI shows for it)."""
        return [e.user_message for e in self.instance.all_logs(self.result.run_id)]

    def step_seconds(self) -> float:
        """STEP_START -> the step's end (success or failure) of the run's one step, from its event log."""
        stamps = [
            e.timestamp
            for e in self.instance.all_logs(self.result.run_id)
            if e.dagster_event is not None
            and e.dagster_event.event_type_value in ("STEP_START", "STEP_SUCCESS", "STEP_FAILURE")
        ]
        assert len(stamps) == 2, stamps
        return float(stamps[1] - stamps[0])

    def failure(self) -> str:
        from tests.pipelines.pipeline_fixtures import failure_text

        return failure_text(self.result)


def run_trial_model(tmp: Path, lx: KubernetesLauncher, spec: PipelineSpec) -> DagsterTrial:
    """Materialize `trial_model` for `trial-0000` of `spec` through a real Dagster run whose launcher resource is `lx`.

    The home at `tmp/home` gets digits splits and the `sweep` asset first (`prepared_home`).
    """
    from pipelines.factory import build_definitions, job_names
    from tests.pipelines.sweep_drill import drill_resources, open_instance, prepared_home

    home = tmp / "home"
    resources = drill_resources(home, lx)
    instance = open_instance(home)
    prepared_home(home, spec, resources, instance)
    result = build_definitions(spec, resources=resources).resolve_job_def(job_names(spec)["train"]).execute_in_process(
        instance=instance, partition_key="trial-0000", raise_on_error=False)
    return DagsterTrial(result, instance, spec)


def finish(thread: threading.Thread, box: dict[str, Any], timeout: float = 400) -> Any:
    """What `in_thread`'s call returned (a `LaunchOutcome`, a `DagsterTrial`), or raise what it raised."""
    thread.join(timeout)
    assert not thread.is_alive(), "the launch did not end"
    if "error" in box:
        raise box["error"]
    return box["outcome"]


def wait_for_checkpoint(c: EmulatedCluster, at_least: int) -> tuple[str, int]:
    """(gang name: the JobSet's or the Job's, step) once rank 0 has logged a committed checkpoint at step >=
    `at_least`."""

    def found() -> Optional[tuple[str, int]]:
        for p in c.pods():
            if index(p) == 0:
                steps = [
                    int(s) for s in re.findall(r"committed checkpoint \S+/step-(\d+)", c.log(p["metadata"]["name"]))
                ]
                if steps and max(steps) >= at_least:
                    return p["metadata"]["labels"][GANG_LABEL], max(steps)
        return None
    return c.wait_for(f"a checkpoint at step >= {at_least}", found, timeout=300)


def full_speed_once(
    c: EmulatedCluster, thread: threading.Thread, until: Path, what: str, landed: Callable[[], bool]
) -> None:
    """Create `until` (`SlowSteps` stop waiting: see `slow_model`) once `landed()` holds, or once the run ended.

    The wait per step is the window in which a disruption reaches the gang; once it has (the
    disturbed pods are gone), the resumed training needs no window and runs at full speed.
    """
    c.wait_for(what, lambda: not thread.is_alive() or landed(), timeout=400)
    until.touch()


def replaced(c: EmulatedCluster, gang: str, before: set[str]) -> Callable[[], bool]:
    """Whether every pod of `gang` in `before` is gone and pods of its next attempt exist."""
    def check() -> bool:
        now = {p["metadata"]["name"] for p in gang_pods(c, gang)}
        return bool(now) and not now & before
    return check


@pytest.mark.slow
def test_a_user_error_on_node_1_fails_the_dagster_run_at_once_with_its_traceback(
    cluster: EmulatedCluster, tmp_path: Path
) -> None:
    """Not restarted, not retried: the child Job failed through the podFailurePolicy on pod 1's real exit code, the
    JobSet's failurePolicy rule failed the JobSet without a restart, and the run failed with rank 1's traceback."""
    model = ModelSpec(path="tests.support.gang_models:UserErrorOnRank", hparams={"hidden": 16, "rank": 1, "at_step": 2},
                      max_epochs=2, batch_size=64)
    trial = run_trial_model(tmp_path, launcher(cluster), pipeline_spec(model=model))
    assert not trial.result.success
    failure = trial.failure()
    assert "ZeroDivisionError: rank 1: division by zero in the loss" in failure and "Traceback" in failure, failure
    (js,) = cluster.objects("JobSet")  # one gang, ever: the run did not retry the trial
    name = js["metadata"]["name"]
    assert cluster.server.count("POST", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets") == 1
    assert cluster.server.count("POST", f"/api/v1/namespaces/{NS}/pods") == 2
    assert js["status"]["restarts"] == 0 and js["status"]["terminalState"] == "Failed"
    assert conditions(js)["Failed"]["reason"] == "FailJobSetFailurePolicyAction"
    child = cluster.job_conditions(f"{name}-node-0", NS)["Failed"]
    assert child["reason"] == "PodFailurePolicy" and "exit code 1 matching FailJob rule" in child["message"]
    assert f"JobSet {NS}/{name} failed (FailJobSetFailurePolicyAction:" in failure
    assert f"child Job {name}-node-0 failed (PodFailurePolicy:" in failure
    quota_released(cluster)


@pytest.mark.slow
def test_a_pod_killed_mid_epoch_restarts_the_whole_jobset_from_its_checkpoint(
    cluster: EmulatedCluster, tmp_path: Path
) -> None:
    """The JobSet path, in a Dagster run: the killed pod's 137 fails the child Job (backoffLimit 0), and the JobSet
    restarts every pod.

    No failurePolicy rule matches BackoffLimitExceeded, so the default
    RestartJobSet acts within maxRestarts: the child Job and its pods are
    deleted and made again with restart-attempt 1, and the new gang resumes
    from the newest committed checkpoint (a fresh rendezvous of all ranks),
    ending bitwise where an undisturbed run ends.
    """
    fast = tmp_path / "steps-at-full-speed"
    spec = pipeline_spec(
        model=slow_model(0.05, until=fast),
        checkpoint=CheckpointPolicy(every_n_steps=CHECKPOINT_EVERY, async_save=False),
    )
    thread, box = in_thread(run_trial_model, tmp_path, launcher(cluster), spec)
    name, step = wait_for_checkpoint(cluster, CHECKPOINT_EVERY)
    first = [p for p in gang_pods(cluster, name) if p["status"].get("phase") == "Running"]
    victim = next(p for p in first if index(p) == 1)
    before = {p["metadata"]["name"] for p in gang_pods(cluster, name)}
    cluster.kill(victim["metadata"]["name"], signal.SIGKILL)
    full_speed_once(cluster, thread, fast, "the restarted gang's pods", replaced(cluster, name, before))
    trial: DagsterTrial = finish(thread, box)
    assert trial.result.success, trial.failure()

    js = jobset(cluster, name)
    assert js["status"]["restarts"] == 1 and js["status"]["restartsCountTowardsMax"] == 1, js["status"]
    assert js["status"]["terminalState"] == "Completed" and conditions(js)["Completed"]["reason"] == "AllJobsCompleted"
    assert conditions(js)["RestartingJobSet"]["status"] == "False"
    assert cluster.jobsets.restarts == [(name, f"{name}-node-0")]
    assert (
        cluster.server.count("POST", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets") == 1
    )  # restarted, not relaunched
    child = cluster.job(f"{name}-node-0", NS)
    assert child is not None and child["metadata"]["labels"][RESTART_ATTEMPT] == "1"
    assert child["metadata"]["ownerReferences"][0]["kind"] == "JobSet"
    final = gang_pods(cluster, name)
    # The whole gang is new: every pod of the first attempt is gone (the killed one deleted with its Job).
    assert not {p["metadata"]["name"] for p in first} & {p["metadata"]["name"] for p in final}
    assert sorted(
        (index(p), p["metadata"]["labels"][RESTART_ATTEMPT], p["status"]["phase"], exit_code(p)) for p in final
    ) == [(0, "1", "Succeeded", 0), (1, "1", "Succeeded", 0)]
    # The restart in the run's log, with the pod that caused it (not its peer, stopped with SIGTERM after it).
    (restart,) = [m for m in trial.messages() if "restarts the whole gang (restart" in m]
    assert "(restart 1, at most 3 counted" in restart and f"first failed job: {name}-node-0" in restart, restart
    assert f"pod {victim['metadata']['name']} (node rank 1): Failed, exit code 137" in restart, restart
    result = trial.trained()
    assert result["world_size"] == 2 and result["resumed_from"] is not None
    assert int(result["resumed_from"].rsplit("-", 1)[1]) >= step, (result["resumed_from"], step)
    assert result["goodput"]["restarts"] >= 1 and result["goodput"]["lost_steps"] <= CHECKPOINT_EVERY, result["goodput"]
    quota_released(cluster)
    assert_bitwise_undisturbed(trial.train_spec(), tmp_path)


def assert_bitwise_undisturbed(spec: TrainSpec, tmp: Path) -> None:
    """The trial's newest checkpoint holds bitwise the weights of the same trial trained undisturbed."""
    import torch

    from training.checkpointing import CheckpointStore

    latest = CheckpointStore(spec.output_uri + "/checkpoints").latest()
    assert latest is not None
    expected, got = reference_weights(spec, tmp), latest.state["state_dict"]
    assert expected and expected.keys() <= got.keys(), (expected.keys(), got.keys())
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


@pytest.mark.slow
def test_kueue_preemption_checkpoints_requeues_and_resumes(cluster: EmulatedCluster, tmp_path: Path) -> None:
    """Kueue evicts the JobSet's one Workload and suspends the JobSet: its controller suspends the child Job, whose
    pods get SIGTERM, write the preemption checkpoint and exit; re-admitted, the JobSet resumes the child Job.

    This all happens inside one launch of the Dagster run's step: the launcher
    sees the JobSet suspended (queued again) and re-admitted, and the trial
    succeeds; it does not raise `TrainingPreempted`, and the JobSet did not
    restart (suspension is not a failure).
    """
    # 0.1 s per step: the eviction reaches the pods long before the 100 steps end (a plain digits trial
    # once finished all of them first on a loaded machine, and its "preemption" found nothing to resume).
    # Once the preempted pods are gone and re-admitted ones exist, the steps stop waiting (`full_speed_once`).
    fast = tmp_path / "steps-at-full-speed"
    spec = pipeline_spec(
        model=slow_model(0.1, until=fast), checkpoint=CheckpointPolicy(every_n_steps=CHECKPOINT_EVERY, async_save=False)
    )
    thread, box = in_thread(run_trial_model, tmp_path, launcher(cluster), spec)
    name, step = wait_for_checkpoint(cluster, CHECKPOINT_EVERY)
    first = {p["metadata"]["name"] for p in gang_pods(cluster, name) if p["status"].get("phase") == "Running"}
    before = {p["metadata"]["name"] for p in gang_pods(cluster, name)}
    cluster.preempt(name, NS)
    full_speed_once(cluster, thread, fast, "the re-admitted gang's pods", replaced(cluster, name, before))
    trial: DagsterTrial = finish(thread, box)
    assert trial.result.success, trial.failure()

    assert [reason for _, reason in cluster.kueue.evictions] == ["Preempted"]
    (workload,) = cluster.objects("Workload")  # the JobSet is one Workload, one podSet per replicatedJob
    assert (
        workload["metadata"]["ownerReferences"][0]["kind"] == "JobSet"
        and workload["metadata"]["ownerReferences"][0]["name"] == name
    )
    assert [(ps["name"], ps["count"]) for ps in workload["spec"]["podSets"]] == [("node", 2)]
    text = "\n".join(trial.messages())  # the run's log
    assert f"JobSet {name} was suspended again (preempted by Kueue)" in text and "Evicted=True (Preempted" in text
    assert "disruption, not a failure" in text
    final = gang_pods(cluster, name)
    assert not first & {p["metadata"]["name"] for p in final}  # the preempted pods were deleted, new ones trained
    assert sorted((index(p), p["status"]["phase"]) for p in final) == [(0, "Succeeded"), (1, "Succeeded")]
    js = jobset(cluster, name)
    assert (
        js["status"]["restarts"] == 0 and conditions(js)["Suspended"]["status"] == "False"
    )  # a preemption is not a failure
    child = cluster.job(f"{name}-node-0", NS)
    assert child is not None and child["status"].get("failed", 0) == 0
    result = trial.trained()
    assert result["resumed_from"] is not None
    resumed_step = int(result["resumed_from"].rsplit("-", 1)[1])
    # The preemption checkpoint, written on SIGTERM after the periodic one the test waited for.
    assert resumed_step > step, (result["resumed_from"], step)
    quota_released(cluster)
    # The resumed pods share the launch id (the Job name) and restart count 0 with the preempted ones; their
    # attempt record is still their own (training.attempts.attempt_id), so the preemption counts as a restart.
    assert result["goodput"]["restarts"] == 1, result["goodput"]
    assert result["goodput"]["restart_causes"] == ["preempted"], result["goodput"]


def stuck_launcher(c: EmulatedCluster, **env: str) -> KubernetesLauncher:
    """The launcher `from_env` builds, with a node selector no emulated node matches, pointed at the emulation."""
    base = KubernetesLauncher.from_env(
        {
            "TRAINYARD_K8S_NAMESPACE": NS,
            "TRAINYARD_TRAINER_IMAGE": IMAGE,
            "TRAINYARD_K8S_POD": json.dumps(
                {"node_selector": {"trainyard.io/pool": "gpu-h100"}, "cpu": "1", "memory": "1Gi"}
            ),
            **env,
        }
    )
    # Made again, not model_copy'd: a Dagster resource is rebuilt from the fields it was constructed with.
    return KubernetesLauncher(**{**base.model_dump(exclude_unset=True), "api_url": c.url, "poll_interval_seconds": 0.5,
                                 "master_port": free_port()})


def assert_nothing_left(c: EmulatedCluster) -> None:
    c.wait_for("the gang to be deleted", lambda: not (c.objects("JobSet") or c.objects("Job") or c.objects("Pod")
                                                      or c.objects("Workload")), timeout=60)
    assert c.quota_used() == {} and c.objects("Service") == []


def quota_released(c: EmulatedCluster) -> None:
    """Kueue marks a finished Job's Workload Finished on its next pass; then it holds no quota."""
    c.wait_for(
        "Kueue to release the quota", lambda: c.quota_used() == {}, timeout=60
    )  # a pass takes 0.1 s; room for load


def test_a_gang_that_can_never_be_scheduled_fails_the_run_within_the_bound_and_leaves_nothing(cluster: EmulatedCluster,
                                                                                              tmp_path: Path) -> None:
    lx = stuck_launcher(cluster, TRAINYARD_K8S_UNSCHEDULABLE_SECONDS="3")
    assert lx.unschedulable_seconds == 3
    trial = run_trial_model(tmp_path, lx, pipeline_spec())
    assert not trial.result.success
    failure = trial.failure()  # the run's failure says why
    assert "didn't match Pod's node affinity/selector" in failure and "holds no quota" in failure, failure
    # The 3 s bound acted, plus admission, a few polls and the step's own work (plan, study); not retried. Room for a
    # loaded machine: the next bound that could end it is the default unschedulable one, 900 s (the queue's is 86,400
    # s).
    assert trial.step_seconds() < 3 + 90, trial.step_seconds()
    assert cluster.server.count("POST", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets") == 1
    events = [e for e in cluster.objects("Event") if e["reason"] == "FailedScheduling"]
    assert events and all(e["type"] == "Warning" for e in events)
    assert_nothing_left(cluster)


def test_kueue_evicts_a_gang_whose_pods_are_not_ready_and_deactivates_it(tmp_path: Path) -> None:
    """waitForPodsReady: evicted after the timeout, requeued with backoff, deactivated past backoffLimitCount."""
    kueue = KueueSettings(pods_ready_timeout=2, backoff_base_seconds=1, backoff_max_seconds=4, backoff_limit_count=1)
    with EmulatedCluster(tmp_path / "cluster", kueue=kueue, node_env=NODE_ENV) as c:
        lx = stuck_launcher(c, TRAINYARD_K8S_UNSCHEDULABLE_SECONDS="300")
        with pytest.raises(StuckGang) as err:
            lx.launch(gang_spec(tmp_path))
        assert err.value.kind == "deactivated"
        assert "Kueue deactivated Workload" in str(err.value)
        assert [reason for _, reason in c.kueue.evictions] == ["PodsReadyTimeout", "PodsReadyTimeout"]
        assert_nothing_left(c)
        assert launcher_requests_outside_its_role(c.server, NS) == []


def test_a_missing_secret_is_a_config_error_at_once(tmp_path: Path) -> None:
    """A referenced Secret that does not exist: CreateContainerConfigError from the kubelet, and the launcher fails at
    once."""
    with EmulatedCluster(tmp_path / "cluster", nodes=[Node("node-a")], node_env=NODE_ENV) as c:
        lx = launcher(c, env_from_secrets=["trainyard-storage"])
        with pytest.raises(StuckGang) as err:
            lx.launch(gang_spec(tmp_path))
        assert err.value.kind == "config" and 'secret "trainyard-storage" not found' in str(err.value)
        assert c.live_processes() == []
        assert_nothing_left(c)


@pytest.mark.slow
def test_a_dagster_run_trains_a_two_node_jobset_on_the_emulated_cluster(
    cluster: EmulatedCluster, tmp_path: Path
) -> None:
    """`trial_model` materialized by a real Dagster run whose launcher resource is the Kubernetes launcher (default
    kind: JobSet)."""
    trial = run_trial_model(tmp_path, launcher(cluster), pipeline_spec())
    result = trial.result
    assert result.success, trial.failure()
    assert trial.trained()["world_size"] == 2
    node = f"{trial.spec.team}__{trial.spec.name}__trial_model"
    meta = {k: v.value for k, v in result.asset_materializations_for_node(node)[0].metadata.items()}
    assert meta["epochs_reported"] == 2  # rank 0's per-epoch progress reached the run through Pipes
    # One JobSet, labelled with the run; its controller made one child Job <jobset>-node-0 and the Service.
    (js,) = cluster.objects("JobSet")
    name = js["metadata"]["name"]
    assert js["metadata"]["labels"]["trainyard.io/dagster-run"] == result.run_id
    assert js["status"]["terminalState"] == "Completed" and js["status"]["restarts"] == 0
    (child,) = cluster.objects("Job")
    assert child["metadata"]["name"] == f"{name}-node-0" and conditions(child)["Complete"]["status"] == "True"
    assert {k: child["metadata"]["labels"][k] for k in (JOBSET_NAME, REPLICATED_JOB, JOB_INDEX, RESTART_ATTEMPT)} == {
        JOBSET_NAME: name, REPLICATED_JOB: "node", JOB_INDEX: "0", RESTART_ATTEMPT: "0"}
    pods = cluster.pods()
    assert sorted((index(p), p["status"]["phase"], exit_code(p)) for p in pods) == [
        (0, "Succeeded", 0),
        (1, "Succeeded", 0),
    ]
    assert {p["spec"]["hostname"] for p in pods} == {f"{name}-node-0-0", f"{name}-node-0-1"}
    assert {p["spec"]["subdomain"] for p in pods} == {name}
    (svc,) = cluster.objects("Service")  # headless, owned by the JobSet: it goes with it
    assert svc["metadata"]["name"] == name and svc["spec"]["clusterIP"] == "None"
    assert svc["metadata"]["ownerReferences"][0]["kind"] == "JobSet"
    (workload,) = cluster.objects("Workload")
    assert workload["metadata"]["ownerReferences"][0]["kind"] == "JobSet"
    # Rank 0's log, kept with the trial's files.
    assert "trial trial-0000: done" in (Path(trial.value.result_uri).parent / "logs" / f"{name}.rank0.log").read_text()
    quota_released(cluster)


def test_the_kubelet_expands_variables_and_resolves_only_whole_pod_names() -> None:
    env = {"JOB_COMPLETION_INDEX": "1", "A": "x"}
    assert expand("--node-rank=$(JOB_COMPLETION_INDEX)", env) == "--node-rank=1"
    assert expand("$$(A) $(A) $(UNSET) $$", env) == "$(A) x $(UNSET) $"
    records = {"job-0.job": "127.0.0.1"}
    assert resolve_names("--master-addr=job-0.job", records) == "--master-addr=127.0.0.1"
    assert resolve_names("--master-addr=job-0.job.vision.svc", records) == "--master-addr=job-0.job.vision.svc"
    assert resolve_names("xjob-0.job", records) == "xjob-0.job"


def reference_weights(trial_spec: TrainSpec, tmp: Path) -> dict[str, Any]:
    """The final weights of `trial_spec` trained undisturbed by the local launcher at the same world size (2
    processes)."""
    import torch

    from resources.launcher import LocalLauncher
    from training.checkpointing import CheckpointStore

    kwargs = dict(trial_spec.model.kwargs)
    if "step_seconds" in kwargs:
        kwargs["step_seconds"] = 0.0  # `SlowSteps`' wait changes nothing but time
    spec = trial_spec.model_copy(
        update={
            "output_uri": str(tmp / "reference"),
            "optuna": None,
            "model": trial_spec.model.model_copy(update={"kwargs": kwargs}),
            "distribution": trial_spec.distribution.model_copy(update={"nodes": 1, "procs_per_node": 2}),
        }
    )
    LocalLauncher().launch(spec)
    latest = CheckpointStore(spec.output_uri + "/checkpoints").latest()
    assert latest is not None
    return {k: v for k, v in latest.state["state_dict"].items() if isinstance(v, torch.Tensor)}
