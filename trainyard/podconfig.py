"""A trial pod's settings, declared once: image, resources, placement, /dev/shm, deadlines, environment, service
account.

`PodSettings` declares every setting of a trial's pods once (name, type,
default, check, docstring). Everything else is built on it:

- `PodConfig`, the `pod` field of `TeamSpec`: the same fields, of which a team
  sets what its trial pods need beyond the platform's defaults (a GPU node pool's
  tolerations and node selector, more CPU and memory, NCCL settings, a bigger
  /dev/shm); an unset field keeps the platform's value (`KubernetesLauncher`,
  itself configured from `TRAINYARD_K8S_*` variables).
- `resources.k8s.config.K8sJobConfig`, what the manifests are built from:
  `PodSettings` and the Job's own settings (namespace, queue, labels, ...).
- `resources.k8s.launcher.KubernetesLauncher`, the Dagster resource: its
  configuration is generated from `K8sJobConfig`'s fields, not re-declared.

Values are checked when the team module is imported, with messages naming the
field, the value and what would be accepted. The same checks (Kubernetes names,
quantities, label keys, environment names, image references) serve the Job's
own fields in `K8sJobConfig`, which imports them from here.

Credentials never appear as values: `env` refuses names that look like
credentials and values holding URL passwords; a Secret reaches a pod by name,
whole (`env_from_secrets`) or one key per variable (`secret_env`).

Example:
    >>> PodConfig(cpu="16", memory="96Gi", shm_size="16Gi",
    ...           node_selector={"pool": "a100"},
    ...           tolerations=[Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")],
    ...           env={"NCCL_SOCKET_IFNAME": "eth0"}).cpu
    '16'
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from typing import Any, Literal, Optional
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from training.spec import LAUNCH_ID_ENV

POD_ENV = "TRAINYARD_K8S_POD"
"""The environment variable that carries a `PodConfig` as JSON to the launcher (`TeamSpec.environment`)."""

TRAINER_UID = 10001
"""The trainer image's user (deploy/docker/trainer.Dockerfile); pods run as it, never as root."""
TRAINER_HOME = "/home/trainer"
"""HOME of `TRAINER_UID`: a writable emptyDir in every pod (the root filesystem is read-only)."""
SCRATCH_DIR = "/tmp"

# Every place a library in the pod writes to, pointed into the two writable
# emptyDirs (HOME and /tmp): the root filesystem is read-only.
WRITABLE_ENV: dict[str, str] = {
    "HOME": TRAINER_HOME,
    "TMPDIR": SCRATCH_DIR,
    "XDG_CACHE_HOME": f"{TRAINER_HOME}/.cache",
    "XDG_CONFIG_HOME": f"{TRAINER_HOME}/.config",
    "TORCHINDUCTOR_CACHE_DIR": f"{TRAINER_HOME}/.cache/torchinductor",
    "TRITON_CACHE_DIR": f"{TRAINER_HOME}/.cache/triton",
    "MPLCONFIGDIR": f"{TRAINER_HOME}/.config/matplotlib",
    "WANDB_DIR": f"{TRAINER_HOME}/wandb",
    "WANDB_CACHE_DIR": f"{TRAINER_HOME}/.cache/wandb",
    "WANDB_CONFIG_DIR": f"{TRAINER_HOME}/.config/wandb",
}
# Set by the platform in every trial pod; a team cannot override them.
RESERVED_ENV = ("JOB_COMPLETION_INDEX", "PYTHONUNBUFFERED", LAUNCH_ID_ENV, *WRITABLE_ENV)

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_QUANTITY = re.compile(r"^(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE]\d+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# Names that look like credentials: these must come from a Secret, never a literal.
_CREDENTIAL_NAME = re.compile(r"(?i)(secret|token|passw|credential|api_?key|access_?key|private_?key)")
# An image reference (the distribution/reference grammar): [domain[:port]/]path[:tag][@digest].
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE = re.compile(
    r"^(?P<name>(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]+)?/)?"
    rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>\S+))?$"
)
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")

logger = logging.getLogger("trainyard.pods")


class UnpinnedImageWarning(UserWarning):
    """An image named by tag, not by digest: what runs can change under the same name."""


def check_dns_subdomain(field: str, value: str) -> str:
    """`value` if it is a valid Kubernetes object name (DNS-1123 subdomain); else a ValueError naming `field`."""
    if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        raise ValueError(
            f"{field}={value!r} is not a valid Kubernetes name; accepted: lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit, at most 253 characters"
        )
    return value


def check_quantity(field: str, value: Optional[str]) -> Optional[str]:
    """`value` if it is None or a Kubernetes quantity ('500m', '16Gi'); else a ValueError naming `field`."""
    if value is not None and not _QUANTITY.match(value):
        raise ValueError(f"{field}={value!r} is not a Kubernetes quantity; accepted e.g. '500m', '2', '16Gi', '1.5'")
    return value


def check_labels(field: str, labels: dict[str, str]) -> dict[str, str]:
    """`labels` if every key is a label key and every value a label value; else a ValueError naming `field`."""
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (prefix and not _DNS_SUBDOMAIN.match(prefix)) or len(name) > 63 or not _LABEL_NAME.match(name):
            raise ValueError(f"{field} key {key!r} is not a label key; accepted: '[prefix/]name', name <= 63 chars")
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            raise ValueError(f"{field}[{key!r}]={value!r} is not a label value; accepted: <= 63 of [A-Za-z0-9_.-]")
    return labels


def _holds_password(value: str) -> bool:
    """Whether `value` is a URL with a password (`scheme://user:pw@host`) or a `password=` query parameter."""
    if re.search(r"(?i)[?&;](password|passwd|pwd)=", value):
        return True
    try:
        return "://" in value and urlsplit(value.strip()).password is not None
    except ValueError:
        return False


def check_env_name(field: str, name: str) -> str:
    """`name` if a pod may get it as a plain variable; else a ValueError naming `field` and the rule."""
    if not _ENV_NAME.match(name):
        raise ValueError(
            f"{field} name {name!r} is invalid; accepted: letters, digits and '_', not starting with a digit"
        )
    if name in RESERVED_ENV:
        raise ValueError(f"{field}[{name!r}] is set by the platform; accepted: any name but {list(RESERVED_ENV)}")
    return name


def check_env(field: str, env: dict[str, str]) -> dict[str, str]:
    """`env` if it holds only plain, non-secret settings (e.g. NCCL_*); else a ValueError naming the variable."""
    for name, value in env.items():
        check_env_name(field, name)
        if _CREDENTIAL_NAME.search(name):
            raise ValueError(
                f"{field}[{name!r}] looks like a credential; credentials reach pods only through a Secret: "
                "put it in a Secret and list the Secret's name in env_from_secrets (or map the variable in secret_env)"
            )
        if _holds_password(value):
            raise ValueError(
                f"{field}[{name!r}] holds a URL with credentials; accepted: the URL without user:password@, "
                "the credentials in a Secret (env_from_secrets or secret_env)"
            )
    return env


def check_image(field: str, value: str) -> str:
    """`value` if it is an image reference whose digest, if any, is `sha256:<64 hex>`; else a ValueError naming
    `field`."""
    match = _IMAGE.match(value) if value else None
    if match is None:
        raise ValueError(
            f"{field}={value!r} is not an image reference; accepted e.g. "
            "'registry.example/trainer@sha256:<64 hex digits>' (pinned) or 'registry.example/trainer:1.4.0'"
        )
    digest = match.group("digest")
    if digest is not None and not _DIGEST.match(digest):
        raise ValueError(
            f"{field}={value!r} has digest {digest!r}; accepted: 'sha256:' followed by 64 lowercase hex digits"
        )
    return value


def image_is_pinned(value: str) -> bool:
    """Whether image reference `value` names its content by digest (`...@sha256:<64 hex>`)."""
    match = _IMAGE.match(value)
    return bool(match and match.group("digest") and _DIGEST.match(match.group("digest")))


def warn_if_unpinned(field: str, value: str, *, log: Optional[logging.Logger] = None) -> bool:
    """Warn (an `UnpinnedImageWarning` and a log line) when `value` is not pinned by digest; True if it is pinned."""
    if image_is_pinned(value):
        return True
    message = (
        f"{field}={value!r} is not pinned by digest: a tag can be moved to other content, so a retried or "
        "re-attached trial may run different code; use '<repository>@sha256:<digest>' (docs/kubernetes.md, 'Build, "
        "push and pin')"
    )
    warnings.warn(message, UnpinnedImageWarning, stacklevel=2)
    (log or logger).warning(message)
    return False


class _Frozen(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, hide_input_in_errors=True
    )  # env values are refused when they hold credentials


class Toleration(_Frozen):
    """A pod toleration (e.g. for a tainted GPU node pool)."""

    key: Optional[str] = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: Optional[str] = None
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = None
    toleration_seconds: Optional[int] = Field(None, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> "Toleration":
        if self.operator == "Exists" and self.value is not None:
            raise ValueError(f"toleration value={self.value!r} with operator 'Exists'; accepted: no value")
        if self.operator == "Equal" and self.key is None:
            raise ValueError("toleration with operator 'Equal' needs a key; accepted: a key, or operator 'Exists'")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(f"toleration_seconds with effect={self.effect!r}; accepted only with effect 'NoExecute'")
        return self

    def to_k8s(self) -> dict[str, Any]:
        out: dict[str, Any] = {"operator": self.operator}
        if self.key is not None:
            out["key"] = self.key
        if self.value is not None:
            out["value"] = self.value
        if self.effect is not None:
            out["effect"] = self.effect
        if self.toleration_seconds is not None:
            out["tolerationSeconds"] = self.toleration_seconds
        return out


class SecretKeyRef(_Frozen):
    """One key of a Secret in the pod's namespace, as one environment variable (`secretKeyRef`)."""

    secret: str
    key: str

    @field_validator("secret")
    @classmethod
    def _secret(cls, v: str) -> str:
        return check_dns_subdomain("secret", v)

    @field_validator("key")
    @classmethod
    def _key(cls, v: str) -> str:
        if len(v) > 253 or not _SECRET_KEY.match(v):
            raise ValueError(f"key={v!r} is not a Secret key; accepted: letters, digits, '-', '_' and '.'")
        return v

    def to_k8s(self, name: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": self.secret, "key": self.key}}}


# -- affinity: the Kubernetes structure (camelCase, as in a manifest), checked field by field --


class _K8s(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class _Requirement(_K8s):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: Optional[tuple[str, ...]] = None

    @model_validator(mode="after")
    def _values(self) -> "_Requirement":
        n = len(self.values or ())
        if self.operator in ("In", "NotIn") and n == 0:
            raise ValueError(
                f"operator {self.operator!r} on key {self.key!r} needs values; accepted: one or more values"
            )
        if self.operator in ("Exists", "DoesNotExist") and n:
            raise ValueError(f"operator {self.operator!r} on key {self.key!r} takes no values; accepted: no 'values'")
        if self.operator in ("Gt", "Lt") and (
            self.values is None or n != 1 or not self.values[0].lstrip("-").isdigit()
        ):
            raise ValueError(f"operator {self.operator!r} on key {self.key!r} needs exactly one integer value")
        return self


class _LabelRequirement(_Requirement):
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]


class _NodeSelectorTerm(_K8s):
    match_expressions: Optional[tuple[_Requirement, ...]] = None
    match_fields: Optional[tuple[_Requirement, ...]] = None


class _NodeSelector(_K8s):
    node_selector_terms: tuple[_NodeSelectorTerm, ...] = Field(min_length=1)


class _PreferredNode(_K8s):
    weight: int = Field(ge=1, le=100)
    preference: _NodeSelectorTerm


class _NodeAffinity(_K8s):
    required_during_scheduling_ignored_during_execution: Optional[_NodeSelector] = None
    preferred_during_scheduling_ignored_during_execution: Optional[tuple[_PreferredNode, ...]] = None


class _LabelSelector(_K8s):
    match_labels: Optional[dict[str, str]] = None
    match_expressions: Optional[tuple[_LabelRequirement, ...]] = None


class _PodAffinityTerm(_K8s):
    label_selector: Optional[_LabelSelector] = None
    namespace_selector: Optional[_LabelSelector] = None
    namespaces: Optional[tuple[str, ...]] = None
    topology_key: str = Field(min_length=1)
    match_label_keys: Optional[tuple[str, ...]] = None
    mismatch_label_keys: Optional[tuple[str, ...]] = None


class _PreferredPod(_K8s):
    weight: int = Field(ge=1, le=100)
    pod_affinity_term: _PodAffinityTerm


class _PodAffinity(_K8s):
    required_during_scheduling_ignored_during_execution: Optional[tuple[_PodAffinityTerm, ...]] = None
    preferred_during_scheduling_ignored_during_execution: Optional[tuple[_PreferredPod, ...]] = None


class Affinity(_K8s):
    """A pod's `affinity`, written as in a manifest (`nodeAffinity`, `podAffinity`, `podAntiAffinity`).

    Example:
        >>> Affinity.model_validate({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        ...     "nodeSelectorTerms": [{"matchExpressions": [
        ...         {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]}]}}}
        ... ).to_k8s()["nodeAffinity"].keys()
        dict_keys(['requiredDuringSchedulingIgnoredDuringExecution'])
    """

    node_affinity: Optional[_NodeAffinity] = None
    pod_affinity: Optional[_PodAffinity] = None
    pod_anti_affinity: Optional[_PodAffinity] = None

    def to_k8s(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# -- a trial pod's settings: each declared once, here --

DEFAULT_ACTIVE_DEADLINE_SECONDS = 7 * 86400
"""A trial's Job may run this long once admitted (`activeDeadlineSeconds`), the launcher's run timeout too."""

_MERGED = ("env", "secret_env", "env_from_secrets")  # merged by `PodConfig.overlay`; every other field is replaced


class PodSettings(BaseModel):
    """The settings of a trial's pods, each declared once here with its platform default.

    The one declaration: the team's `PodConfig` is these fields (only the set ones
    count), the manifests' `resources.k8s.config.K8sJobConfig` adds the Job's own
    settings to them, and the `KubernetesLauncher` resource's configuration is
    generated from that (`resources.k8s.launcher`). Each field's docstring is its
    description (also in the resource's Dagster config schema).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True, use_attribute_docstrings=True)

    image: Optional[str] = None
    """The trainer image (torch, lightning, `training/`, team model code; no Dagster), by digest
    (`<repository>@sha256:<64 hex>`); a tag is accepted with a warning. A Job needs one: the team's, else
    TRAINYARD_TRAINER_IMAGE."""
    service_account: Optional[str] = None
    """The pods' service account, one per team namespace (`trainyard-trial`); they need no API access and get no
    token."""
    gpus_per_pod: Optional[int] = Field(None, ge=0)
    """GPUs each pod requests; None derives it from the trial (`procs_per_node` on GPU, 0 on CPU); when set it must
    agree."""
    cpu: str = "2"
    """CPU request per pod."""
    memory: str = "8Gi"
    """Memory request per pod."""
    cpu_limit: Optional[str] = None
    """CPU limit per pod; None: no CPU limit."""
    memory_limit: Optional[str] = None
    """Memory limit per pod; None: equal to the request."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Placement: node labels the pods must land on (e.g. a GPU node pool)."""
    tolerations: tuple[Toleration, ...] = ()
    """Placement: taints the pods tolerate (e.g. a tainted GPU node pool)."""
    affinity: Optional[Affinity] = None
    """Placement: the pods' affinity, written as in a manifest (`nodeAffinity`, `podAffinity`, `podAntiAffinity`)."""
    shm_size: Optional[str] = "2Gi"
    """Size of the in-memory /dev/shm (an emptyDir of medium Memory; DataLoader workers share batches through it,
    and the container default of 64 MiB breaks them); None: no volume."""
    scratch_size: Optional[str] = None
    """Size limit of each writable scratch emptyDir (HOME and /tmp; the root filesystem is read-only); None: bounded
    by the node only."""
    termination_grace_seconds: int = Field(120, ge=1)
    """SIGTERM-to-SIGKILL time; long enough to write the preemption checkpoint."""
    active_deadline_seconds: Optional[int] = Field(DEFAULT_ACTIVE_DEADLINE_SECONDS, gt=0)
    """The (child) Job's `activeDeadlineSeconds`: how long it may run once admitted (its timer starts when Kueue
    unsuspends it), enforced by the Job controller even when no orchestrator watches the gang; default 7 days, the
    launcher's run timeout; None: no deadline."""
    env: dict[str, str] = Field(default_factory=dict)
    """Plain, non-secret settings (e.g. `AWS_ENDPOINT_URL`, `NCCL_SOCKET_IFNAME`); names that look like credentials
    and URLs with passwords are refused."""
    secret_env: dict[str, SecretKeyRef] = Field(default_factory=dict)
    """Variables taken from one key of a Secret (`secretKeyRef`)."""
    env_from_secrets: tuple[str, ...] = ()
    """Secrets whose keys all become variables (`envFrom`); with `secret_env` the only way credentials reach pods."""

    @field_validator("image")
    @classmethod
    def _image(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else check_image("image", v)

    @field_validator("service_account")
    @classmethod
    def _service_account(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else check_dns_subdomain("service_account", v)

    @field_validator("cpu", "memory", "cpu_limit", "memory_limit", "shm_size", "scratch_size")
    @classmethod
    def _quantities(cls, v: Optional[str], info: Any) -> Optional[str]:
        return check_quantity(info.field_name, v)

    @field_validator("node_selector")
    @classmethod
    def _node_selector(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels("node_selector", v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env("env", v)

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, v: dict[str, SecretKeyRef]) -> dict[str, SecretKeyRef]:
        for name in v:
            check_env_name("secret_env", name)
        return v

    @field_validator("env_from_secrets")
    @classmethod
    def _secrets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            check_dns_subdomain("env_from_secrets[]", name)
        return v

    @model_validator(mode="after")
    def _one_source_per_variable(self) -> "PodSettings":
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"env and secret_env both set {both}; accepted: each variable from one place")
        return self


class PodConfig(PodSettings):
    """What a team's trial pods need beyond the platform's defaults: the `PodSettings` it sets.

    The fields, their defaults and checks are `PodSettings`'; only the fields set
    here count (`model_fields_set`): an unset field keeps the platform's value
    (`KubernetesLauncher`, configured from `TRAINYARD_K8S_*` and the location's
    `TRAINYARD_K8S_POD`), and a set one wins over it, except `env` and `secret_env`,
    which merge with the platform's, and `env_from_secrets`, which adds to them.
    """

    def overlay(self, top: "PodConfig") -> "PodConfig":
        """This configuration with `top`'s on top: `top`'s set fields win, `env` and `secret_env` merge, Secrets add
        up."""
        replaced = [k for k in PodSettings.model_fields if k not in _MERGED]
        fields: dict[str, Any] = {k: getattr(self, k) for k in replaced if k in self.model_fields_set}
        fields.update({k: getattr(top, k) for k in replaced if k in top.model_fields_set})
        env = {**self.env, **top.env}
        secret_env = {**self.secret_env, **top.secret_env}
        for name in top.env:
            secret_env.pop(name, None)
        for name in top.secret_env:
            env.pop(name, None)
        if env:
            fields["env"] = env
        if secret_env:
            fields["secret_env"] = secret_env
        secrets = tuple(dict.fromkeys((*self.env_from_secrets, *top.env_from_secrets)))
        if secrets:
            fields["env_from_secrets"] = secrets
        return PodConfig(**fields)

    def to_json(self) -> str:
        """The set fields as JSON (`POD_ENV`'s value), a set one equal to its default too; `from_json` reads it back."""
        return self.model_dump_json(exclude_unset=True, by_alias=True)

    @classmethod
    def from_json(cls, text: Optional[str], *, source: str = POD_ENV) -> "PodConfig":
        """The configuration in `text` (empty or None: nothing set); a ValueError naming `source` and the field
        otherwise."""
        if not text or not text.strip():
            return cls()
        try:
            return cls.model_validate(json.loads(text))
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{source} is not JSON ({err.msg} at character {err.pos}); accepted: a JSON object of PodConfig fields"
            ) from None
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}" for e in err.errors()
            )
            raise ValueError(f"{source} is not a valid pod configuration: {problems}") from None
