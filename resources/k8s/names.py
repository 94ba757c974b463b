"""Names on the cluster: label and annotation keys, API groups, and the deterministic object names.

The Job name is a contract across orchestrator versions: a new version must
compute the names of Jobs an older one started, so it can re-attach to them.
"""

from __future__ import annotations

import hashlib
import re
from typing import Optional

from resources.k8s.errors import ManifestError
from training.spec import TrainSpec

LABEL_PIPELINE = "trainyard.io/pipeline"
LABEL_TRIAL = "trainyard.io/trial"
LABEL_ATTEMPT = "trainyard.io/attempt"
# The Dagster run that launched the gang: `trainyard k8s gc` deletes gangs whose run has ended.
LABEL_RUN = "trainyard.io/dagster-run"
# Our own pod label for the Service selector: the Job controller's `job-name`
# labels exist too, but selecting on a label this package writes keeps the
# Service correct without relying on controller behaviour.
LABEL_JOB = "trainyard.io/job-name"
ANNOTATION_SPEC_URI = "trainyard.io/spec-uri"
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
CONTAINER_NAME = "trainer"
GPU_RESOURCE = "nvidia.com/gpu"
KUEUE_API = "kueue.x-k8s.io/v1beta2"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_REPLICATED_JOB = "node"

# Indexed Job pods are named `<job>-<index>` for their hostname, which must stay a
# DNS label (<= 63 chars): keep 7 characters for "-<index>" (up to a million pods).
MAX_JOB_NAME = 56
# JobSet pod hostnames are `<jobset>-node-<job index>-<pod index>`.
MAX_JOBSET_NAME = 48
_HASH_LEN = 8


def _short_hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:_HASH_LEN]


def _dns_fragment(text: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", text.lower())).strip("-")


def job_name(pipeline: str, trial_id: str, attempt: int, *, max_length: int = MAX_JOB_NAME) -> str:
    """The Job's (and its Service's) name: deterministic, DNS-1035, at most `max_length`.

    A restarted or retried orchestrator computes the same name for the same trial
    and attempt, finds the Job already there and re-attaches instead of starting a
    second gang. The readable head (`<team>-<pipeline>-<trial>`) is truncated for
    long inputs; the tail `a<attempt>-<hash>` always survives, and the hash covers
    the untruncated inputs, so names differ whenever the inputs differ (sanitising
    maps both `/` and `_` to `-`, which alone could make two pipelines collide).

    Example:
        >>> job_name("vision/digits", "trial-0003", 0)[:28]
        'vision-digits-trial-0003-a0-'
    """
    if attempt < 0:
        raise ManifestError(f"attempt={attempt} is negative; attempts count from 0")
    tail = f"a{attempt}-{_short_hash(pipeline, trial_id, str(attempt))}"
    head = _dns_fragment(f"{pipeline}-{trial_id}")
    if not head or not head[0].isalpha():
        # Service names are DNS-1035 labels: they must start with a letter.
        head = f"t-{head}".rstrip("-")
    room = max_length - len(tail) - 1
    if room < 1:
        raise ManifestError(f"max_length={max_length} leaves no room for a name; accepted: >= {len(tail) + 2}")
    head = head[:room].rstrip("-")
    return f"{head}-{tail}"


def label_value(text: str) -> str:
    """`text` as a valid label value (<= 63 chars; a short hash marks lossy changes).

    Example:
        >>> label_value("vision/digits")
        'vision.digits'
    """
    value = re.sub(r"[^A-Za-z0-9_.-]", ".", text)
    value = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)
    if len(value) > 63:
        value = value[: 63 - _HASH_LEN - 1].rstrip("-_.") + "-" + _short_hash(text)
    return value


def gang_name(
    pipeline: str, trial_id: str, attempt: int, generation: int = 0, *, max_length: int = MAX_JOB_NAME
) -> str:
    """The name of an attempt's gang at resize `generation`: `job_name` for 0, else `<job_name>-g<generation>` of the
    same length bound.

    A gang with a node range that continues smaller or grows back is a new gang
    (a JobSet's replicatedJobs are immutable); each resize of the attempt takes
    the next generation, so no two gangs of one launch share a name.
    """
    if generation <= 0:
        return job_name(pipeline, trial_id, attempt, max_length=max_length)
    tail = f"-g{generation}"
    return job_name(pipeline, trial_id, attempt, max_length=max_length - len(tail)) + tail


def trial_labels(spec: TrainSpec, attempt: int, run_id: Optional[str] = None) -> dict[str, str]:
    """The labels that identify one attempt's objects (one gang); re-attaching checks them.

    `run_id` is the Dagster run's id (a UUID, a valid label value as it is); a
    launch without a Dagster run (tests, scripts) has no run label.
    """
    labels = {
        LABEL_PIPELINE: label_value(spec.pipeline),
        LABEL_TRIAL: label_value(spec.trial_id),
        LABEL_ATTEMPT: str(attempt),
    }
    if run_id:
        labels[LABEL_RUN] = label_value(run_id)
    return labels


def trial_selector(spec: TrainSpec) -> dict[str, str]:
    """The labels every attempt of a trial shares: what finds its gangs, whatever the run or attempt."""
    return {LABEL_PIPELINE: label_value(spec.pipeline), LABEL_TRIAL: label_value(spec.trial_id)}
