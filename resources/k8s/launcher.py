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
from typing import Any, Literal, Mapping, Optional, Union, get_args, get_origin

from dagster import AssetExecutionContext, Config, OpExecutionContext, PipesEnvContextInjector, open_pipes_session
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from pydantic import BaseModel, Field, create_model, model_validator

from common.settings import Settings, settings
from resources.k8s.config import K8sJobConfig
from resources.k8s.manifests import trial_objects as build_trial_objects
from resources.k8s.supervisor import JobSupervisor
from resources.launcher import Launcher, LaunchOutcome, ProgressRelay, join
from resources.pipes_store import PipesStoreMessageReader
from training.spec import SPEC_FILE, TrainSpec
from trainyard.podconfig import DEFAULT_ACTIVE_DEADLINE_SECONDS, POD_ENV, PodConfig, warn_if_unpinned

__all__ = ["DEFAULT_ACTIVE_DEADLINE_SECONDS", "KubernetesLauncher", "config_of"]

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
    """The Dagster run id of a launch (labels the gang; `trainyard k8s gc` asks the instance about it), None without
    one."""
    run_id = getattr(context, "run_id", None) or getattr(getattr(context, "run", None), "run_id", None)
    return run_id if isinstance(run_id, str) and run_id else None


def _config_type(annotation: Any) -> Any:
    """The Dagster-config form of a field type of a pydantic model (Dagster takes lists, dicts and its own `Config`).

    A tuple is a list, a Literal its value type, a model written as in a manifest
    (camelCase aliases: `Affinity`) a dict, any other model a `Config` generated
    from its fields; the model itself checks the values when `job_config()` builds it.
    """
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Union:
        (inner,) = [a for a in args if a is not type(None)]
        return Optional[_config_type(inner)]
    if origin is tuple:
        return list[_config_type(args[0])]  # type: ignore[misc]
    if origin is dict:
        return dict[args[0], _config_type(args[1])]  # type: ignore[misc, valid-type]
    if origin is Literal:
        return type(args[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return dict[str, Any] if annotation.model_config.get("alias_generator") else config_of(annotation)
    return annotation


def config_of(model: type[BaseModel], base: type[Config] = Config, exclude: tuple[str, ...] = (),
              name: Optional[str] = None) -> type[Config]:
    """A Dagster `Config` (or `base`, e.g. a resource) with `model`'s fields but `exclude`: same names, defaults and
    descriptions.

    The fields are not declared again: a resource configured with them gets
    exactly the model's settings, and builds the model from them to check them.
    """
    fields: dict[str, Any] = {}
    for field_name, info in model.model_fields.items():
        if field_name in exclude:
            continue
        kind = _config_type(info.annotation)
        if info.is_required():
            default = Field(description=info.description)
        elif info.default_factory is not None or isinstance(info.default, tuple):
            if info.get_default(call_default_factory=True):
                raise TypeError(
                    f"{model.__name__}.{field_name}: only an empty collection can be a Dagster config default"
                )
            default = Field(default_factory=dict if get_origin(kind) is dict else list, description=info.description)
        else:
            default = Field(info.default, description=info.description)
        fields[field_name] = (kind, default)
    return create_model(
        name or f"{model.__name__}Config", __base__=base, __module__=__name__, __doc__=model.__doc__, **fields
    )


# The launcher's job settings: `K8sJobConfig`'s fields (the pods' `PodSettings` and the Job's own) but the
# supervisor's `avoid_nodes`, generated, never declared here.
_KubernetesLauncherSettings = config_of(
    K8sJobConfig, base=Launcher, exclude=("avoid_nodes",), name="_KubernetesLauncherSettings"
)


def _platform_pod(s: Settings, env: Mapping[str, str]) -> PodConfig:
    """The platform's pod settings (`TRAINYARD_TRAINER_IMAGE`, `TRAINYARD_K8S_*`, `AWS_ENDPOINT_URL` of `env`), under
    the team's `TRAINYARD_K8S_POD`."""
    numbers: dict[str, Any] = {}
    if s.k8s_gpus_per_pod is not None:
        numbers["gpus_per_pod"] = s.k8s_gpus_per_pod
    if s.k8s_active_deadline_seconds is not None:
        numbers["active_deadline_seconds"] = s.k8s_active_deadline_seconds or None  # a deadline of 0: none
    return PodConfig(
        image=s.trainer_image,
        service_account=s.k8s_service_account,
        env={"AWS_ENDPOINT_URL": env["AWS_ENDPOINT_URL"]} if env.get("AWS_ENDPOINT_URL") else {},
        env_from_secrets=s.k8s_secrets,
        **numbers,
    )


def _bounds(s: Settings) -> dict[str, Any]:
    """The supervisor's bounds the platform sets (`TRAINYARD_K8S_*_SECONDS`); an unset one keeps `K8sJobConfig`'s
    default."""
    bounds = {"stuck_seconds": s.k8s_stuck_seconds, "unschedulable_seconds": s.k8s_unschedulable_seconds,
              "resize_after_seconds": s.k8s_resize_after_seconds}
    return {name: value for name, value in bounds.items() if value is not None}


class KubernetesLauncher(_KubernetesLauncherSettings):  # type: ignore[misc, valid-type]
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

    gang_kind: Literal["jobset", "job"] = Field(
        "jobset",
        description="jobset (whole-gang restarts; needs the JobSet controller) or job (an Indexed Job and its Service)",
    )

    api_url: Optional[str] = Field(None, description="explicit API server URL (tests, kubectl proxy)")
    in_cluster: bool = False
    kubeconfig: Optional[str] = None
    kube_context: Optional[str] = None
    kueue_version: str = "v1beta2"
    poll_interval_seconds: float = Field(10.0, gt=0)
    run_timeout_seconds: float = Field(
        float(DEFAULT_ACTIVE_DEADLINE_SECONDS),
        gt=0,
        description="running time after admission (default: the Job's default activeDeadlineSeconds)",
    )
    queue_timeout_seconds: float = Field(86400.0, gt=0, description="time waiting for Kueue admission")
    log_tail_lines: int = Field(40, ge=1)
    stuck_seconds: float = Field(
        300.0, ge=0, description="admitted seconds an image pull error, crash loop or FailedCreate may last"
    )
    unschedulable_seconds: float = Field(900.0, ge=0, description="admitted seconds a pod may stay Unschedulable")
    resize_after_seconds: float = Field(
        120.0,
        gt=0,
        description="admitted seconds a gang with a node range waits for a lost node before it continues smaller "
        "(and for part of its capacity to return before it grows back)",
    )
    api_retries: int = Field(4, ge=0)

    @model_validator(mode="after")
    def _valid_job_config(self) -> "KubernetesLauncher":
        image = self.job_config().image  # checks every job field; a Job always has an image
        if image is not None:
            warn_if_unpinned("image", image, log=logger)
        return self

    def job_config(self) -> K8sJobConfig:
        """The job settings of this resource, checked: `K8sJobConfig` built from its fields of that name."""
        return K8sJobConfig.model_validate(self.model_dump(include=set(K8sJobConfig.model_fields)))

    @staticmethod
    def missing_settings(env: dict[str, str], pod: Optional[PodConfig] = None) -> list[str]:
        """The required variables `env` lacks: the namespace, and the trainer image unless the pod configuration names
        one."""
        s = settings(env)
        pod = pod if pod is not None else PodConfig.from_json(s.k8s_pod, source=POD_ENV)
        missing = [] if s.k8s_namespace else ["TRAINYARD_K8S_NAMESPACE"]
        if not s.trainer_image and pod.image is None:
            missing.append("TRAINYARD_TRAINER_IMAGE")
        return missing

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "KubernetesLauncher":
        """The launcher of the `cluster` environment: platform defaults from `TRAINYARD_K8S_*`, the team's pods on top.

        Platform-wide: TRAINYARD_K8S_NAMESPACE (required), TRAINYARD_TRAINER_IMAGE
        (required unless the pod configuration names an image),
        TRAINYARD_K8S_QUEUE (default 'trainyard'; empty: no Kueue), TRAINYARD_K8S_PRIORITY_CLASS,
        TRAINYARD_K8S_SERVICE_ACCOUNT, TRAINYARD_K8S_SECRETS (comma-separated Secret
        names), TRAINYARD_K8S_GPUS_PER_POD; AWS_ENDPOINT_URL is passed to the pods.
        Bounds: TRAINYARD_K8S_STUCK_SECONDS (image pull errors, crash loops, refused
        pod creation; default 300), TRAINYARD_K8S_UNSCHEDULABLE_SECONDS (default
        900), TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS (the Job's activeDeadlineSeconds,
        default 7 days; 0: none), TRAINYARD_K8S_RESIZE_AFTER_SECONDS (how long a gang
        with a node range waits for a lost node before it continues smaller; default 120). TRAINYARD_K8S_GANG_KIND:
        jobset (default) or job.
        The pod settings among these (image, service account, GPUs, the deadline,
        AWS_ENDPOINT_URL, Secrets) are a `PodConfig`; then TRAINYARD_K8S_POD, a
        `PodConfig` as JSON (what `TeamSpec.environment` writes from the team's
        `pod`), on top: its set fields win, its `env` is merged and its Secrets
        are added. Every other field keeps `K8sJobConfig`'s default.

        Raises:
            ValueError: a required variable is missing, or one is invalid (the message names it).
        """
        s = settings(env)
        pod = PodConfig.from_json(s.k8s_pod, source=POD_ENV)
        missing = cls.missing_settings(env, pod)
        if missing:
            raise ValueError(f"the Kubernetes launcher needs {', '.join(missing)} to be set")
        fields: dict[str, Any] = (
            _platform_pod(s, env).overlay(pod).model_dump(mode="json", exclude_unset=True, by_alias=True)
        )
        fields.update(_bounds(s))
        if s.k8s_gang_kind:
            fields["gang_kind"] = s.k8s_gang_kind
        fields["queue_name"] = s.k8s_queue  # default 'trainyard' (K8sJobConfig's); empty: none (no Kueue)
        return cls(
            namespace=s.k8s_namespace,
            priority_class=s.k8s_priority_class,
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
            k8s_client.BatchV1Api(api_client),
            k8s_client.CoreV1Api(api_client),
            k8s_client.CustomObjectsApi(api_client),
            clock=time.monotonic,
            sleep=time.sleep,
            namespace=self.namespace,
            poll_interval=self.poll_interval_seconds,
            run_timeout=self.run_timeout_seconds,
            queue_timeout=self.queue_timeout_seconds,
            log_tail_lines=self.log_tail_lines,
            api_retries=self.api_retries,
            kueue_version=self.kueue_version,
            stuck_seconds=self.stuck_seconds,
            unschedulable_seconds=self.unschedulable_seconds,
            watch_pods=True,
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
        return build_trial_objects(
            spec, join(spec.output_uri, SPEC_FILE), attempt, self.job_config(), kind or self.gang_kind, run_id
        )

    def launch(self, spec: TrainSpec, context: Any = None) -> LaunchOutcome:
        api_client = self._api_client()
        try:
            supervisor = self.supervisor(api_client)
            spec_uri, attempt, cfg = join(spec.output_uri, SPEC_FILE), attempt_number(context), self.job_config()
            if isinstance(context, (AssetExecutionContext, OpExecutionContext)):
                return self._run_with_pipes(supervisor, spec, spec_uri, attempt, cfg, context)
            # No Dagster step (a script, `trainyard reproduce`, a test's stand-in with a log): no Pipes session.
            return supervisor.run(
                spec,
                spec_uri,
                attempt,
                cfg,
                log=getattr(context, "log", logger),
                run_id=run_id_of(context),
                kind=self.gang_kind,
            )
        finally:
            api_client.close()

    def _run_with_pipes(
        self, supervisor: JobSupervisor, spec: TrainSpec, spec_uri: str, attempt: int, cfg: K8sJobConfig, context: Any
    ) -> LaunchOutcome:
        """`supervisor.run` inside a Pipes session whose messages rank 0 writes under `<output>/pipes/<run
        id>-<attempt>`.

        The folder is this run's and attempt's: a run worker resumed by run
        monitoring (same run, same attempt) re-attaches to the same Job and
        reads the same folder; another run or attempt never reads its messages.
        """
        run_id = run_id_of(context)
        reader = PipesStoreMessageReader(join(spec.output_uri, PIPES_DIR, f"{run_id or 'no-run'}-{attempt}"))
        relay: Optional[ProgressRelay] = None
        try:
            with open_pipes_session(
                context=context,
                context_injector=PipesEnvContextInjector(),
                message_reader=reader,
                extras={"trial_id": spec.trial_id},
            ) as session:
                relay = ProgressRelay(context, session.get_custom_messages)
                piped = cfg.model_copy(update={"env": {**cfg.env, **session.get_bootstrap_env_vars()}})
                outcome = supervisor.run(
                    spec, spec_uri, attempt, piped, log=context.log, run_id=run_id, tick=relay.poll, kind=self.gang_kind
                )
        finally:
            # Closing the session read what rank 0 wrote last, of a failed launch too.
            if relay is not None:
                relay.poll()
        outcome.progress = [m for m in session.get_custom_messages() if isinstance(m, dict)]
        return outcome
