"""This process as the kernel sees it: its threads, and the thread pools its libraries keep, for processes that fork.

A process may fork safely only while it has one thread: a fork copies no other thread, but every lock they held.
Python's `threading.enumerate` sees only Python's threads; the thread pools of native libraries (OpenBLAS, which
numpy loads, starts its workers as it loads; pyarrow's jemalloc its background purger) are threads too, so a process
about to fork checks `/proc/self/task` (`thread_names`), and starts with one thread in each pool
(`SINGLE_THREADED_ENV`), giving its forked children their real counts back (`restore_thread_counts`).
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

# Started with these, the libraries a warm process preloads keep no thread of their own: the OpenMP, BLAS and numexpr
# pools one thread each (`training.spec.THREAD_COUNT_ENV` names the same counts), pyarrow's jemalloc no purging thread.
SINGLE_THREADED_ENV = {
    **{name: "1" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                              "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")},
    "JE_ARROW_MALLOC_CONF": "background_thread:false",
}


def thread_names() -> list[str]:
    """The names of this process's threads, native ones included (Linux `/proc`; elsewhere Python's threads only)."""
    try:
        tids = sorted(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return [t.name for t in threading.enumerate()]
    names = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue  # the thread ended
    return names


def _count(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def restore_thread_counts(env: Mapping[str, str]) -> dict[str, int]:
    """In a child forked from a process started with `SINGLE_THREADED_ENV`: give each OpenMP and BLAS runtime loaded
    the thread count a process started with `env` would have (each library's own variable, then `OMP_NUM_THREADS`,
    else this process's CPUs); the counts set, by runtime. Nothing without threadpoolctl (a scikit-learn dependency)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    omp = _count(env, "OMP_NUM_THREADS")
    limits = {"openmp": omp or cpus,
              "openblas": _count(env, "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS") or omp or cpus,
              "mkl": _count(env, "MKL_NUM_THREADS") or omp or cpus,
              "blis": _count(env, "BLIS_NUM_THREADS") or omp or cpus}
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return {}
    applied = {}
    for controller in ThreadpoolController().lib_controllers:
        if controller.internal_api in limits:
            controller.set_num_threads(limits[controller.internal_api])
            applied[controller.internal_api] = limits[controller.internal_api]
    return applied
