"""Kueue's own configuration, as the `kueue-manager-config` ConfigMap that `deploy/render.py` writes.

Kueue's controller reads a `Configuration` (config.kueue.x-k8s.io/v1beta1) from
the file `controller_manager_config.yaml` of the ConfigMap `kueue-manager-config`
in `kueue-system` (the name Kueue's release manifests give it). Applying this
ConfigMap replaces the whole file, so it carries Kueue's release defaults
(health, metrics, webhook, leader election) besides what trainyard needs:

- `waitForPodsReady`: an admitted gang whose pods are not all Ready within
  `timeout` (Unschedulable, image pulls that never finish, a node that never
  comes up) is evicted, releasing its quota, and requeued with exponential
  backoff (`backoffBaseSeconds` x 2^(n-1), capped at `backoffMaxSeconds`).
  After `backoffLimitCount` requeues the Workload is deactivated
  (`spec.active: false`), which the launcher reports as a failed trial.
  `recoveryTimeout` bounds the same wait for a replacement pod of a gang that
  was running. `blockAdmission` admits nothing else until the admitted gangs
  are Ready, so two half-scheduled gangs never deadlock on the same nodes.
- `integrations.frameworks`: Kueue manages batch Jobs and JobSets (the two gang kinds).

Kueue reads the file at start: after applying it,
`kubectl -n kueue-system rollout restart deployment/kueue-controller-manager`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

KUEUE_CONFIG_API = "config.kueue.x-k8s.io/v1beta1"
KUEUE_NAMESPACE = "kueue-system"
KUEUE_CONFIG_MAP = "kueue-manager-config"
KUEUE_CONFIG_KEY = "controller_manager_config.yaml"
# The gang kinds trainyard submits (resources.k8s.manifests.GANG_KINDS), as Kueue names its integrations.
KUEUE_FRAMEWORKS = ("batch/job", "jobset.x-k8s.io/jobset")


@dataclass(frozen=True)
class PodsReadyPolicy:
    """trainyard's `waitForPodsReady` settings; durations in seconds.

    The launcher's own bounds (`KubernetesLauncher.unschedulable_seconds`,
    `stuck_seconds`) count admitted time only, and are at least `timeout_seconds`
    so Kueue's eviction (which frees the quota and retries elsewhere) comes first.
    """

    timeout_seconds: int = 600
    recovery_timeout_seconds: int = 300
    block_admission: bool = True
    backoff_limit_count: int = 3
    backoff_base_seconds: int = 60
    backoff_max_seconds: int = 1800

    def __post_init__(self) -> None:
        for name in ("timeout_seconds", "recovery_timeout_seconds", "backoff_base_seconds", "backoff_max_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}; accepted: a positive number of seconds")
        if self.backoff_limit_count < 0:
            raise ValueError(f"backoff_limit_count={self.backoff_limit_count!r}; accepted: 0 or more requeues")
        if self.backoff_base_seconds > self.backoff_max_seconds:
            raise ValueError(
                f"backoff_base_seconds={self.backoff_base_seconds} > backoff_max_seconds={self.backoff_max_seconds}"
            )

    def worst_case_seconds(self) -> int:
        """Admitted-and-not-ready time plus requeue backoffs until Kueue deactivates the Workload."""
        waits = sum(
            min(self.backoff_base_seconds * 2**n, self.backoff_max_seconds) for n in range(self.backoff_limit_count)
        )
        return self.timeout_seconds * (self.backoff_limit_count + 1) + waits


def _duration(seconds: int) -> str:
    """Seconds as a Go duration string (what metav1.Duration parses)."""
    if seconds % 3600 == 0:
        return f"{seconds // 3600}h"
    if seconds % 60 == 0:
        return f"{seconds // 60}m"
    return f"{seconds}s"


def kueue_configuration(policy: PodsReadyPolicy = PodsReadyPolicy()) -> dict[str, Any]:
    """The `Configuration` object: Kueue's release defaults plus trainyard's `waitForPodsReady` and integrations."""
    return {
        "apiVersion": KUEUE_CONFIG_API,
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        # Kueue's release defaults for the manager itself (config/components/manager).
        "health": {"healthProbeBindAddress": ":8081"},
        "metrics": {"bindAddress": ":8443"},
        "webhook": {"port": 9443},
        "leaderElection": {"leaderElect": True, "resourceName": "c1f6bfd2.kueue.x-k8s.io"},
        "controller": {
            "groupKindConcurrency": {
                "Job.batch": 5,
                "Workload.kueue.x-k8s.io": 10,
                "LocalQueue.kueue.x-k8s.io": 5,
                "ClusterQueue.kueue.x-k8s.io": 5,
                "ResourceFlavor.kueue.x-k8s.io": 1,
            }
        },
        "clientConnection": {"qps": 50, "burst": 100},
        # Only Jobs that name a queue: other workloads in the cluster are not Kueue's business.
        "manageJobsWithoutQueueName": False,
        "waitForPodsReady": {
            "enable": True,
            "timeout": _duration(policy.timeout_seconds),
            "recoveryTimeout": _duration(policy.recovery_timeout_seconds),
            "blockAdmission": policy.block_admission,
            "requeuingStrategy": {
                # Backoff counted from the eviction, not from the Workload's creation.
                "timestamp": "Eviction",
                "backoffLimitCount": policy.backoff_limit_count,
                "backoffBaseSeconds": policy.backoff_base_seconds,
                "backoffMaxSeconds": policy.backoff_max_seconds,
            },
        },
        "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
    }


def kueue_config_map(policy: PodsReadyPolicy = PodsReadyPolicy()) -> dict[str, Any]:
    """The ConfigMap Kueue's controller reads its `Configuration` from."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": KUEUE_CONFIG_MAP,
            "namespace": KUEUE_NAMESPACE,
            "labels": {"app.kubernetes.io/part-of": "trainyard", "app.kubernetes.io/name": "kueue"},
        },
        "data": {
            KUEUE_CONFIG_KEY: yaml.safe_dump(kueue_configuration(policy), sort_keys=False, default_flow_style=False)
        },
    }
