"""The cluster-wide objects trainyard needs, built by pure functions for `deploy/render.py`.

PriorityClasses (and Kueue's mirror of them) order the teams' work; one Kueue
ClusterQueue per team in a shared cohort gives each team guaranteed quota and
lets it borrow idle quota; RBAC gives the launcher exactly the access it uses.
`deploy/render.py` writes these into `deploy/k8s/`.
"""

from __future__ import annotations

from typing import Any, Optional

from resources.k8s.config import TeamQuota, check_dns_subdomain
from resources.k8s.errors import ManifestError
from resources.k8s.names import GPU_RESOURCE, KUEUE_API
from trainyard.team import PRIORITIES

# Priority values: interactive (a person waiting) > production (scheduled
# retraining) > sweep (exploration that can wait and be preempted).


def priority_classes() -> list[dict[str, Any]]:
    """scheduling.k8s.io/v1 PriorityClasses: interactive > production > sweep.

    Sweep pods never preempt anything (`preemptionPolicy: Never`): they wait for
    free capacity, and being lowest they are the first preempted; the
    preemption checkpoint makes that cheap.
    """
    out = []
    for name, (value, description) in PRIORITIES.items():
        out.append({
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "trainyard"}},
            "value": value,
            "globalDefault": False,
            "preemptionPolicy": "Never" if name == "trainyard-sweep" else "PreemptLowerPriority",
            "description": description,
        })
    return out


def workload_priority_classes() -> list[dict[str, Any]]:
    """Kueue WorkloadPriorityClasses mirroring `priority_classes()` for queue ordering."""
    return [
        {
            "apiVersion": KUEUE_API,
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "trainyard"}},
            "value": value,
            "description": description,
        }
        for name, (value, description) in PRIORITIES.items()
    ]


def kueue_objects(teams: list[TeamQuota], cohort: str, flavor: str) -> list[dict[str, Any]]:
    """A ResourceFlavor, one ClusterQueue per team in one cohort, one LocalQueue per team namespace.

    Teams borrow each other's idle quota inside the cohort (up to their
    borrowing limit) and reclaim their own nominal quota by preempting borrowers.
    """
    check_dns_subdomain("cohort", cohort)
    check_dns_subdomain("flavor", flavor)
    names = [t.team for t in teams]
    if len(set(names)) != len(names):
        raise ManifestError(f"teams {names} repeat a name; accepted: one TeamQuota per team")
    part_of = {"app.kubernetes.io/part-of": "trainyard"}
    objs: list[dict[str, Any]] = [
        {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": flavor, "labels": part_of}, "spec": {}}
    ]
    for t in teams:
        resources = []
        for res, nominal, borrow in (("cpu", t.cpu, t.borrow_cpu), ("memory", t.memory, t.borrow_memory),
                                     (GPU_RESOURCE, t.gpus, t.borrow_gpus)):
            entry: dict[str, Any] = {"name": res, "nominalQuota": nominal}
            if borrow is not None:
                entry["borrowingLimit"] = borrow
            resources.append(entry)
        objs.append({
            "apiVersion": KUEUE_API,
            "kind": "ClusterQueue",
            "metadata": {"name": t.team, "labels": part_of},
            "spec": {
                "cohortName": cohort,
                # Only the team's own namespace may submit to its queue.
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": t.namespace}},
                # A big gang waiting for quota does not block smaller jobs behind it.
                "queueingStrategy": "BestEffortFIFO",
                "preemption": {
                    # Get nominal quota back from teams borrowing it.
                    "reclaimWithinCohort": "Any",
                    # Interactive and production work displaces the team's own sweeps.
                    "withinClusterQueue": "LowerPriority",
                },
                "resourceGroups": [
                    {"coveredResources": ["cpu", "memory", GPU_RESOURCE],
                     "flavors": [{"name": flavor, "resources": resources}]},
                ],
            },
        })
        objs.append({
            "apiVersion": KUEUE_API,
            "kind": "LocalQueue",
            "metadata": {"name": t.queue_name, "namespace": t.namespace, "labels": part_of},
            "spec": {"clusterQueue": t.team},
        })
    return objs


def rbac_objects(namespace: str, service_account: str, *, service_account_namespace: Optional[str] = None) -> list[dict[str, Any]]:
    """Least-privilege access for the launcher in one team namespace.

    The launcher creates and watches Jobs and their Services, reads pods and
    rank 0's log, and reads Kueue Workloads to say why a trial is queued;
    nothing else. `service_account_namespace` is where the launcher runs (the
    Dagster run pods); by default the team namespace itself.
    """
    check_dns_subdomain("namespace", namespace)
    check_dns_subdomain("service_account", service_account)
    sa_ns = service_account_namespace or namespace
    part_of = {"app.kubernetes.io/part-of": "trainyard"}
    role = service_account  # Role and RoleBinding named after the account they serve
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": service_account, "namespace": sa_ns, "labels": part_of}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": role, "namespace": namespace, "labels": part_of},
            "rules": [
                {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "list", "watch", "delete"]},
                {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "get", "delete"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
                {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["get", "list", "watch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": role, "namespace": namespace, "labels": part_of},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": sa_ns}],
        },
    ]
