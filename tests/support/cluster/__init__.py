"""A process-backed Kubernetes cluster for the launcher's tests (issue 18, item 7).

`server.KubeServer` is the API over real HTTP (kmock); `controllers` are Kueue,
the Job controller, the scheduler and the garbage collector, and
`kubelet.Kubelet` runs each bound pod's container as a local process group
(`kubelet.PodProcess`) with the manifest's exact command and environment; all
of them run in one thread of `cluster.EmulatedCluster`. See docs/kubernetes.md, "Process-backed emulation".
"""

from tests.support.cluster.cluster import EmulatedCluster
from tests.support.cluster.controllers import KueueSettings, Node
from tests.support.cluster.server import CONTROLLER_AGENT, KubeServer

__all__ = ["CONTROLLER_AGENT", "EmulatedCluster", "KubeServer", "KueueSettings", "Node"]
