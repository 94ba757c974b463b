"""One gang per trial attempt: labels, owned Services, re-attach or delete before a launch, `trainyard k8s gc`.

Same emulated API as tests/resources/test_k8s_launcher.py (kmock over HTTP; its
emulator, like an API server, gives created objects a uid). kmock ignores label
selectors, so every scenario also holds objects of another trial that must be
left alone. Order of events is read from kmock's request log.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dagster import DagsterInstance, DagsterRun, DagsterRunStatus

from pipelines.cli import main
from resources.k8s.launcher import KubernetesLauncher
from resources.k8s.manifests import job_manifest, service_manifest
from resources.k8s.names import LABEL_ATTEMPT, LABEL_RUN, job_name, trial_labels
from tests.resources import test_k8s_launcher
from tests.resources.test_k8s_launcher import (
    CFG,
    JOBS,
    NS,
    SERVICES,
    Cluster,
    FakeTime,
    KubeServer,
    Recorder,
    playing,
    two_node_spec,
    write_result,
)
from tests.support.train_specs import make_spec
from training.spec import Distribution, TrainSpec

RUN_A = str(uuid.UUID(int=0xA))
RUN_B = str(uuid.UUID(int=0xB))

kube = test_k8s_launcher.kube  # the emulated API server, as a fixture


def context(run_id: str, run_retry: int = 0, step_retry: int = 0) -> Any:
    return SimpleNamespace(
        log=Recorder(),
        retry_number=step_retry,
        run_id=run_id,
        run=SimpleNamespace(run_id=run_id, tags={"dagster/retry_number": str(run_retry)} if run_retry else {}),
    )


def launcher(kube: KubeServer, **kw: Any) -> KubernetesLauncher:
    options: dict[str, Any] = dict(namespace=NS, image="trainer:1", api_url=kube.url, poll_interval_seconds=0.02,
                                   queue_timeout_seconds=20, run_timeout_seconds=20, gang_kind="job")
    return KubernetesLauncher(**{**options, **kw})


def gang(c: Cluster, spec: TrainSpec, attempt: int, run_id: str, *, admitted: bool = True) -> str:
    """What an earlier launch left running: its Job (admitted, two pods) and its Service."""
    job = c.batch.create_namespaced_job(NS, job_manifest(spec, f"{spec.output_uri}/spec.json", attempt, CFG, run_id))
    name = job.metadata.name
    c.core.create_namespaced_service(NS, service_manifest(name, CFG, labels=trial_labels(spec, attempt, run_id)))
    if admitted:
        c.admit(name)
        c.add_pod(name, 0)
        c.add_pod(name, 1)
    return str(name)


def succeed(c: Cluster, spec: TrainSpec, name: str) -> None:
    c.wait_job(name)
    c.admit(name)
    c.add_pod(name, 0, "n")
    c.add_pod(name, 1, "n")
    c.wait_polls(name)
    write_result(spec)
    c.finish(name, "Complete")


def requests(kube: KubeServer) -> list[str]:
    return [f"{r.method.value} {r.url.path}" for r in list(kube.km) if r.method.value in ("POST", "DELETE")]


def test_every_object_carries_run_and_attempt_and_the_service_is_owned_by_its_job(
    kube: KubeServer, tmp_path: Path
) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 102)
    seen: dict[str, Any] = {}

    def play(c: Cluster) -> None:
        c.wait(lambda: c.core.list_namespaced_service(NS).items)
        seen["job"], seen["service"] = c.job(name), c.core.read_namespaced_service(name, NS)
        succeed(c, spec, name)

    with playing(kube, play):
        outcome = launcher(kube).launch(spec, context=context(RUN_A, run_retry=1, step_retry=2))
    assert outcome.result.world_size == 2
    job, svc = seen["job"], seen["service"]
    for labels in (job["metadata"]["labels"], job["spec"]["template"]["metadata"]["labels"], svc.metadata.labels):
        assert labels[LABEL_RUN] == RUN_A and labels[LABEL_ATTEMPT] == "102"
    # Job first, then the Service, owned by that Job (its uid as the API server gave it).
    assert requests(kube)[:2] == [f"POST {JOBS}", f"POST {SERVICES}"]
    assert [(o.kind, o.name, o.uid) for o in svc.metadata.owner_references] == [("Job", name, job["metadata"]["uid"])]


def test_a_retried_run_deletes_the_orphan_gang_before_starting_its_own(kube: KubeServer, tmp_path: Path) -> None:
    """Run A's orchestrator died mid-trial; its retry, run B, must not start a second gang beside A's."""
    spec = two_node_spec(tmp_path)
    other = make_spec(tmp_path / "other", trial_id="trial-0009", distribution=Distribution(nodes=2, procs_per_node=1))
    setup = Cluster(kube)
    orphan = gang(setup, spec, 0, RUN_A)
    earlier_attempt = gang(setup, spec, 1, RUN_A, admitted=False)
    bystander = gang(setup, other, 0, RUN_A)
    new = job_name(spec.pipeline, spec.trial_id, 100)
    before = len(requests(kube))

    with playing(kube, lambda c: succeed(c, spec, new)) as cluster:
        ctx = context(RUN_B, run_retry=1)
        outcome = launcher(kube).launch(spec, context=ctx)
    assert outcome.result.world_size == 2
    calls = requests(kube)[before:]
    # Both stale gangs of this trial went before the new Job was created; the other trial's gang stayed.
    assert calls.index(f"DELETE {JOBS}/{orphan}") < calls.index(f"POST {JOBS}")
    assert calls.index(f"DELETE {JOBS}/{earlier_attempt}") < calls.index(f"POST {JOBS}")
    assert calls.index(f"DELETE {SERVICES}/{orphan}") < calls.index(f"POST {JOBS}")
    assert f"DELETE {JOBS}/{bystander}" not in calls and cluster.job(bystander) is not None
    remaining = [
        j["metadata"]["name"] for j in jobs(cluster) if j["metadata"]["labels"]["trainyard.io/trial"] == spec.trial_id
    ]
    assert remaining == [new]
    assert ctx.log.count(f"deleting Job {NS}/{orphan} (attempt 0 of run {RUN_A})") == 1


def jobs(c: Cluster) -> list[dict[str, Any]]:
    return list(json.loads(c.batch.list_namespaced_job(NS, _preload_content=False).data)["items"])


def test_a_resumed_run_reattaches_to_its_own_gang(kube: KubeServer, tmp_path: Path) -> None:
    """Run monitoring resumed run A (same run id, same attempt): its gang is re-attached, nothing is deleted or
    created."""
    spec = two_node_spec(tmp_path)
    setup = Cluster(kube)
    name = gang(setup, spec, 0, RUN_A)
    Path(spec.output_uri).mkdir(parents=True, exist_ok=True)
    before = len(requests(kube))

    def play(c: Cluster) -> None:
        c.wait_polls(name, 3)
        write_result(spec)
        c.finish(name, "Complete")

    with playing(kube, play):
        ctx = context(RUN_A)
        outcome = launcher(kube).launch(spec, context=ctx)
    assert outcome.result.world_size == 2
    calls = requests(kube)[before:]
    # No Job created, nothing deleted before the end (the Service goes with the finished rendezvous).
    assert (
        f"POST {JOBS}" not in calls
        and calls[-1:] == [f"DELETE {SERVICES}/{name}"]
        and len([c for c in calls if "DELETE" in c]) == 1
    )
    assert ctx.log.count(f"re-attaching to existing Job {NS}/{name}") == 1


def test_a_gang_of_another_run_under_the_same_name_is_waited_out(kube: KubeServer, tmp_path: Path) -> None:
    """A new run of the same trial at attempt 0 (same Job name): the old Job is deleted and the launch waits until it is
    gone
    (its pods terminate: the foreground-deletion finalizer holds the Job), then creates its own."""
    spec = two_node_spec(tmp_path)
    setup = Cluster(kube)
    manifest = job_manifest(spec, f"{spec.output_uri}/spec.json", 0, CFG, RUN_A)
    manifest["metadata"]["finalizers"] = ["foregroundDeletion"]
    name = setup.batch.create_namespaced_job(NS, manifest).metadata.name

    def hook(now: float) -> None:
        if now == 30:  # the old pods are gone: the garbage collector drops the finalizer, the Job disappears
            setup.batch.patch_namespaced_job(name, NS, {"metadata": {"finalizers": []}}, _preload_content=False)
        elif now == 60:
            old = setup.job(name)
            assert old is not None and old["metadata"]["labels"][LABEL_RUN] == RUN_B, "the new Job was not created"
            setup.admit(name)
            write_result(spec)
            setup.finish(name, "Complete")

    t = FakeTime(hook)
    log = Recorder()
    sup = launcher(kube).supervisor(kube.api_client())
    sup.clock, sup.sleep, sup.poll_interval = t.clock, t.sleep, 10
    outcome = sup.run(spec, f"{spec.output_uri}/spec.json", 0, CFG, log=log, run_id=RUN_B)
    assert outcome.result.world_size == 2
    posts = [i for i, c in enumerate(requests(kube)) if c == f"POST {JOBS}"]
    assert len(posts) == 2 and t.sleeps[:3] == [10, 10, 10]  # waited for the old Job before creating the new one


def test_gc_deletes_gangs_whose_dagster_run_ended(kube: KubeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    instance = DagsterInstance.get()
    runs = {
        status: str(uuid.uuid4())
        for status in (DagsterRunStatus.STARTED, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
    }
    for status, run_id in runs.items():
        instance.add_run(DagsterRun(job_name="trials", run_id=run_id, status=status))
    unknown = str(uuid.uuid4())
    setup = Cluster(kube)
    specs = {
        key: make_spec(tmp_path / key, trial_id=f"trial-{i:04d}", distribution=Distribution(nodes=2, procs_per_node=1))
        for i, key in enumerate(("running", "failed", "canceled", "unknown", "finished"))
    }
    live = gang(setup, specs["running"], 0, runs[DagsterRunStatus.STARTED])
    failed = gang(setup, specs["failed"], 0, runs[DagsterRunStatus.FAILURE])
    canceled = gang(setup, specs["canceled"], 0, runs[DagsterRunStatus.CANCELED])
    lost = gang(setup, specs["unknown"], 0, unknown)
    done = gang(setup, specs["finished"], 0, runs[DagsterRunStatus.FAILURE])
    setup.finish(done, "Complete")  # finished: holds nothing, kept for its TTL
    # Launched outside Dagster: no run label, not gc's business.
    setup.batch.create_namespaced_job(NS, job_manifest(make_spec(tmp_path / "x", trial_id="trial-0042"), "s", 0, CFG))
    # The default kind: a JobSet of the failed run, and its child Job (the JobSet controller's, labelled like it).
    from resources.k8s.manifests import jobset_manifest

    js = jobset_manifest(make_spec(tmp_path / "js", trial_id="trial-0050"), "s", 0, CFG, runs[DagsterRunStatus.FAILURE])
    setup.custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NS, "jobsets", js)
    js_name = js["metadata"]["name"]
    uid = setup.custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NS, "jobsets", js_name)["metadata"][
        "uid"
    ]
    setup.batch.create_namespaced_job(NS, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {
        "name": f"{js_name}-node-0", "namespace": NS, "labels": js["metadata"]["labels"],
        "ownerReferences": [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": js_name, "uid": uid}]},
        "spec": js["spec"]["replicatedJobs"][0]["template"]["spec"]})

    assert main(["k8s", "gc", "--namespace", NS, "--api-url", kube.url, "--dry-run"]) == 0
    assert kube.count("DELETE", f"{JOBS}/{failed}") == 0
    assert main(["k8s", "gc", "--namespace", NS, "--api-url", kube.url]) == 0
    out = capsys.readouterr().out
    for name in (failed, canceled, lost):
        assert kube.count("DELETE", f"{JOBS}/{name}") == 1 and kube.count("DELETE", f"{SERVICES}/{name}") == 1
    assert f"its Dagster run {unknown} is UNKNOWN" in out and "is CANCELED" in out
    for name in (live, done):
        assert kube.count("DELETE", f"{JOBS}/{name}") == 0
    assert kube.count("DELETE", f"{SERVICES}/{live}") == 0
    assert kube.count("DELETE", f"{SERVICES}/{done}") == 1  # its run ended: the rendezvous Service has no use
    # The JobSet goes (foreground: its child Job and pods with it); its child Job is never deleted on its own.
    assert kube.count("DELETE", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/{js_name}") == 1
    assert kube.count("DELETE", f"{JOBS}/{js_name}-node-0") == 0
    assert f"deleting JobSet {NS}/{js_name}: its Dagster run" in out


def test_gc_needs_a_namespace(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TRAINYARD_K8S_NAMESPACE", raising=False)
    assert main(["k8s", "gc"]) == 2
    assert "no namespace" in capsys.readouterr().err


JOBSETS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"


def test_jobset_gangs_one_per_attempt_orphans_deleted_child_jobs_not_gangs_and_a_resumed_run_reattaches(
        kube: KubeServer, tmp_path: Path) -> None:
    """The default kind: run A's JobSet is the orphan its retry (run B) deletes, never its child Job directly (the
    JobSet
    controller's: it carries the trial's labels too); then run B's launch, resumed, re-attaches to its own JobSet."""
    from resources.k8s.manifests import jobset_manifest

    spec = two_node_spec(tmp_path)
    setup = Cluster(kube)
    group, version = "jobset.x-k8s.io", "v1alpha2"
    orphan = jobset_manifest(spec, f"{spec.output_uri}/spec.json", 0, CFG, RUN_A)
    setup.custom.create_namespaced_custom_object(group, version, NS, "jobsets", orphan)
    js = setup.custom.get_namespaced_custom_object(group, version, NS, "jobsets", orphan["metadata"]["name"])
    child = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {
        "name": f"{orphan['metadata']['name']}-node-0", "namespace": NS, "labels": trial_labels(spec, 0, RUN_A),
        "ownerReferences": [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": js["metadata"]["name"],
                             "uid": js["metadata"]["uid"], "controller": True}]},
        "spec": orphan["spec"]["replicatedJobs"][0]["template"]["spec"]}
    setup.batch.create_namespaced_job(NS, child)
    new = job_name(spec.pipeline, spec.trial_id, 100, max_length=48)

    def complete(c: Cluster) -> None:
        c.wait(lambda: any(o["metadata"]["name"] == new for o in
                           c.custom.list_namespaced_custom_object(group, version, NS, "jobsets")["items"]))
        write_result(spec)
        c.custom.patch_namespaced_custom_object(
            group,
            version,
            NS,
            "jobsets",
            new,
            {
                "status": {
                    "restarts": 0,
                    "terminalState": "Completed",
                    "conditions": [
                        {
                            "type": "Completed",
                            "status": "True",
                            "reason": "AllJobsCompleted",
                            "message": "jobset completed successfully",
                            "lastTransitionTime": "2026-01-01T00:00:00Z",
                        }
                    ],
                }
            },
        )

    before = len(requests(kube))
    with playing(kube, complete):
        ctx = context(RUN_B, run_retry=1)
        outcome = launcher(kube, gang_kind="jobset").launch(spec, context=ctx)
    assert outcome.result.world_size == 2
    calls = requests(kube)[before:]
    assert calls.index(f"DELETE {JOBSETS}/{orphan['metadata']['name']}") < calls.index(f"POST {JOBSETS}")
    assert not [c for c in calls if c.startswith(f"DELETE {JOBS}") or c.startswith(f"POST {JOBS}") or "services" in c]
    assert ctx.log.count(f"deleting JobSet {NS}/{orphan['metadata']['name']} (attempt 0 of run {RUN_A})") == 1
    created = setup.custom.get_namespaced_custom_object(group, version, NS, "jobsets", new)
    assert created["metadata"]["labels"][LABEL_RUN] == RUN_B and created["metadata"]["labels"][LABEL_ATTEMPT] == "100"

    # Run B resumed by run monitoring (same run, same attempt): the finished JobSet is re-attached, nothing created.
    before = len(requests(kube))
    ctx = context(RUN_B, run_retry=1)
    assert launcher(kube, gang_kind="jobset").launch(spec, context=ctx).result.world_size == 2
    assert [c for c in requests(kube)[before:] if c.startswith("POST") or c.startswith("DELETE")] == []
    assert ctx.log.count(f"re-attaching to existing JobSet {NS}/{new}") == 1
    assert test_k8s_launcher.launcher_requests_outside_its_role(kube) == []
