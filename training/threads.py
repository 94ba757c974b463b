"""A trial process's CPU share, and the thread pools the platform sizes to it (torch's, LightGBM's) on every path.

Every launcher sets `OMP_NUM_THREADS` in a training process's environment unless
the launch (a team) set its own: the local launcher gives each rank one thread
by default (trials share the machine, several at once), and torchrun gives one to
each of several ranks of a node. That value is the rank's share: the entrypoint
sizes torch's intra-op pool to it (`torch.set_num_threads`) and a GBT trial passes
it to LightGBM as `num_threads`, whichever way the process started (a forked warm
worker keeps its server's OpenMP settings, so the variable alone would not reach
torch there; `apply_thread_counts` gives a forked worker every runtime's count
from its own environment). A pod started with no `OMP_NUM_THREADS` at all (a one-process pod:
torchrun sets it only for several) takes the CPUs it may use (its affinity and its
cgroup's CPU quota, the pod's CPU limit) divided among the node's ranks, not the
node's cores, which a library would otherwise take and oversubscribe a limited pod.
Model code that calls `torch.set_num_threads` itself, or a GBT spec that names a
thread count (`num_threads` or an alias), keeps its own.
"""

from __future__ import annotations

import math
import os
from typing import Mapping, Optional

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" or "max <period>"


def available_cpus(cpu_max: str = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may use: its affinity, bounded by its cgroup's CPU quota (rounded up) when one is set."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota(cpu_max)
    return max(1, min(cpus, quota) if quota is not None else cpus)


def _cgroup_quota(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else math.ceil(int(quota) / int(period))
    except (OSError, ValueError):
        return None


def trial_threads(env: Optional[Mapping[str, str]] = None) -> int:
    """This rank's threads: `OMP_NUM_THREADS` when set to a positive integer, else its CPUs shared among the node's
    ranks.

    `env`: the process's environment (default `os.environ`); `LOCAL_WORLD_SIZE` is the node's ranks.
    """
    env = os.environ if env is None else env
    value = env.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    local = env.get("LOCAL_WORLD_SIZE", "1").strip()
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, available_cpus() // ranks)



def _count(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def apply_thread_counts(env: Optional[Mapping[str, str]] = None) -> dict[str, int]:
    """Give every thread pool already loaded in this process the counts `env` names, as a process started with `env`
    has.

    For a worker forked from the warm server: the server loaded torch, numpy's OpenBLAS, LightGBM's OpenMP and Arrow
    with one thread each (a fork server must have no thread pool), and those libraries read their variables only then.
    Returns the counts set, by runtime (threadpoolctl's internal API names, `torch`, `arrow`).
    """
    import sys

    env = os.environ if env is None else env
    threads = trial_threads(env)
    limits = {"openmp": threads,
              "openblas": _count(env, "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS") or threads,
              "mkl": _count(env, "MKL_NUM_THREADS") or threads,
              "blis": _count(env, "BLIS_NUM_THREADS") or threads}
    applied: dict[str, int] = {}
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # the BLAS and OpenMP pools keep the server's one thread; torch's and Arrow's are still set
        pass
    else:
        for controller in ThreadpoolController().lib_controllers:
            if controller.internal_api in limits:
                controller.set_num_threads(limits[controller.internal_api])
                applied[controller.internal_api] = limits[controller.internal_api]
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
        applied["torch"] = threads
    if "pyarrow" in sys.modules and _count(env, "OMP_NUM_THREADS") is not None:
        sys.modules["pyarrow"].set_cpu_count(
            threads
        )  # Arrow's CPU pool takes OMP_NUM_THREADS when set, as it does at load
        applied["arrow"] = threads
    numexpr_threads = _count(env, "NUMEXPR_NUM_THREADS")
    if "numexpr" in sys.modules and numexpr_threads is not None:
        sys.modules["numexpr"].set_num_threads(numexpr_threads)
        applied["numexpr"] = numexpr_threads
    return applied
