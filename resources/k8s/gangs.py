"""One gang per trial attempt: find a trial's gangs, keep this attempt's, delete the rest; collect gangs of ended runs.

Every object of a gang carries the trial's labels (`resources.k8s.names.trial_labels`):
pipeline, trial, attempt and the Dagster run id. A gang is a JobSet (the
default) or an Indexed Job; a JobSet's child Jobs carry the trial's labels too
but are its controller's, never a gang of their own. Before a launch the
supervisor lists the trial's JobSets, Jobs and Services by the pipeline and
trial labels (filtering again client-side: the selector is an optimisation,
the labels are the truth) and:

- a gang of this attempt (same name, attempt and run id) is re-attached to,
  running or finished (a restarted orchestrator, or run monitoring resuming the run);
- every other unfinished gang of the trial (an earlier attempt, or a run that
  died and was retried), of either kind, and every gang under this attempt's
  name that belongs to another run is deleted (foreground), and the launch waits
  until they are gone, so two gangs never write to the trial's checkpoint
  directory at once; finished gangs of other names hold no quota and stay for
  their TTL (logs);
- Services of the trial that are not this attempt's are deleted (they are owned
  by their Job, so the garbage collector deletes them too; this also removes
  Services of a launch that died between creating Job and Service).

`collect_garbage` (`trainyard k8s gc`) deletes the unfinished gangs (JobSets
and Jobs) whose Dagster run has ended (or is unknown to the instance), and their Services.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from kubernetes.client.exceptions import ApiException

from resources.k8s.kinds import GangApi, GangView
from resources.k8s.names import LABEL_ATTEMPT, LABEL_JOB, LABEL_RUN, trial_selector
from resources.launcher import InfrastructureError
from training.spec import TrainSpec


def selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def _labels(obj: Any) -> dict[str, str]:
    if isinstance(obj, GangView):
        return dict(obj.labels)
    return dict(obj.metadata.labels or {})


def has_labels(obj: Any, want: Mapping[str, str]) -> bool:
    labels = _labels(obj)
    return all(labels.get(k) == v for k, v in want.items())


def is_attempt(obj: Any, want: Mapping[str, str]) -> bool:
    """`obj` belongs to exactly the attempt `want` labels: same labels, and a run label only if `want` has one."""
    return has_labels(obj, want) and (LABEL_RUN in want) == (LABEL_RUN in _labels(obj))


def finished(gang: GangView) -> bool:
    return gang.finished


def describe(obj: Any) -> str:
    labels = _labels(obj)
    return f"attempt {labels.get(LABEL_ATTEMPT, '?')} of run {labels.get(LABEL_RUN, '(none)')}"


def list_gangs(gangs: GangApi, sel: str) -> list[GangView]:
    """The JobSets and Jobs (not a JobSet's child Jobs) matching `sel`; no JobSets where the cluster has no JobSet API
    (404)."""
    out = [j for j in gangs.list("Job", sel) if not j.owned_by_jobset]
    try:
        out += gangs.list("JobSet", sel, expect=(404,))
    except ApiException:
        pass  # no JobSet controller on this cluster: no JobSets
    return out


def trial_gangs(sup: Any, spec: TrainSpec) -> tuple[list[GangView], list[Any]]:
    """The gangs (JobSets, Jobs) and Services of every attempt of `spec`'s trial in the supervisor's namespace."""
    sel = trial_selector(spec)
    gangs = list_gangs(sup.gangs, selector(sel))
    services = sup._api(f"list Services of trial {spec.trial_id}", sup.core.list_namespaced_service, sup.namespace,
                        label_selector=selector(sel))
    return [g for g in gangs if has_labels(g, sel)], [s for s in services.items if has_labels(s, sel)]


def clear_other_gangs(sup: Any, spec: TrainSpec, name: str, want: Mapping[str, str], log: Any, timeout: float) -> None:
    """Delete the trial's gangs that are not attempt `want` (gang `name`) and wait until they are gone.

    Raises:
        InfrastructureError: a deleted gang was still there after `timeout` seconds (retryable).
    """
    gangs, services = trial_gangs(sup, spec)
    stale = [g for g in gangs if not (g.name == name and is_attempt(g, want))
             and (g.name == name or not finished(g))]
    for gang in stale:
        log.warning(f"trial {spec.trial_id}: deleting {gang.kind} {sup.namespace}/{gang.name} ({describe(gang)}): "
                    "one gang per trial, and this launch is the newest")
        sup.delete_gang(gang.kind, gang.name, log)
    for svc in services:
        if not (svc.metadata.name == name and is_attempt(svc, want)):
            sup.delete_service(svc.metadata.name, log)
    deadline = sup.clock() + timeout
    for gang in stale:
        while sup.get_gang(gang.kind, gang.name) is not None:
            if sup.clock() > deadline:
                raise InfrastructureError(
                    f"trial {spec.trial_id}: {gang.kind} {sup.namespace}/{gang.name} ({describe(gang)}) is still being "
                    f"deleted after {timeout:.0f} s (its pods are terminating); not starting a second gang beside it"
                )
            sup.sleep(sup.poll_interval)


def _gone_ok(delete: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Delete; an object already gone (404: deleted with its owner, or by someone else) is fine."""
    try:
        delete(*args, **kwargs)
    except ApiException as e:
        if e.status != 404:
            raise


@dataclass(frozen=True)
class Collected:
    """One gang `collect_garbage` deleted (or would delete, dry run)."""

    namespace: str
    job: str
    run_id: str
    run_status: str
    kind: str = "Job"


def collect_garbage(batch: Any, core: Any, namespace: str, run_status: Callable[[str], Optional[str]], *,
                    dry_run: bool = False, log: Callable[[str], None] = print, custom: Any = None) -> list[Collected]:
    """Delete the unfinished gangs (Jobs, and JobSets when `custom` is given) in `namespace` whose Dagster run has
    ended, and those runs' Services.

    `run_status(run_id)` is the run's status name (e.g. "STARTED", "FAILURE"),
    or None when the instance does not know the run. A run has ended when its
    status is SUCCESS, FAILURE or CANCELED, or when it is unknown. Objects
    without a run label (launched outside Dagster) are left alone.
    """
    api = GangApi(batch, custom, namespace, lambda _what, fn, *a, expect=(), **kw: fn(*a, **kw))
    jobs = [j for j in (list_gangs(api, LABEL_RUN) if custom is not None else api.list("Job", LABEL_RUN))
            if _labels(j).get(LABEL_RUN) and not j.owned_by_jobset]
    services = [
        s for s in core.list_namespaced_service(namespace, label_selector=LABEL_RUN).items if _labels(s).get(LABEL_RUN)
    ]
    statuses: dict[str, str] = {}
    for run_id in sorted({_labels(o)[LABEL_RUN] for o in [*jobs, *services]}):
        status = run_status(run_id)
        statuses[run_id] = "UNKNOWN" if status is None else status
    ended = {r for r, s in statuses.items() if s in ("SUCCESS", "FAILURE", "CANCELED", "UNKNOWN")}
    out = []
    for job in jobs:
        run_id = _labels(job)[LABEL_RUN]
        if run_id in ended and not finished(job):
            out.append(Collected(namespace, job.name, run_id, statuses[run_id], job.kind))
            log(f"{'would delete' if dry_run else 'deleting'} {job.kind} {namespace}/{job.name}: "
                f"its Dagster run {run_id} is {statuses[run_id]}")
            if not dry_run:
                if job.kind == "Job":
                    _gone_ok(batch.delete_namespaced_job, job.name, namespace, propagation_policy="Foreground")
                else:
                    _gone_ok(api.delete, job.kind, job.name)
    for svc in services:
        run_id = _labels(svc)[LABEL_RUN]
        if run_id in ended:
            log(f"{'would delete' if dry_run else 'deleting'} Service {namespace}/{svc.metadata.name} "
                f"(gang {_labels(svc).get(LABEL_JOB)}): its Dagster run {run_id} is {statuses[run_id]}")
            if not dry_run:
                _gone_ok(core.delete_namespaced_service, svc.metadata.name, namespace)
    return out
