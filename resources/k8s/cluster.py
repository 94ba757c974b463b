"""The cluster-wide objects trainyard needs, built by pure functions for `deploy/render.py`.

PriorityClasses (and Kueue's mirror of them) order the teams' work; one Kueue
ClusterQueue per team in a shared cohort gives each team guaranteed quota and
lets it borrow idle quota. Isolation: every team namespace enforces the
`restricted` Pod Security profile and has its own service account for trial
pods, bound only there and granted nothing (trial pods never call the API);
each team's launcher (its Dagster run pods) has its own service account, bound
only in that team's namespace, to exactly the verbs the launcher uses; code
servers run as an account with no bindings at all. `deploy/render.py` writes
these into `deploy/k8s/`.
"""

from __future__ import annotations

from typing import Any, Optional

from resources.k8s.config import TeamQuota, check_dns_subdomain
from resources.k8s.errors import ManifestError
from resources.k8s.names import GPU_RESOURCE, KUEUE_API
from trainyard.team import PRIORITIES

# Priority values: interactive (a person waiting) > production (scheduled
# retraining) > sweep (exploration that can wait and be preempted).

PART_OF = {"app.kubernetes.io/part-of": "trainyard"}
POD_SECURITY_LABEL = "pod-security.kubernetes.io"
POD_SECURITY_LEVELS = ("privileged", "baseline", "restricted")
TRIAL_SERVICE_ACCOUNT = "trainyard-trial"
"""The trial pods' service account, one in each team namespace."""

# What `JobSupervisor` calls, and nothing more (tests/resources/k8s check the
# calls it makes against these rules).
LAUNCHER_RULES: list[dict[str, Any]] = [
    # list: the trial's gangs of other attempts, found by label (resources.k8s.gangs).
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "list", "delete"]},
    # The default gang; get on jobs reads a JobSet's child Job (its failure reason).
    {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["create", "get", "list", "delete"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "get", "list", "delete"]},
    # watch: the pods that fail between two polls (resources.k8s.pod_events).
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    # FailedCreate warnings on a Job whose pods the API refuses (resources.k8s.stuck).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["list"]},
]


def namespace(name: str, *, enforce: str = "restricted", warn: str = "restricted") -> dict[str, Any]:
    """A Namespace whose pods must pass Pod Security level `enforce` (warned and audited against `warn`).

    Team namespaces, where trial pods run, enforce `restricted`; the namespace of
    the Dagster chart enforces `baseline` and warns about `restricted`.
    """
    for field, level in (("enforce", enforce), ("warn", warn)):
        if level not in POD_SECURITY_LEVELS:
            raise ManifestError(f"{field}={level!r} is not a Pod Security level; accepted: {list(POD_SECURITY_LEVELS)}")
    check_dns_subdomain("namespace", name)
    labels = {
        **PART_OF,
        f"{POD_SECURITY_LABEL}/enforce": enforce,
        f"{POD_SECURITY_LABEL}/enforce-version": "latest",
        f"{POD_SECURITY_LABEL}/audit": warn,
        f"{POD_SECURITY_LABEL}/audit-version": "latest",
        f"{POD_SECURITY_LABEL}/warn": warn,
        f"{POD_SECURITY_LABEL}/warn-version": "latest",
    }
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def service_account(name: str, namespace: str) -> dict[str, Any]:
    """A ServiceAccount whose token is not mounted unless a pod asks for it."""
    check_dns_subdomain("service_account", name)
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": namespace, "labels": PART_OF},
        "automountServiceAccountToken": False,
    }


def _role_and_binding(
    name: str, namespace: str, rules: list[dict[str, Any]], subject: tuple[str, str]
) -> list[dict[str, Any]]:
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": name, "namespace": namespace, "labels": PART_OF}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": name, "namespace": namespace, "labels": PART_OF},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": subject[0], "namespace": subject[1]}]},
    ]


def trial_rbac_objects(namespace: str, name: str = TRIAL_SERVICE_ACCOUNT) -> list[dict[str, Any]]:
    """The trial pods' own service account in team namespace `namespace`, bound there only, to a Role granting nothing.

    Trial pods read their spec and write results through the object store and
    get credentials from Secrets by reference (resolved by the kubelet, not by
    the pod): they need no API access, and their token is never mounted. The
    account exists so a team's pods never run as another team's (or the
    namespace's `default`) account, and the binding is where any access they
    are ever given would go: in this namespace only.
    """
    check_dns_subdomain("namespace", namespace)
    return [service_account(name, namespace), *_role_and_binding(name, namespace, [], (name, namespace))]


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


def rbac_objects(
    namespace: str, service_account_name: str, *, service_account_namespace: Optional[str] = None
) -> list[dict[str, Any]]:
    """Least-privilege access for one team's launcher, in that team's namespace only.

    The launcher creates Jobs and their Services, reads and deletes them, lists
    the Job's pods, reads rank 0's log and lists Kueue Workloads to say why a
    trial is queued (`LAUNCHER_RULES`); nothing else, and no access to Secrets.
    `service_account_namespace` is where the launcher runs (the Dagster run
    pods); by default the team namespace itself. Give every team its own
    launcher account: an account bound in two namespaces could start pods that
    mount the other team's Secrets.
    """
    check_dns_subdomain("namespace", namespace)
    sa_ns = service_account_namespace or namespace
    return [service_account(service_account_name, sa_ns),
            *_role_and_binding(service_account_name, namespace, LAUNCHER_RULES, (service_account_name, sa_ns))]
