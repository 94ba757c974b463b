"""A gang with a node range on the process-backed cluster: `drill_lose_node` continues it smaller and grows it back.

The drill is a test-level drill on the emulation (`EmulatedCluster.lose_node`,
`return_node`): a run-config drill of `trial_model` cannot reach the emulated
nodes, which live in the test's process. Losing a node SIGKILLs its pods'
processes by PID and removes its capacity from the scheduler; returning it gives
the capacity back. Everything else is what the processes, the controllers and
the real `KubernetesLauncher` in a real Dagster run of `trial_model` did: the
world sizes are written by the training ranks themselves
(`tests.support.elastic_models.RecordsWorldSize`), the gangs are the JobSets the
launcher created, read from the API server's request log.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from tests.resources.k8s_orchestrator import NAMESPACE as NS
from tests.resources.k8s_orchestrator import k8s_launcher, pipeline_spec
from tests.resources.test_k8s_emulated import (
    GANG_LABEL,
    NODE_ENV,
    DagsterTrial,
    finish,
    free_port,
    in_thread,
    index,
    quota_released,
    run_trial_model,
)
from tests.support.cluster import EmulatedCluster, KueueSettings, Node
from tests.support.cluster.server import launcher_requests_outside_its_role
from training.spec import CheckpointPolicy, Distribution
from trainyard.spec import ModelSpec

CHECKPOINT_EVERY = 5
JOBSETS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"


def one_pod_nodes(n: int) -> list[Node]:
    """`n` nodes with room for exactly one trial pod each (the launcher's pods ask for 1 CPU, 1 Gi)."""
    return [Node(f"node-{i}", {"cpu": "1", "memory": "4Gi", "nvidia.com/gpu": "0"}) for i in range(n)]


@pytest.fixture
def cluster4(tmp_path: Path) -> Iterator[EmulatedCluster]:
    """Four one-pod nodes; Kueue's quota fits more than that, so the nodes are what limits the gang."""
    kueue = KueueSettings(quota={"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "0"})
    with EmulatedCluster(tmp_path / "cluster", nodes=one_pod_nodes(4), kueue=kueue, node_env=NODE_ENV) as c:
        yield c
        c.wait_for("every pod process to end", lambda: not c.live_processes(), timeout=60)
        assert launcher_requests_outside_its_role(c.server, NS) == []


def records(folder: Path) -> list[dict[str, Any]]:
    """What every training process wrote after its first step, in the order they wrote it."""
    return sorted((json.loads(p.read_text()) for p in folder.glob("*.json")), key=lambda r: r["at"])


def checkpoint_of_another_gang(c: EmulatedCluster, other: set[str], at_least: int) -> Optional[tuple[str, int]]:
    """(gang, step) once rank 0 of a gang not in `other` logged a committed checkpoint at step >= `at_least`."""
    import re

    for p in c.pods():
        gang = p["metadata"]["labels"][GANG_LABEL]
        if index(p) == 0 and gang not in other:
            steps = [int(s) for s in re.findall(r"committed checkpoint \S+/step-(\d+)", c.log(p["metadata"]["name"]))]
            if steps and max(steps) >= at_least:
                return gang, max(steps)
    return None


@pytest.mark.slow
def test_drill_lose_node_a_2_to_4_node_gang_continues_on_3_grows_back_to_4_and_finishes(
    cluster4: EmulatedCluster, tmp_path: Path
) -> None:
    """`Distribution(nodes=4, min_nodes=2)`, DDP, one process per node, in a real Dagster run of `trial_model`.

    The node of rank 1 is lost after the first checkpoint: the JobSet restarts the
    gang, whose fourth pod cannot be placed; past `resize_after_seconds` the launcher
    relaunches it on the 3 nodes that have room (the largest size of the range that fits), from the newest committed
    checkpoint.
    When the node returns, the capacity probe's pod runs there and the gang grows
    back to 4 at a checkpoint boundary (SIGTERM, checkpoint, relaunch), then finishes.
    """
    c = cluster4
    fast, ranks = tmp_path / "steps-at-full-speed", tmp_path / "ranks"
    model = ModelSpec(path="tests.support.elastic_models:RecordsWorldSize", max_epochs=60, batch_size=64,
                      hparams={"hidden": 16, "step_seconds": 0.3, "until": str(fast), "record": str(ranks)})
    spec = pipeline_spec(model=model, distribution=Distribution(nodes=4, min_nodes=2, procs_per_node=1),
                         checkpoint=CheckpointPolicy(every_n_steps=CHECKPOINT_EVERY, async_save=False))
    thread, box = in_thread(run_trial_model, tmp_path, k8s_launcher(c.url, free_port(), resize_after_seconds=3), spec)

    first, step = c.wait_for(
        "a checkpoint of the 4-node gang", lambda: checkpoint_of_another_gang(c, set(), CHECKPOINT_EVERY), timeout=300
    )
    victim = next(p for p in c.running(f"{first}-node-0") if index(p) == 1)
    killed = c.lose_node(victim["spec"]["nodeName"])
    assert killed == [victim["metadata"]["name"]]
    smaller, resumed = c.wait_for("a checkpoint of the gang on the nodes left",
                                  lambda: checkpoint_of_another_gang(c, {first}, step + 1), timeout=300)
    c.return_node(victim["spec"]["nodeName"])
    grown = c.wait_for(
        "the gang to grow back",
        lambda: next(
            (
                p["metadata"]["labels"][GANG_LABEL]
                for p in c.pods()
                if p["metadata"]["labels"].get(GANG_LABEL) not in (None, first, smaller)
                and not p["metadata"]["name"].startswith(f"{smaller}-probe")
                and p["status"].get("phase") == "Running"
            ),
            None,
        ),
        timeout=300,
    )
    fast.touch()
    trial: DagsterTrial = finish(thread, box, timeout=600)
    assert trial.result.success, trial.failure()

    # What the ranks did: 4 processes, then 3, then 4 again, each gang from a later step than the one before.
    launches: dict[str, dict[str, Any]] = {}
    for r in records(ranks):
        seen = launches.setdefault(r["launch"], {"sizes": set(), "ranks": set(), "step": r["global_step"]})
        seen["sizes"].add(r["world_size"])
        seen["ranks"].add(r["rank"])
    assert list(launches) == [f"{first}-node-0", f"{smaller}-node-0", f"{grown}-node-0"], launches
    assert [(v["sizes"], v["ranks"]) for v in launches.values()] == [
        ({4}, {0, 1, 2, 3}),
        ({3}, {0, 1, 2}),
        ({4}, {0, 1, 2, 3}),
    ], launches
    steps = [v["step"] for v in launches.values()]
    assert steps[0] < step < steps[1] <= resumed < steps[2], (step, resumed, launches)
    # The gangs are the JobSets the launcher created, one per size.
    created = [r for r in c.server.requests("POST", JOBSETS)]
    assert len(created) == 3, created
    assert (smaller, grown) == (f"{first}-g1", f"{first}-g2")
    # Each size change is in the run's log with its cause.
    messages = trial.messages()
    (shrink,) = [m for m in messages if "the gang continues smaller: 4 -> 3 nodes" in m]
    assert "node lost: 1 of the gang's 4 pods could not be placed" in shrink and "Insufficient cpu" in shrink, shrink
    (grow,) = [m for m in messages if "the gang grows back: 3 -> 4 nodes" in m]
    assert "capacity returned: 1 of 1 capacity probe pods run (nodes node-" in grow, grow
    assert [
        m for m in messages if "-probe" in m and "one gang per trial" in m
    ] == []  # gone before the next gang's launch
    # Goodput accounts for it: the resizes with their causes, the time at each size.
    result = trial.trained()
    assert result["world_size"] == 4
    good = result["goodput"]
    assert [(r["from_nodes"], r["to_nodes"]) for r in good["resizes"]] == [(4, 3), (3, 4)], good
    assert set(good["seconds_at_nodes"]) == {"4", "3"} and good["device_hours"] > 0, good
    assert trial.value.goodput["resizes"] == good["resizes"]  # the trial's Dagster metadata says the same
    quota_released(c)


def test_a_node_range_is_validated_for_every_size_it_holds() -> None:
    assert (Distribution(nodes=4, min_nodes=2).smallest, Distribution(nodes=4).smallest) == (2, 4)
    assert Distribution(nodes=4, min_nodes=2).elastic and not Distribution(nodes=4, min_nodes=4).elastic
    assert Distribution(nodes=4, min_nodes=2).at_nodes(3).nodes == 3
    with pytest.raises(ValueError, match="min_nodes=5 is above nodes=4"):
        Distribution(nodes=4, min_nodes=5)
    with pytest.raises(ValueError, match="at 3 nodes"):  # 4 and 2 nodes keep a TP mesh of 2; 3 would not
        Distribution(nodes=4, min_nodes=2, procs_per_node=1, strategy="tp", tensor_parallel_size=2)
    assert Distribution(nodes=4, min_nodes=2, procs_per_node=2, strategy="tp", tensor_parallel_size=2).smallest == 2


def test_a_resized_gang_is_a_new_jobset_and_its_capacity_probe_is_shaped_like_its_pods(tmp_path: Path) -> None:
    """Generation 1 is another JobSet at 2 nodes; the probe's pods ask for what a gang pod asks, pass `restricted`, only
    sleep."""
    from resources.k8s.config import K8sJobConfig
    from resources.k8s.elastic import at_nodes
    from resources.k8s.manifests import PROBE_COMMAND, capacity_probe_manifest, trial_objects
    from resources.k8s.names import MAX_JOBSET_NAME, trial_labels
    from tests.support.k8s import load_crd_schemas, restricted_violations, validate_any
    from tests.support.train_specs import make_spec

    spec = make_spec(tmp_path, distribution=Distribution(nodes=3, min_nodes=2, procs_per_node=2, accelerator="gpu"))
    cfg = K8sJobConfig(namespace=NS, image="registry.example.com/t@sha256:" + "0" * 64, node_selector={"pool": "gpu"})
    (full,) = trial_objects(spec, "s3://b/spec.json", 0, cfg)
    (smaller,) = trial_objects(at_nodes(spec, 2), "s3://b/spec.json", 0, cfg, generation=1)
    name = full["metadata"]["name"]
    assert smaller["metadata"]["name"].endswith("-g1") and len(smaller["metadata"]["name"]) <= MAX_JOBSET_NAME
    assert smaller["metadata"]["name"].split("-a0-")[1] == name.split("-a0-")[1] + "-g1"  # same attempt, same hash
    child = smaller["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (child["completions"], child["parallelism"]) == (2, 2)
    assert "--nnodes=2" in child["template"]["spec"]["containers"][0]["command"]
    probe = capacity_probe_manifest(spec, cfg, f"{smaller['metadata']['name']}-probe", 1, trial_labels(spec, 0))
    schemas = load_crd_schemas()
    for obj in (full, smaller, probe):
        validate_any(obj, schemas)
    pod, gang_pod = (
        probe["spec"]["template"]["spec"],
        full["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"],
    )
    assert restricted_violations(pod) == []
    assert (
        pod["containers"][0]["command"] == PROBE_COMMAND
        and "kueue.x-k8s.io/queue-name" not in probe["metadata"]["labels"]
    )
    assert pod["containers"][0]["resources"] == gang_pod["containers"][0]["resources"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert (probe["spec"]["completions"], probe["spec"]["parallelism"]) == (1, 1)


def test_the_resizer_waits_for_its_bound_for_the_range_and_for_terminating_pods(tmp_path: Path) -> None:
    """The decisions alone, on pod views: shrink only past the bound, within the range, with no pod still terminating;
    grow at once when every missing node fits, after the bound when only some do."""
    from types import SimpleNamespace

    from resources.k8s.config import K8sJobConfig
    from resources.k8s.elastic import ResizeNeeded, Resizer
    from resources.k8s.pods import PodView
    from tests.support.train_specs import make_spec

    spec = make_spec(tmp_path, distribution=Distribution(nodes=4, min_nodes=2))
    created: list[dict[str, Any]] = []
    probe_pods: list[PodView] = []
    sup = SimpleNamespace(
        namespace=NS,
        batch=SimpleNamespace(create_namespaced_job=lambda ns, body: created.append(body)),
        _api=lambda what, fn, *a, expect=(), **kw: fn(*a, **kw),
        _pods=lambda name: list(probe_pods),
    )
    log = SimpleNamespace(info=lambda msg: None)
    cfg = K8sJobConfig(namespace=NS, image="registry.example.com/t@sha256:" + "0" * 64)

    def pod(
        i: int, node: str = "", unschedulable: str = "", terminating: bool = False, phase: str = "Pending"
    ) -> PodView:
        return PodView(
            name=f"p{i}", index=i, phase=phase, node=node, unschedulable=unschedulable, terminating=terminating
        )

    full = Resizer(sup, spec, 4, "gang", cfg, 0, None, 10.0, log)
    placed = [pod(0, "a", phase="Running"), pod(1, "b", phase="Running")]
    lost = [pod(2, unschedulable="0/2 nodes are available"), pod(3, unschedulable="0/2 nodes are available")]
    full.check([*placed, *lost], 0.0)
    full.check([*placed, *lost], 9.0)  # within the bound
    full.check(
        [*placed, *lost, pod(9, "c", terminating=True, phase="Running")], 20.0
    )  # a node may still free up: timer reset
    full.check([*placed, *lost], 21.0)
    with pytest.raises(ResizeNeeded) as shrink:
        full.check([*placed, *lost], 31.0)
    assert shrink.value.nodes == 2 and "2 of the gang's 4 pods could not be placed for 10 s" in shrink.value.cause
    below = Resizer(sup, spec, 4, "gang", cfg, 0, None, 10.0, log)
    for t in (
        0.0,
        100.0,
    ):  # one node placed, min_nodes 2: nothing smaller can run, so it waits (the stuck bound applies)
        below.check([pod(0, "a", phase="Running"), *[pod(i, unschedulable="none") for i in (1, 2, 3)]], t)
    assert created == []

    smaller = Resizer(sup, spec, 2, "gang-g1", cfg, 0, None, 10.0, log)
    smaller.check(placed, 0.0)
    assert [(b["metadata"]["name"], b["spec"]["parallelism"]) for b in created] == [("gang-g1-probe", 2)]
    probe_pods[:] = [pod(0, "c", phase="Running"), pod(1, unschedulable="0/3 nodes are available")]
    smaller.check(placed, 1.0)
    smaller.check(placed, 10.0)  # one of two missing nodes back: waits the bound for the other
    with pytest.raises(ResizeNeeded) as partial:
        smaller.check(placed, 11.0)
    assert partial.value.nodes == 3 and "1 of 2 capacity probe pods run (nodes c)" in partial.value.cause
    probe_pods[:] = [pod(0, "c", phase="Running"), pod(1, "d", phase="Running")]
    again = Resizer(sup, spec, 2, "gang-g1", cfg, 0, None, 10.0, log)
    again.check(placed, 0.0)
    with pytest.raises(ResizeNeeded) as grow:
        again.check(placed, 0.5)  # every missing node fits: at once
    assert grow.value.nodes == 4
