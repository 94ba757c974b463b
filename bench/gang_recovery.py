"""Gang recovery on the process-backed cluster: one pod SIGKILLed -> the gang's first resumed step.

A 2-node x 1-process digits trial runs through the real `KubernetesLauncher`
with its default gang kind, a JobSet, against the process-backed emulation
(`tests.support.cluster`: Kueue admission, the JobSet and Job controllers, pods
as local process groups running the rendered container command). Once rank 0
has committed a checkpoint, the process of the node-1 pod gets SIGKILL, as a
lost node would. Measured: the kill -> the first training step of the gang's
next attempt (rank 0's attempt record), which covers the pod's failure as the
Job controller sees it (the child Job fails: backoffLimit 0), node 0's pod
stopped within its grace period, the JobSet's whole-gang restart (child Job
deleted in the foreground, made again with restart-attempt 1), two new pods,
their rendezvous, imports and the checkpoint load. Baseline: the cold start of
the same gang (the launch call -> the first step of its first attempt: JobSet
creation, admission, child Job, two pods, rendezvous, imports). Ratio = recovery / cold start, lower is better; target
<= 1.5 (a
recovery may cost a cold start plus half of one for failure detection and the
checkpoint load), the target `recovery_seconds` has for the local launcher, set
before measuring.

The Indexed Job option (`gang_kind="job"`) restarts through the Dagster run's
retry instead (the launch fails, the next attempt is a new Job), which the
emulated tests cover and this benchmark does not time.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from bench.harness import Target, write_result

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 2
CHECKPOINT_EVERY = 20
NS = "vision"
IMAGE = "registry.example.com/trainyard/trainer@sha256:" + "0" * 64
INDEX = "batch.kubernetes.io/job-completion-index"
GANG = "trainyard.io/job-name"  # the gang's (JobSet's or Job's) name, on each of its pods
GANG_KIND = "jobset"  # the launcher's default, which restarts the gang inside one launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank0_checkpoint(cluster: Any) -> Optional[tuple[str, dict[str, Any]]]:
    """(gang name, the node-1 pod) once rank 0 logged a committed checkpoint, else None."""
    pods = cluster.pods()
    for pod in pods:
        if pod["metadata"]["annotations"].get(INDEX) == "0" and re.search(
            r"committed checkpoint \S+/step-\d+", cluster.log(pod["metadata"]["name"])
        ):
            gang = pod["metadata"]["labels"][GANG]
            victims = [
                p
                for p in pods
                if p["metadata"]["labels"].get(GANG) == gang
                and p["metadata"]["annotations"].get(INDEX) == "1"
                and p["status"].get("phase") == "Running"
                and not p["metadata"].get("deletionTimestamp")
            ]
            if victims:
                return gang, victims[0]
    return None


def run(work: Path, i: int) -> dict[str, Any]:
    from resources.k8s.launcher import KubernetesLauncher
    from tests.support.cluster import EmulatedCluster
    from tests.support.train_specs import make_spec
    from training.attempts import read_attempts
    from training.spec import CheckpointPolicy, Distribution

    tmp = work / f"run-{i}"
    tmp.mkdir()
    spec = make_spec(tmp, distribution=Distribution(nodes=2, procs_per_node=1), max_epochs=20,
                     checkpoint=CheckpointPolicy(every_n_steps=CHECKPOINT_EVERY, async_save=False))
    box: dict[str, Any] = {}
    with EmulatedCluster(tmp / "cluster", node_env={"OMP_NUM_THREADS": "1"}) as cluster:
        launcher = KubernetesLauncher(
            namespace=NS,
            image=IMAGE,
            api_url=cluster.url,
            poll_interval_seconds=0.5,
            cpu="1",
            memory="1Gi",
            master_port=_free_port(),
            termination_grace_seconds=15,
            run_timeout_seconds=1500,
            queue_timeout_seconds=120,
            gang_kind=GANG_KIND,
        )

        def launch() -> None:
            try:
                box["outcome"] = launcher.launch(spec)
            except BaseException as e:  # re-raised below, in the benchmark's thread
                box["error"] = e

        launched = time.time()
        thread = threading.Thread(target=launch, daemon=True)
        thread.start()
        job, victim = cluster.wait_for(
            "a committed checkpoint of rank 0", lambda: _rank0_checkpoint(cluster), timeout=600
        )
        killed = time.time()
        cluster.kill(victim["metadata"]["name"], signal.SIGKILL)
        thread.join(900)
        if thread.is_alive() or "error" in box:
            raise RuntimeError(f"run {i}: the launch did not succeed: {box.get('error', 'still running')}")
        cluster.wait_for("every pod process to end", lambda: not cluster.live_processes(), timeout=60)
    attempts = sorted(read_attempts(spec.output_uri), key=lambda a: a["started"])
    # The first attempt after the cold one that stepped after the kill. (Selecting by "started within 1 s before
    # the kill" once picked the cold attempt itself: on an idle machine its first checkpoint came within a second
    # of its start, and the recovery read -0.24 s.)
    resumed = [a for a in attempts[1:] if a.get("first_step_at") and a["first_step_at"] >= killed]
    if len(attempts) < 2 or not resumed or not attempts[0].get("first_step_at"):
        raise RuntimeError(f"run {i}: no cold attempt and resumed attempt after the kill: {attempts}")
    goodput = box["outcome"].result.goodput
    restarts = cluster.jobsets.restarts
    if len(restarts) != 1:
        raise RuntimeError(f"run {i}: expected one whole-gang restart of the JobSet, got {restarts}")
    return {
        "recovery_seconds": resumed[0]["first_step_at"] - killed,
        "cold_start_seconds": attempts[0]["first_step_at"] - launched,
        "gang": job,
        "gang_kind": GANG_KIND,
        "jobset_restarts": restarts,
        "attempts": len(attempts),
        "lost_steps": goodput.get("lost_steps"),
        "restart_causes": goodput.get("restart_causes"),
    }


def main() -> dict:
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory(prefix="gang-recovery-") as tmp:
        runs = [run(Path(tmp), i) for i in range(REPEATS)]
    recoveries = [r["recovery_seconds"] for r in runs]
    starts = [r["cold_start_seconds"] for r in runs]
    return write_result(
        "gang_recovery_seconds",
        statistics.median(recoveries),
        "s",
        statistics.median(starts),
        {
            "what": "one pod of a 2-node digits gang SIGKILLed -> the gang's first resumed step (JobSet: whole-gang "
                    "restart, "
            "process-backed emulation)",
            "baseline_is": "cold start of the same gang: launch call -> first step of its first attempt",
            "runs": runs,
            "checkpoint_every_steps": CHECKPOINT_EVERY,
            "nodes": 2,
        },
        targets=[Target("ratio", "<=", 1.5)],
        better="lower",
        runs=recoveries,
        baseline_runs=starts,
    )


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
