"""`KubernetesLauncher`: the Dagster resource that runs a trial as a gang under Kueue: a JobSet, or an Indexed Job.

It holds the configuration and builds the API clients; `JobSupervisor`
(`resources.k8s.supervisor`) does the work. Under Dagster a launch runs in a
Pipes session as a local one does: the context reaches the pods as environment
variables and rank 0 writes its messages to the trial's store
(`resources.pipes_store`), so its log lines, progress and per-epoch metrics
(asset observations, `ProgressRelay`) reach the run while the gang trains.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal, Optional

from dagster import AssetExecutionContext, Config, OpExecutionContext, PipesEnvContextInjector, open_pipes_session
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from pydantic import Field, model_validator

from resources.k8s.config import Affinity, K8sJobConfig, SecretKeyRef, Toleration
from resources.k8s.manifests import trial_objects as build_trial_objects
from resources.k8s.supervisor import JobSupervisor
from resources.launcher import Launcher, LaunchOutcome, ProgressRelay, join
from resources.pipes_store import PipesStoreMessageReader
from training.spec import SPEC_FILE, TrainSpec
from trainyard.podconfig import POD_ENV, PodConfig, warn_if_unpinned

logger = logging.getLogger("trainyard.k8s")
PIPES_DIR = "pipes"  # under a trial's output: rank 0's Pipes messages, one folder per run and attempt


def attempt_number(context: Any) -> int:
    """The attempt a launch belongs to: 100 x run retry + step retry.

    A step retry (RetryPolicy) or a run retry is a new attempt, hence a new Job
    name; a restarted orchestrator in the same attempt computes the same name and
    re-attaches.
    """
    if context is None:
        return 0
    step = int(getattr(context, "retry_number", 0) or 0)
    run = getattr(context, "run", None)
    tags = getattr(run, "tags", None) or {}
    return 100 * int(tags.get("dagster/retry_number", 0)) + step


def run_id_of(context: Any) -> Optional[str]:
    """The Dagster run id of a launch (labels the gang; `trainyard k8s gc` asks the instance about it), None without one."""
    run_id = getattr(context, "run_id", None) or getattr(getattr(context, "run", None), "run_id", None)
    return run_id if isinstance(run_id, str) and run_id else None


# A trial's Job may run at most this long once admitted (activeDeadlineSeconds),
# unless the launcher (TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS, a team's pod
# settings) says otherwise: a hung gang cannot hold GPUs for ever even when no
# orchestrator watches it any more. Same bound as the launcher's run timeout.
DEFAULT_ACTIVE_DEADLINE_SECONDS = 7 * 86400


class TolerationConfig(Config):
    """A pod toleration; see `resources.k8s.config.Toleration`."""

    key: Optional[str] = None
    operator: str = "Equal"
    value: Optional[str] = None
    effect: Optional[str] = None
    toleration_seconds: Optional[int] = None


class SecretKeyConfig(Config):
    """One key of a Secret as one environment variable; see `resources.k8s.config.SecretKeyRef`."""

    secret: str
    key: str


def _bounds_from_env(env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for var, field_name in (("TRAINYARD_K8S_STUCK_SECONDS", "stuck_seconds"),
                            ("TRAINYARD_K8S_UNSCHEDULABLE_SECONDS", "unschedulable_seconds"),
                            ("TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS", "active_deadline_seconds"),
                            ("TRAINYARD_K8S_RESIZE_AFTER_SECONDS", "resize_after_seconds")):
        raw = env.get(var)
        if not raw:
            continue
        if not raw.isdigit():
            raise ValueError(f"{var}={raw!r} is not a number of seconds; accepted: 0, 1, 2, ...")
        out[field_name] = int(raw) if field_name != "active_deadline_seconds" else (int(raw) or None)
    return out


class KubernetesLauncher(Launcher):
    """Runs each trial attempt as one gang (one pod per node) under Kueue.

    `gang_kind` "jobset" (default): a JobSet, admitted by Kueue as one Workload,
    whose failurePolicy restarts the whole gang on an infrastructure failure or
    disruption within `backoff_limit` restarts and fails it at once on the
    entrypoint's user or config error code. "job": an Indexed Job and its
    headless Service, for clusters without the JobSet controller: the same exit
    code contract through its podFailurePolicy, and backoffLimit 0, so any pod
    failure fails the Job; the launcher raises the classified error and the
    Dagster run's retry (a new attempt, a new Job) restarts the whole gang from
    its checkpoint, within the pipeline's retry budgets.

    Cluster access, in order: `api_url` (a plain endpoint, for tests and
    `kubectl proxy`), `in_cluster` (the run pod's service account), else
    `kubeconfig`/`kube_context` (default kubeconfig when unset). The job fields
    are those of `K8sJobConfig` and are validated when the resource is built;
    an image named by tag instead of digest is accepted with a warning
    (`trainyard.podconfig.UnpinnedImageWarning` and a log line).
    """

    namespace: str
    image: str
    queue_name: Optional[str] = "trainyard"
    priority_class: Optional[str] = None
    workload_priority_class: Optional[str] = None
    service_account: Optional[str] = None
    gpus_per_pod: Optional[int] = None
    cpu: str = "2"
    memory: str = "8Gi"
    cpu_limit: Optional[str] = None
    memory_limit: Optional[str] = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[TolerationConfig] = Field(default_factory=list)
    affinity: Optional[dict[str, Any]] = Field(None, description="pod affinity, as in a manifest (nodeAffinity, ...)")
    shm_size: Optional[str] = "2Gi"
    scratch_size: Optional[str] = None
    termination_grace_seconds: int = 120
    ttl_seconds_after_finished: Optional[int] = 86400
    backoff_limit: int = 3
    active_deadline_seconds: Optional[int] = Field(
        DEFAULT_ACTIVE_DEADLINE_SECONDS, description="the Job's activeDeadlineSeconds: running time after admission; None: no deadline")
    env_from_secrets: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: dict[str, SecretKeyConfig] = Field(default_factory=dict)
    master_port: int = 29500
    labels: dict[str, str] = Field(default_factory=dict)
    gang_kind: Literal["jobset", "job"] = Field(
        "jobset", description="jobset (whole-gang restarts; needs the JobSet controller) or job (an Indexed Job and its Service)")

    api_url: Optional[str] = Field(None, description="explicit API server URL (tests, kubectl proxy)")
    in_cluster: bool = False
    kubeconfig: Optional[str] = None
    kube_context: Optional[str] = None
    kueue_version: str = "v1beta2"
    poll_interval_seconds: float = Field(10.0, gt=0)
    run_timeout_seconds: float = Field(7 * 86400.0, gt=0, description="running time after admission")
    queue_timeout_seconds: float = Field(86400.0, gt=0, description="time waiting for Kueue admission")
    log_tail_lines: int = Field(40, ge=1)
    stuck_seconds: float = Field(300.0, ge=0, description="admitted seconds an image pull error, crash loop or FailedCreate may last")
    unschedulable_seconds: float = Field(900.0, ge=0, description="admitted seconds a pod may stay Unschedulable")
    resize_after_seconds: float = Field(
        120.0, gt=0, description="admitted seconds a gang with a node range waits for a lost node before it continues smaller "
                                 "(and for part of its capacity to return before it grows back)")
    api_retries: int = Field(4, ge=0)

    @model_validator(mode="after")
    def _valid_job_config(self) -> "KubernetesLauncher":
        warn_if_unpinned("image", self.job_config().image, log=logger)
        return self

    def job_config(self) -> K8sJobConfig:
        return K8sJobConfig(
            namespace=self.namespace, image=self.image, queue_name=self.queue_name,
            priority_class=self.priority_class, workload_priority_class=self.workload_priority_class,
            service_account=self.service_account, gpus_per_pod=self.gpus_per_pod, cpu=self.cpu,
            memory=self.memory, cpu_limit=self.cpu_limit, memory_limit=self.memory_limit,
            node_selector=dict(self.node_selector),
            tolerations=tuple(Toleration(**t.model_dump()) for t in self.tolerations),
            affinity=Affinity.model_validate(self.affinity) if self.affinity is not None else None,
            shm_size=self.shm_size, scratch_size=self.scratch_size,
            termination_grace_seconds=self.termination_grace_seconds,
            ttl_seconds_after_finished=self.ttl_seconds_after_finished, backoff_limit=self.backoff_limit,
            active_deadline_seconds=self.active_deadline_seconds, env_from_secrets=tuple(self.env_from_secrets),
            env=dict(self.env), secret_env={k: SecretKeyRef(**v.model_dump()) for k, v in self.secret_env.items()},
            master_port=self.master_port, labels=dict(self.labels),
        )

    @staticmethod
    def missing_settings(env: dict[str, str], pod: Optional[PodConfig] = None) -> list[str]:
        """The required variables `env` lacks: the namespace, and the trainer image unless the pod configuration names one."""
        pod = pod if pod is not None else PodConfig.from_json(env.get(POD_ENV), source=POD_ENV)
        missing = [k for k in ("TRAINYARD_K8S_NAMESPACE",) if not env.get(k)]
        if not env.get("TRAINYARD_TRAINER_IMAGE") and pod.image is None:
            missing.append("TRAINYARD_TRAINER_IMAGE")
        return missing

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "KubernetesLauncher":
        """The launcher of the `cluster` environment: platform defaults from `TRAINYARD_K8S_*`, the team's pods on top.

        Platform-wide: TRAINYARD_K8S_NAMESPACE (required), TRAINYARD_TRAINER_IMAGE
        (required unless the pod configuration names an image),
        TRAINYARD_K8S_QUEUE (default 'trainyard'), TRAINYARD_K8S_PRIORITY_CLASS,
        TRAINYARD_K8S_SERVICE_ACCOUNT, TRAINYARD_K8S_SECRETS (comma-separated Secret
        names), TRAINYARD_K8S_GPUS_PER_POD; AWS_ENDPOINT_URL is passed to the pods.
        Bounds: TRAINYARD_K8S_STUCK_SECONDS (image pull errors, crash loops, refused
        pod creation; default 300), TRAINYARD_K8S_UNSCHEDULABLE_SECONDS (default
        900), TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS (the Job's activeDeadlineSeconds,
        default 7 days; 0: none), TRAINYARD_K8S_RESIZE_AFTER_SECONDS (how long a gang
        with a node range waits for a lost node before it continues smaller; default 120). TRAINYARD_K8S_GANG_KIND: jobset (default) or job.
        Then TRAINYARD_K8S_POD, a `PodConfig` as JSON (what `TeamSpec.environment`
        writes from the team's `pod`): its set fields win, its `env` is merged and
        its Secrets are added.

        Raises:
            ValueError: a required variable is missing, or one is invalid (the message names it).
        """
        pod = PodConfig.from_json(env.get(POD_ENV), source=POD_ENV)
        missing = cls.missing_settings(env, pod)
        if missing:
            raise ValueError(f"the Kubernetes launcher needs {', '.join(missing)} to be set")
        gpus = env.get("TRAINYARD_K8S_GPUS_PER_POD")
        if gpus and not gpus.isdigit():
            raise ValueError(f"TRAINYARD_K8S_GPUS_PER_POD={gpus!r} is not a number of GPUs; accepted: 0, 1, 2, ...")
        platform = PodConfig(
            image=env.get("TRAINYARD_TRAINER_IMAGE") or None,
            service_account=env.get("TRAINYARD_K8S_SERVICE_ACCOUNT") or None,
            gpus_per_pod=int(gpus) if gpus else None,
            env={"AWS_ENDPOINT_URL": env["AWS_ENDPOINT_URL"]} if env.get("AWS_ENDPOINT_URL") else {},
            env_from_secrets=tuple(s.strip() for s in env.get("TRAINYARD_K8S_SECRETS", "").split(",") if s.strip()),
        ).overlay(pod)
        fields: dict[str, Any] = platform.model_dump(exclude_unset=True, by_alias=True)
        fields.update(_bounds_from_env(env))
        kind = env.get("TRAINYARD_K8S_GANG_KIND")
        if kind:
            if kind not in ("jobset", "job"):
                raise ValueError(f"TRAINYARD_K8S_GANG_KIND={kind!r} is not a gang kind; accepted: jobset, job")
            fields["gang_kind"] = kind
        fields["env_from_secrets"] = list(fields.get("env_from_secrets", ()))
        fields["tolerations"] = [t.model_dump(exclude_none=True) for t in platform.tolerations or ()]
        fields["affinity"] = platform.affinity.to_k8s() if platform.affinity is not None else None
        return cls(
            namespace=env["TRAINYARD_K8S_NAMESPACE"],
            queue_name=env.get("TRAINYARD_K8S_QUEUE", "trainyard") or None,
            priority_class=env.get("TRAINYARD_K8S_PRIORITY_CLASS") or None,
            in_cluster=bool(env.get("KUBERNETES_SERVICE_HOST")),
            **fields,
        )

    def _api_client(self) -> k8s_client.ApiClient:
        if self.api_url is not None:
            return k8s_client.ApiClient(k8s_client.Configuration(host=self.api_url))
        if self.in_cluster:
            configuration = k8s_client.Configuration()
            k8s_config.load_incluster_config(client_configuration=configuration)
            return k8s_client.ApiClient(configuration)
        return k8s_config.new_client_from_config(config_file=self.kubeconfig, context=self.kube_context)

    def supervisor(self, api_client: k8s_client.ApiClient) -> JobSupervisor:
        return JobSupervisor(
            k8s_client.BatchV1Api(api_client), k8s_client.CoreV1Api(api_client), k8s_client.CustomObjectsApi(api_client),
            clock=time.monotonic, sleep=time.sleep, namespace=self.namespace,
            poll_interval=self.poll_interval_seconds, run_timeout=self.run_timeout_seconds,
            queue_timeout=self.queue_timeout_seconds, log_tail_lines=self.log_tail_lines,
            api_retries=self.api_retries, kueue_version=self.kueue_version,
            stuck_seconds=self.stuck_seconds, unschedulable_seconds=self.unschedulable_seconds, watch_pods=True,
            resize_after=self.resize_after_seconds,
        )

    def trial_objects(self, spec: TrainSpec, attempt: int = 0, kind: Optional[str] = None,
                      run_id: Optional[str] = None) -> list[dict[str, Any]]:
        """The objects `launch` submits for `attempt` of `spec` in Dagster run `run_id`, in creation order.

        `kind` None is `gang_kind`, what `launch` submits: "jobset" (the JobSet;
        its controller makes the child Job and the headless Service) or "job"
        (the Indexed Job, then its Service, which `launch` makes owned by the
        created Job) (`resources.k8s.manifests.trial_objects`).
        """
        return build_trial_objects(spec, join(spec.output_uri, SPEC_FILE), attempt, self.job_config(), kind or self.gang_kind, run_id)

    def launch(self, spec: TrainSpec, context: Any = None) -> LaunchOutcome:
        api_client = self._api_client()
        try:
            supervisor = self.supervisor(api_client)
            spec_uri, attempt, cfg = join(spec.output_uri, SPEC_FILE), attempt_number(context), self.job_config()
            if isinstance(context, (AssetExecutionContext, OpExecutionContext)):
                return self._run_with_pipes(supervisor, spec, spec_uri, attempt, cfg, context)
            # No Dagster step (a script, `trainyard reproduce`, a test's stand-in with a log): no Pipes session.
            return supervisor.run(spec, spec_uri, attempt, cfg, log=getattr(context, "log", logger), run_id=run_id_of(context),
                                  kind=self.gang_kind)
        finally:
            api_client.close()

    def _run_with_pipes(self, supervisor: JobSupervisor, spec: TrainSpec, spec_uri: str, attempt: int, cfg: K8sJobConfig,
                        context: Any) -> LaunchOutcome:
        """`supervisor.run` inside a Pipes session whose messages rank 0 writes under `<output>/pipes/<run id>-<attempt>`.

        The folder is this run's and attempt's: a run worker resumed by run
        monitoring (same run, same attempt) re-attaches to the same Job and
        reads the same folder; another run or attempt never reads its messages.
        """
        run_id = run_id_of(context)
        reader = PipesStoreMessageReader(join(spec.output_uri, PIPES_DIR, f"{run_id or 'no-run'}-{attempt}"))
        relay: Optional[ProgressRelay] = None
        try:
            with open_pipes_session(
                context=context, context_injector=PipesEnvContextInjector(), message_reader=reader, extras={"trial_id": spec.trial_id}
            ) as session:
                relay = ProgressRelay(context, session.get_custom_messages)
                piped = cfg.model_copy(update={"env": {**cfg.env, **session.get_bootstrap_env_vars()}})
                outcome = supervisor.run(spec, spec_uri, attempt, piped, log=context.log, run_id=run_id, tick=relay.poll,
                                         kind=self.gang_kind)
        finally:
            # Closing the session read what rank 0 wrote last, of a failed launch too.
            if relay is not None:
                relay.poll()
        outcome.progress = [m for m in session.get_custom_messages() if isinstance(m, dict)]
        return outcome
