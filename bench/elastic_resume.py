"""Continue smaller on the process-backed cluster: a node lost -> the gang's first step at the smaller size.

A 3-node x 1-process digits trial with a node range (`Distribution(nodes=3,
min_nodes=2)`, DDP) runs through the real `KubernetesLauncher` (JobSet) on the
process-backed emulation (`tests.support.cluster`) with three nodes that have
room for one trial pod each. Once rank 0 has committed a checkpoint, the node
of rank 1 is lost (`EmulatedCluster.lose_node`: its pod's processes SIGKILLed by
PID, its capacity gone) and not returned. Measured: the loss -> the first
training step of the 2-node gang (rank 0's attempt record), which covers the
pod's failure as the Job controller sees it, the JobSet's whole-gang restart,
the restarted gang's third pod left Unschedulable for `RESIZE_AFTER` seconds
(the launcher's `resize_after_seconds`, a policy wait set low here; 120 s by
default), the restarted gang deleted, the next generation's JobSet at 2 nodes
created and admitted, two pods, their rendezvous, imports and the checkpoint
load at the new world size. Baseline: the cold start of a fixed 2-node gang of
the same trial on the same emulation (the launch call -> the first step of its
first attempt). Ratio = resume / cold start, lower is better; target <= 1.5
(issue 51), as `gang_recovery_seconds` has for a same-size restart.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bench.gang_recovery import IMAGE, _free_port, _rank0_checkpoint  # one copy: the gang drill's helpers
from bench.harness import Target, write_result

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 2
CHECKPOINT_EVERY = 10
RESIZE_AFTER = 2.0
STEP_SECONDS = 0.2
NS = "vision"


def _launch(launcher: Any, spec: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def launch() -> None:
        try:
            box["outcome"] = launcher.launch(spec)
        except BaseException as e:  # re-raised below, in the benchmark's thread
            box["error"] = e

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    return thread, box


def _done(thread: threading.Thread, box: dict[str, Any], what: str) -> Any:
    thread.join(900)
    if thread.is_alive() or "error" in box:
        raise RuntimeError(f"{what}: the launch did not succeed: {box.get('error', 'still running')}")
    return box["outcome"]


def run(work: Path, i: int) -> dict[str, Any]:
    from resources.k8s.launcher import KubernetesLauncher
    from tests.support.cluster import EmulatedCluster, KueueSettings, Node
    from tests.support.train_specs import make_spec
    from training.attempts import read_attempts
    from training.spec import CheckpointPolicy, Distribution, ImportTarget

    tmp = work / f"run-{i}"
    (tmp / "elastic").mkdir(parents=True)
    (tmp / "cold").mkdir()
    policy = CheckpointPolicy(every_n_steps=CHECKPOINT_EVERY, async_save=False)
    # Steps wait STEP_SECONDS until the file `fast` exists (a window for the loss to land mid-training); it is created
    # as the node is lost, so the resumed gang, like the cold one, steps at full speed.
    fast = tmp / "steps-at-full-speed"
    model = ImportTarget(path="tests.support.gang_models:SlowSteps",
                         kwargs={"hidden": 16, "lr": 0.02, "step_seconds": STEP_SECONDS, "until": str(fast)})
    elastic = make_spec(
        tmp / "elastic",
        distribution=Distribution(nodes=3, min_nodes=2, procs_per_node=1),
        max_epochs=20,
        checkpoint=policy,
        model=model,
    )
    cold = make_spec(
        tmp / "cold", distribution=Distribution(nodes=2, procs_per_node=1), max_epochs=2, checkpoint=policy, model=model
    )
    nodes = [Node(f"node-{n}", {"cpu": "1", "memory": "4Gi", "nvidia.com/gpu": "0"}) for n in range(3)]
    kueue = KueueSettings(quota={"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "0"})
    with EmulatedCluster(tmp / "cluster", nodes=nodes, kueue=kueue, node_env={"OMP_NUM_THREADS": "1"}) as cluster:
        def launcher() -> Any:
            return KubernetesLauncher(
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
                resize_after_seconds=RESIZE_AFTER,
            )

        launched = time.time()
        thread, box = _launch(launcher(), elastic)
        gang, victim = cluster.wait_for(
            "a committed checkpoint of rank 0", lambda: _rank0_checkpoint(cluster), timeout=600
        )
        lost = time.time()
        cluster.lose_node(victim["spec"]["nodeName"])
        fast.touch()
        outcome = _done(thread, box, f"run {i}, elastic")
        cluster.wait_for("every pod process to end", lambda: not cluster.live_processes(), timeout=60)

        cold_launched = time.time()
        thread, box = _launch(launcher(), cold)
        _done(thread, box, f"run {i}, cold start")
        cluster.wait_for("every pod process to end", lambda: not cluster.live_processes(), timeout=60)
    first_step: Callable[[dict[str, Any]], float] = lambda a: float(a["first_step_at"])
    resumed = [a for a in read_attempts(elastic.output_uri) if a.get("first_step_at") and a["first_step_at"] >= lost]
    (cold_attempt,) = read_attempts(cold.output_uri)
    if not resumed or not cold_attempt.get("first_step_at"):
        raise RuntimeError(f"run {i}: no attempt stepped after the node was lost, or the cold start never stepped")
    first = min(resumed, key=first_step)
    resizes = outcome.result.goodput.get("resizes") or []
    if [(r["from_nodes"], r["to_nodes"]) for r in resizes] != [(3, 2)]:
        raise RuntimeError(f"run {i}: expected one resize 3 -> 2, got {resizes}")
    decided = launched + resizes[0]["at_seconds"]
    return {
        "resume_seconds": first_step(first) - lost,
        "cold_start_seconds": first_step(cold_attempt) - cold_launched,
        "parts": {
            "loss_to_resize_decision_seconds": round(decided - lost, 3),
            "of_which_resize_after_seconds": RESIZE_AFTER,
            "decision_to_first_step_seconds": round(first_step(first) - decided, 3),
        },
        "gang": gang,
        "resumed_attempt": first["attempt"],
        "resumed_from_step": first.get("resumed_from_step"),
        "world_size_after": outcome.result.world_size,
        "resize": resizes[0],
    }


def main() -> dict:
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory(prefix="elastic-resume-") as tmp:
        runs = [run(Path(tmp), i) for i in range(REPEATS)]
    resumes = [r["resume_seconds"] for r in runs]
    starts = [r["cold_start_seconds"] for r in runs]
    return write_result(
        "elastic_resume_seconds",
        statistics.median(resumes),
        "s",
        statistics.median(starts),
        {
            "what": "a node of a 3-node digits gang (node range 2-3) lost -> the first step of the gang continued on "
                    "2 nodes "
            "(process-backed emulation, JobSet)",
            "baseline_is": "cold start of a fixed 2-node gang of the same trial on the same emulation: launch call -> "
                           "first step",
            "resize_after_seconds": RESIZE_AFTER,
            "runs": runs,
            "checkpoint_every_steps": CHECKPOINT_EVERY,
        },
        targets=[Target("ratio", "<=", 1.5)],
        better="lower",
        runs=resumes,
        baseline_runs=starts,
    )


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
