"""What one watch of a gang keeps (`Watch`) and how it ends (`Outcomes`): success, a vanished gang, a mapped failure.

`JobSupervisor` (`resources.k8s.supervisor`) inherits `Outcomes`; the methods use
its API calls (`_get_job`, `_log_tail`), clock, namespace and log settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import fsspec

from resources.k8s.kinds import GangView
from resources.k8s.pod_events import PodWatch
from resources.k8s.pods import LogFollower, PodView, blame_order, rank0_pod
from resources.k8s.stuck import StuckTimers
from resources.launcher import (
    InfrastructureError,
    LaunchError,
    LaunchOutcome,
    TrainingCodeError,
    TrainingConfigError,
    TrainingPreempted,
    join,
    outcome_error,
    read_failures,
    read_result,
)
from training.spec import EXIT_BAD_CONFIG, RESULT_FILE, TrainSpec


@dataclass
class Watch:
    """Bookkeeping of one watch: what was reported already, time spent per state."""

    kind: str = "Job"
    owns_job: bool = False
    owns_service: bool = False
    restarts: int = 0
    failed_since_restart: list[PodView] = field(default_factory=list)
    blamed: set[str] = field(default_factory=set)  # every pod ever put in failed_since_restart
    pod_watch: Optional[PodWatch] = None
    finished: bool = False
    queued_seconds: float = 0.0
    running_seconds: float = 0.0
    state: Optional[str] = None
    workload_note: str = ""
    reported: dict[str, str] = field(default_factory=dict)
    timers: StuckTimers = field(default_factory=lambda: StuckTimers({}))
    log_pod: Optional[str] = None
    log_read_at: Optional[float] = None
    follower: LogFollower = field(default_factory=LogFollower)
    workloads_forbidden: bool = False
    resizer: Optional[Any] = None  # an elastic launch's `resources.k8s.elastic.Resizer`
    resized: bool = False  # left for a relaunch at another size

    def blame(self, pod: PodView) -> None:
        """Count a failed pod against the next restart, once, whether a poll listed it or the pod watch saw it."""
        if pod.name not in self.blamed:
            self.blamed.add(pod.name)
            self.failed_since_restart.append(pod)

    def take_watched(self) -> None:
        """Blame the failed pods the pod watch kept since the last poll (a disruption is not a failure, as in a
        poll)."""
        for pod in self.pod_watch.failed() if self.pod_watch is not None else []:
            if not pod.disrupted:
                self.blame(pod)



class Outcomes:
    """The end of a watch, for `JobSupervisor`."""

    namespace: str
    log_tail_lines: int
    saved_log_lines: int
    clock: Callable[[], float]

    def _get_job(self, name: str) -> Any:
        raise NotImplementedError

    def _log_tail(self, pod: Optional[PodView], lines: int) -> str:
        raise NotImplementedError

    def _save_log(self, spec: TrainSpec, name: str, pods: list[PodView]) -> str:
        """Keep rank 0's log with the trial's files; the pod goes away with the Job's TTL."""
        uri = join(spec.output_uri, "logs", f"{name}.rank0.log")
        fs, path = fsspec.core.url_to_fs(uri)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        rank0 = rank0_pod(pods)
        with fs.open(path, "w") as f:
            f.write(self._log_tail(rank0, self.saved_log_lines) if rank0 else "(no rank 0 pod left to read a log from)")
            f.write("\n")
        return uri

    def _success(self, spec: TrainSpec, name: str, started: float, pods: list[PodView], w: Watch) -> LaunchOutcome:
        log_uri = self._save_log(spec, name, pods)
        result = read_result(spec.output_uri)
        if result is None:
            raise InfrastructureError(
                f"trial {spec.trial_id}: {w.kind} {self.namespace}/{name} completed but "
                f"{join(spec.output_uri, RESULT_FILE)} "
                "does not exist (is output_uri shared storage the pods can write?)"
            )
        return LaunchOutcome(result=result, log_uri=log_uri, seconds=self.clock() - started)

    def _vanished(self, spec: TrainSpec, name: str, started: float, w: Watch) -> LaunchOutcome:
        w.finished = True
        result = read_result(spec.output_uri)
        if result is None:
            raise InfrastructureError(
                f"trial {spec.trial_id}: {w.kind} {self.namespace}/{name} disappeared before finishing "
                "(deleted by someone, or removed by its TTL unseen) and left no result"
            )
        return LaunchOutcome(result=result, log_uri=self._save_log(spec, name, []), seconds=self.clock() - started)

    def _failure(self, spec: TrainSpec, name: str, gang: GangView, pods: list[PodView], w: Watch) -> LaunchError:
        condition = gang.failed
        assert condition is not None
        child = None
        if gang.kind == "JobSet":
            # The child Job that failed it: its reason (PodFailurePolicy, BackoffLimitExceeded, DeadlineExceeded) says
            # why.
            for child_name in gang.children:
                job = self._get_job(child_name)
                failed = [c for c in ((job.status.conditions or []) if job is not None and job.status else [])
                          if c.type == "Failed" and c.status == "True"]
                if failed:
                    child = (child_name, failed[0])
                    break
        failed = [p for p in pods if p.phase == "Failed" and not p.disrupted]
        culprit = min(failed, key=blame_order, default=None)
        code = culprit.exit_code if culprit is not None and culprit.exit_code is not None else -1
        rank0 = rank0_pod(pods)
        tail = self._log_tail(rank0, self.log_tail_lines)
        err = outcome_error(code, read_failures(spec.output_uri), tail, spec.trial_id)
        disrupted = [p for p in pods if p.phase == "Failed" and p.disrupted]
        if culprit is None and disrupted and not isinstance(err, (TrainingConfigError, TrainingCodeError)):
            # Only disruptions failed the gang's Job (the Indexed Job option fails on any pod failure): a preemption,
            # retried from the checkpoint the pods wrote on SIGTERM, under the run's preemption budget.
            err = TrainingPreempted(
                f"trial {spec.trial_id}: {min(disrupted, key=blame_order).describe()}; a disruption, not a failure: "
                "the run retries the trial from its last checkpoint",
                log_tail=tail,
            )
        if code == EXIT_BAD_CONFIG and not isinstance(err, TrainingConfigError):
            err = TrainingConfigError(
                f"trial {spec.trial_id}: the entrypoint exited {EXIT_BAD_CONFIG} (bad config) without a failure record "
                "(is spec.json readable from the pods?)", log_tail=tail,
            )
        reason = child[1].reason if child is not None else condition.reason
        if reason == "DeadlineExceeded":  # killed by activeDeadlineSeconds: a retry would run as long
            err = LaunchError(
                f"trial {spec.trial_id}: ran past the Job's activeDeadlineSeconds (a hung or too-long trial)",
                log_tail=tail,
            )
        details = [f"Kubernetes: {gang.kind} {self.namespace}/{name} failed ({condition.reason}: {condition.message})"]
        if gang.kind == "JobSet":
            details[0] += f" after {gang.restarts} whole-gang restart(s) of at most {gang.max_restarts}"
        if child is not None:
            details.append(f"child Job {child[0]} failed ({child[1].reason}: {child[1].message})")
        if culprit is not None:
            details.append(culprit.describe())
            if rank0 is None or culprit.name != rank0.name:
                details.append(f"last {self.log_tail_lines} log lines of {culprit.name}:\n"
                               f"{self._log_tail(culprit, self.log_tail_lines)}")
        if rank0 is not None and tail and tail not in str(err):
            details.append(f"last {self.log_tail_lines} log lines of rank 0 ({rank0.name}):\n{tail}")
        try:
            self._save_log(spec, name, pods)
        except OSError as e:
            details.append(f"(could not save rank 0's log: {e})")
        return type(err)("\n".join([str(err), *details]), log_tail=tail, rank=err.rank)
