"""A gang with a node range (`Distribution(nodes=4, min_nodes=2)`): continue smaller after losing a node, grow back.

Why a new gang per size, decided by the orchestrator (docs/kubernetes.md, "Node
lost: continue smaller, grow back"): a JobSet's `replicatedJobs` are immutable
and its restarts recreate every child Job at the same size; Kueue admits a
Workload's pod counts as created (partial admission only shrinks a batch/v1
Job before it starts); torchrun's elastic rendezvous (`--nnodes=min:max`) would
restart every worker at the new world size anyway, but only if the pods of the
lost node were not replaced by a whole-gang restart first. So the supervisor
relaunches: the trial's checkpoint resumes at any world size, which makes the
mechanism independent of the strategy.

- **Continue smaller.** While a gang runs, pods of it that the scheduler
  cannot place (PodScheduled=False, Unschedulable) for `resize_after` seconds
  of admitted time, with no pod of it still terminating (whose node would free
  up), mean that the missing nodes are not coming back soon: the gang is
  relaunched on the nodes its placed pods have, if that is within the range
  (`ResizeNeeded`). The old gang is deleted (its pods get SIGTERM and write the
  preemption checkpoint when they still train) and the next generation
  (`resources.k8s.names.gang_name`) resumes from the newest committed checkpoint.
- **Grow back.** A smaller gang keeps a capacity probe beside it: an Indexed
  Job of one placeholder pod per missing node, shaped like the gang's pods
  (`resources.k8s.manifests.capacity_probe_manifest`). Once all of them run
  (or some, unchanged for `resize_after` seconds), that many nodes fit again:
  the gang is relaunched larger, at a checkpoint boundary (SIGTERM writes the
  checkpoint the next gang resumes from), and the probe is deleted so its
  nodes are free for the gang.

Each size change is logged in the Dagster run with its cause, and the trial's
goodput block gets the resizes, the seconds at each size and the device-hours
summed over the sizes (`account`), in the outcome and in `result.json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import fsspec
from kubernetes.client.exceptions import ApiException

from resources.k8s.config import K8sJobConfig
from resources.k8s.manifests import capacity_probe_manifest
from resources.k8s.names import trial_labels
from resources.k8s.pods import PodView
from resources.launcher import LaunchOutcome, join
from training.spec import RESULT_FILE, TrainResult, TrainSpec

PROBE_SUFFIX = "-probe"


class ResizeNeeded(Exception):
    """The watched gang should be relaunched on `nodes` nodes, because of `cause` (not an error: the launch goes on)."""

    def __init__(self, nodes: int, cause: str) -> None:
        super().__init__(f"relaunch on {nodes} nodes: {cause}")
        self.nodes = nodes
        self.cause = cause


def at_nodes(spec: TrainSpec, nodes: int) -> TrainSpec:
    """`spec` on `nodes` nodes of its distribution's range (the pods read the node count from the spec)."""
    return spec.model_copy(update={"distribution": spec.distribution.at_nodes(nodes)})


@dataclass
class Resizer:
    """Decides, at each poll of one gang of an elastic launch, whether it should continue smaller or grow back.

    Args:
        sup: the `JobSupervisor` (its API calls, pods and deletes).
        spec: the trial's spec at its full size (the range is `spec.distribution`).
        size: the node count of the gang being watched.
        gang: its name; the probe is `<gang>-probe`.
        cfg, attempt, run_id: what the gang was launched with (the probe's pods and labels).
        bound: seconds of admitted time an unplaced pod (or a partly placed probe) waits before a resize.
        log: the launch's log (the Dagster run's).
    """

    sup: Any
    spec: TrainSpec
    size: int
    gang: str
    cfg: K8sJobConfig
    attempt: int
    run_id: Optional[str]
    bound: float
    log: Any
    unplaced_since: Optional[float] = None
    probe: Optional[str] = None
    probe_room: int = 0
    probe_since: float = 0.0
    probe_reported: set[str] = field(default_factory=set)

    @property
    def full(self) -> int:
        return self.spec.distribution.nodes

    @property
    def smallest(self) -> int:
        return self.spec.distribution.smallest

    def check(self, pods: list[PodView], running_seconds: float) -> None:
        """Raise `ResizeNeeded` when the gang should be relaunched at another size; start the probe of a smaller gang.

        `pods` are the gang's pods as the poll read them; `running_seconds` its admitted time so far.
        """
        self._shrink(pods, running_seconds)
        if self.size < self.full:
            self._grow(running_seconds)

    def _shrink(self, pods: list[PodView], now: float) -> None:
        live = [p for p in pods if p.phase in ("Pending", "Running") and not p.terminating]
        unplaced = [p for p in live if not p.node and p.unschedulable]
        if not unplaced or any(p.terminating for p in pods):
            # A terminating pod of the gang (its previous incarnation) still holds a node that may fit the rest.
            self.unplaced_since = None
            return
        if self.unplaced_since is None:
            self.unplaced_since = now
            return
        waited = now - self.unplaced_since
        placed = len([p for p in live if p.node])
        if waited < self.bound or not self.smallest <= placed < self.size:
            return
        first = min(unplaced, key=lambda p: p.index if p.index is not None else 1 << 30)
        raise ResizeNeeded(
            placed,
            f"node lost: {len(unplaced)} of the gang's {self.size} pods could not be placed for "
            f"{waited:.0f} s (bound {self.bound:.0f} s; pod {first.name}: {first.unschedulable}); "
            f"{placed} nodes have room",
        )

    def _grow(self, now: float) -> None:
        missing = self.full - self.size
        if self.probe is None:
            self._start_probe(missing)
            return
        running = [p for p in self.sup._pods(self.probe) if p.phase == "Running" and not p.terminating]
        for p in running:
            if p.name not in self.probe_reported:
                self.probe_reported.add(p.name)
                self.log.info(f"trial {self.spec.trial_id}: capacity probe pod {p.name} runs on node {p.node or '?'}: "
                              "one more node of the gang fits")
        room = len(running)
        if room != self.probe_room:
            self.probe_room, self.probe_since = room, now
        nodes = [p.node for p in running if p.node]
        if room >= missing or (room and now - self.probe_since >= self.bound):
            raise ResizeNeeded(
                self.size + min(room, missing),
                f"capacity returned: {room} of {missing} capacity probe pods run (nodes "
                f"{', '.join(sorted(nodes)) or '?'})",
            )

    def _start_probe(self, pods: int) -> None:
        name = f"{self.gang}{PROBE_SUFFIX}"
        body = capacity_probe_manifest(
            self.spec, self.cfg, name, pods, trial_labels(self.spec, self.attempt, self.run_id)
        )
        try:
            self.sup._api(
                f"create Job {name}", self.sup.batch.create_namespaced_job, self.sup.namespace, body, expect=(409,)
            )
        except ApiException:
            pass  # an earlier try went through
        self.probe = name
        self.log.info(
            f"trial {self.spec.trial_id}: capacity probe Job {self.sup.namespace}/{name} holds {pods} placeholder "
            f"pod(s) shaped like the gang's; the gang grows back when they run"
        )

    def close(self) -> None:
        """Delete the capacity probe, if one was made, and wait (at most `delete_timeout`) until it is gone.

        Its pods free their nodes for the next gang, and the next gang's launch
        does not find it among the trial's objects.
        """
        if self.probe is None:
            return
        self.sup.delete_job(self.probe, self.log)
        deadline = self.sup.clock() + self.sup.delete_timeout
        while self.sup._get_job(self.probe) is not None and self.sup.clock() < deadline:
            self.sup.sleep(self.sup.poll_interval)
        self.probe = None


def run_elastic(
    sup: Any,
    spec: TrainSpec,
    spec_uri: str,
    attempt: int,
    cfg: K8sJobConfig,
    log: Any,
    run_id: Optional[str],
    tick: Callable[[], None],
    kind: str,
    bound: float,
) -> LaunchOutcome:
    """Run `spec`'s gang, relaunched at another size of its node range whenever a `Resizer` says so, until it ends.

    Every gang is `sup.run_gang` of the next generation; what ends the last one
    (success, a launch error) ends the launch. The outcome's goodput block
    accounts for the sizes (`account`).
    """
    dist = spec.distribution
    size, generation = dist.nodes, 0
    resizes: list[dict[str, Any]] = []
    spans: list[tuple[int, float]] = []
    started = sup.clock()
    while True:
        sized = at_nodes(spec, size)
        gang = sup.gang_name(sized, attempt, kind, generation)
        resizer = Resizer(sup, spec, size, gang, cfg, attempt, run_id, bound, log)
        began = sup.clock()
        try:
            outcome: LaunchOutcome = sup.run_gang(sized, spec_uri, attempt, cfg, log, run_id, tick, kind,
                                                  generation=generation, resizer=resizer)
        except ResizeNeeded as r:
            spans.append((size, sup.clock() - began))
            verb = "continues smaller" if r.nodes < size else "grows back"
            log.warning(
                f"trial {spec.trial_id}: the gang {verb}: {size} -> {r.nodes} nodes (range "
                f"{dist.smallest}-{dist.nodes}; "
                f"{r.cause}); deleting {gang} and resuming from the newest committed checkpoint at world size "
                f"{r.nodes * dist.procs_per_node}"
            )
            resizes.append(
                {
                    "from_nodes": size,
                    "to_nodes": r.nodes,
                    "cause": r.cause,
                    "at_seconds": round(sup.clock() - started, 3),
                    "gang": gang,
                }
            )
            size, generation = r.nodes, generation + 1
            continue
        finally:
            resizer.close()
        spans.append((size, sup.clock() - began))
        if resizes:
            account(outcome, resizes, spans, dist.procs_per_node)
            write_result(spec.output_uri, outcome.result)
        return outcome


def write_result(output_uri: str, result: TrainResult) -> None:
    """Rewrite the trial's `result.json` with the accounted goodput, so the file says what the Dagster metadata says."""
    fs, path = fsspec.core.url_to_fs(join(output_uri, RESULT_FILE))
    with fs.open(f"{path}.tmp", "w") as f:
        f.write(result.model_dump_json(indent=2))
    fs.mv(f"{path}.tmp", path)


def account(
    outcome: LaunchOutcome, resizes: list[dict[str, Any]], spans: list[tuple[int, float]], procs_per_node: int
) -> None:
    """Put the size changes into the result's goodput block: what changed and why, seconds per size, device-hours over
    the sizes.

    The pods' own `device_hours` multiply the trial's wall time by the last
    gang's world size; with resizes, each gang's time counts at its own size.
    """
    seconds: dict[str, float] = {}
    for nodes, secs in spans:
        seconds[str(nodes)] = round(seconds.get(str(nodes), 0.0) + secs, 3)
    block = outcome.result.goodput
    block["resizes"] = resizes
    block["seconds_at_nodes"] = seconds
    block["device_hours"] = sum(n * procs_per_node * s for n, s in spans) / 3600.0
