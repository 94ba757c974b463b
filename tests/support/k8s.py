"""Strict validation of Kubernetes objects (schemas bundled with kubernetes-validate) and the Pod Security Standards'
rules."""

from __future__ import annotations

import importlib.resources
import os
import re
from pathlib import Path
from typing import Any, Optional

import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.version import Version


def _schema_versions() -> list[str]:
    """Kubernetes versions whose strict schemas ship inside kubernetes-validate."""
    root = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    found = {m.group(1) for p in root.iterdir() if (m := re.match(r"^v(\d+\.\d+)\.\d+-local-strict$", p.name))}
    return sorted(found, key=Version)


NEWEST = _schema_versions()[-1]
# The oldest Kubernetes the platform supports and the newest schema available.
K8S_VERSIONS = ["1.29", NEWEST]


def k8s_validate(obj: dict[str, Any]) -> None:
    """Validate `obj` strictly (unknown fields rejected) against every version in `K8S_VERSIONS`.

    Raises:
        kubernetes_validate.ValidationError: The object does not match a schema.
        kubernetes_validate.SchemaNotFoundError: The kind is unknown; a failure too.
    """
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


CRD_DIR = Path(__file__).resolve().parents[3] / "shared" / "crds"


def _strict(schema: Any) -> Any:
    """Reject unknown fields like the API server's strict field validation does."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def load_crd_schemas(crd_dir: Path = CRD_DIR) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> strict openAPIV3Schema of every CRD in `crd_dir` (../shared/crds); skips (fails in CI)
    without it."""
    if not crd_dir.is_dir():
        message = f"CRD schemas not found at {crd_dir} (a copy of shared/crds beside the repository)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    schemas = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schemas[(f"{group}/{version['name']}", kind)] = _strict(version["schema"]["openAPIV3Schema"])
    return schemas


def crd_validate(obj: dict[str, Any], schemas: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Validate a custom resource (Kueue, JobSet) against its CRD's strict schema; an unknown kind fails."""
    key = (obj["apiVersion"], obj["kind"])
    assert key in schemas, f"no CRD schema for {key}; known: {sorted(schemas)}"
    jsonschema.Draft202012Validator(schemas[key]).validate(obj)


def validate_any(obj: dict[str, Any], schemas: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Strict validation of any object: CRD schemas for Kueue and JobSet, kubernetes-validate for the rest."""
    if obj["apiVersion"].startswith(("kueue.x-k8s.io/", "jobset.x-k8s.io/")):
        crd_validate(obj, schemas)
    else:
        k8s_validate(obj)


# -- Pod Security Standards ----------------------------------------------------------
#
# The "Baseline" and "Restricted" control tables of
# https://kubernetes.io/docs/concepts/security/pod-security-standards/, applied to a
# pod spec the way the PodSecurity admission controller does (restricted includes
# baseline). Each violation names the control and the field.

# Baseline "Capabilities": what may be added at most.
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})
# Baseline "Sysctls": the safe set.
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
})
# Baseline "SELinux": allowed types (undefined and "" too).
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# Restricted "Volume Types".
RESTRICTED_VOLUME_TYPES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
})
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def _containers(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{kind}[{c.get('name', i)}]", c) for kind in ("initContainers", "containers", "ephemeralContainers")
            for i, c in enumerate(pod.get(kind) or [])]


def _baseline(pod: dict[str, Any], annotations: dict[str, str]) -> list[str]:
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    contexts = [("spec.securityContext", psc)] + [
        (f"{w}.securityContext", c.get("securityContext") or {}) for w, c in _containers(pod)
    ]
    for where, sc in contexts:
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"HostProcess: {where}.windowsOptions.hostProcess is true")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"SELinux: {where}.seLinuxOptions={se}")
        if (sc.get("appArmorProfile") or {}).get("type", "RuntimeDefault") not in ("RuntimeDefault", "Localhost"):
            out.append(f"AppArmor: {where}.appArmorProfile={sc['appArmorProfile']}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"Seccomp: {where}.seccompProfile.type is Unconfined")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"Host Namespaces: spec.{field} is true")
    for where, c in _containers(pod):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"Privileged Containers: {where}.securityContext.privileged is true")
        extra = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if extra:
            out.append(f"Capabilities: {where} adds {sorted(extra)}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"Host Ports: {where} port {port.get('name')} has hostPort {port['hostPort']}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"/proc Mount Type: {where}.securityContext.procMount={sc['procMount']}")
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            out.append(f"HostPath Volumes: volume {volume.get('name')} is a hostPath")
    for key, value in annotations.items():
        if key.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" and not value.startswith("localhost/"):
            out.append(f"AppArmor: annotation {key}={value}")
    for sysctl in psc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"Sysctls: {sysctl.get('name')} is not in the safe set")
    return out


def _restricted(pod: dict[str, Any]) -> list[str]:
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            out.append(f"Volume Types: volume {volume.get('name')} is {sorted(kinds - RESTRICTED_VOLUME_TYPES)}")
    if psc.get("runAsUser") == 0:
        out.append("Running as Non-root user: spec.securityContext.runAsUser is 0")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    for where, c in _containers(pod):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"Privilege Escalation: {where}.securityContext.allowPrivilegeEscalation is not false")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"Running as Non-root: {where} runAsNonRoot is not true (pod or container)")
        if sc.get("runAsUser") == 0:
            out.append(f"Running as Non-root user: {where}.securityContext.runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(
                f"Seccomp: {where} seccompProfile.type is {seccomp!r} (pod or container); needs RuntimeDefault or "
                "Localhost"
            )
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"Capabilities: {where} does not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(
                f"Capabilities: {where} adds {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}; restricted allows "
                "only NET_BIND_SERVICE"
            )
    return out


def restricted_violations(pod: dict[str, Any], annotations: Optional[dict[str, str]] = None) -> list[str]:
    """What keeps pod spec `pod` (with its metadata `annotations`) from the `restricted` Pod Security level; [] if
    nothing."""
    return _baseline(pod, annotations or {}) + _restricted(pod)


def read_only_root_violations(pod: dict[str, Any], env_paths: bool = True) -> list[str]:
    """What breaks trainyard's read-only-root rule: every container's root filesystem read-only, and every
    environment variable holding an absolute path (HOME, TMPDIR, cache directories) inside a mounted writable
    emptyDir."""
    out: list[str] = []
    writable = {v["name"] for v in pod.get("volumes") or [] if "emptyDir" in v}
    for where, c in _containers(pod):
        if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True:
            out.append(f"{where}: readOnlyRootFilesystem is not true")
        mounts = [
            m["mountPath"].rstrip("/") + "/"
            for m in c.get("volumeMounts") or []
            if m["name"] in writable and not m.get("readOnly")
        ]
        paths = (
            [(f"env {e['name']}", e["value"]) for e in c.get("env") or [] if str(e.get("value", "")).startswith("/")]
            if env_paths
            else []
        )
        if c.get("workingDir"):
            paths.append(("workingDir", c["workingDir"]))
        for what, path in paths:
            if not any((path.rstrip("/") + "/").startswith(m) for m in mounts):
                out.append(f"{where}: {what}={path} is not inside a writable emptyDir mount")
    return out


def pod_specs(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """Every pod template of a workload object: (where, pod spec, pod annotations); [] for objects that run no pods."""
    kind = obj.get("kind")
    name = f"{kind}/{obj.get('metadata', {}).get('name')}"
    if kind == "Pod":
        return [(name, obj["spec"], obj["metadata"].get("annotations") or {})]
    if kind in ("Job", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "ReplicationController"):
        template = obj["spec"]["template"]
        return [(name, template["spec"], (template.get("metadata") or {}).get("annotations") or {})]
    if kind == "CronJob":
        template = obj["spec"]["jobTemplate"]["spec"]["template"]
        return [(name, template["spec"], (template.get("metadata") or {}).get("annotations") or {})]
    if kind == "JobSet":
        out = []
        for rj in obj["spec"]["replicatedJobs"]:
            template = rj["template"]["spec"]["template"]
            out.append(
                (f"{name}/{rj['name']}", template["spec"], (template.get("metadata") or {}).get("annotations") or {})
            )
        return out
    return []


# -- what the kubelet would give a container, on this machine --------------------------


def local_volumes(pod: dict[str, Any], container: dict[str, Any], root: Path) -> dict[str, Path]:
    """The container's emptyDir mounts as fresh local directories under `root`: mount path -> directory.

    Only emptyDirs (the pods' scratch space) can be emulated; any other volume fails the test.
    """
    kinds = {v["name"]: v for v in pod.get("volumes") or []}
    mounts: dict[str, Path] = {}
    for m in container.get("volumeMounts") or []:
        volume = kinds[m["name"]]
        assert "emptyDir" in volume, f"cannot emulate volume {volume}"
        local = root / m["name"]
        local.mkdir(parents=True, exist_ok=True)
        mounts[m["mountPath"]] = local
    return mounts


def remap(value: str, mounts: dict[str, Path]) -> str:
    """`value` with a leading mount path replaced by its local directory (longest mount first)."""
    for path in sorted(mounts, key=len, reverse=True):
        if value == path or value.startswith(path.rstrip("/") + "/"):
            return str(mounts[path]) + value[len(path.rstrip("/")):]
    return value


def local_env(container: dict[str, Any], mounts: dict[str, Path], field_refs: dict[str, str],
              secrets: Optional[dict[str, dict[str, str]]] = None) -> dict[str, str]:
    """The container's environment as the kubelet resolves it, paths inside mounts moved to their local directories.

    `field_refs` gives the value of each `fieldRef` path the container uses (the
    pod's annotations and labels), `secrets` the data of the Secrets it
    references (name -> key -> value); a reference not given fails the test.
    """
    env: dict[str, str] = {}
    secrets = secrets or {}
    for ref in container.get("envFrom") or []:
        name = ref["secretRef"]["name"]
        assert name in secrets, f"no data for Secret {name} (envFrom)"
        env.update(secrets[name])
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = remap(var["value"], mounts)
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["key"] in secrets.get(ref["name"], {}), (
                f"no data for Secret {ref['name']} key {ref['key']} of {var['name']}"
            )
            env[var["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in field_refs, f"no value for fieldRef {path} of {var['name']}"
            env[var["name"]] = field_refs[path]
    return env


# -- Kueue's Configuration (config.kueue.x-k8s.io/v1beta1) ------------------------------
#
# Not a CRD, so not in ../shared/crds: transcribed from the Go types that Kueue's
# manager decodes its configuration file into, with their JSON field names
# (kubernetes-sigs/kueue, apis/config/v1beta1/configuration_types.go at commit
# ff69552e79ad21652c36caa97038382e55625cf7; leaderElection from
# k8s.io/component-base/config/v1alpha1). Kueue decodes strictly: an unknown field
# stops the manager from starting, so unknown fields are rejected here too.

GO_DURATION = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"
_INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
_DURATION = {"type": "string", "pattern": GO_DURATION}
_SELECTOR = {"type": "object", "properties": {"matchLabels": {"type": "object"}, "matchExpressions": {"type": "array"}}}


def _obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "additionalProperties": False}


KUEUE_CONFIGURATION_SCHEMA: dict[str, Any] = _obj(
    apiVersion={"const": "config.kueue.x-k8s.io/v1beta1"},
    kind={"const": "Configuration"},
    namespace={"type": "string"},
    manageJobsWithoutQueueName={"type": "boolean"},
    managedJobsNamespaceSelector=_SELECTOR,
    internalCertManagement=_obj(enable={"type": "boolean"}, webhookServiceName={"type": "string"},
                                webhookSecretName={"type": "string"}),
    waitForPodsReady=_obj(
        enable={"type": "boolean"},
        timeout=_DURATION,
        blockAdmission={"type": "boolean"},
        requeuingStrategy=_obj(
            timestamp={"enum": ["Eviction", "Creation"]},
            backoffLimitCount={**_INT32, "minimum": 0},
            backoffBaseSeconds={**_INT32, "minimum": 0},
            backoffMaxSeconds={**_INT32, "minimum": 0},
        ),
        recoveryTimeout=_DURATION,
    ),
    clientConnection=_obj(qps={"type": "number"}, burst=_INT32),
    integrations=_obj(frameworks={"type": "array", "items": {"type": "string"}},
                      externalFrameworks={"type": "array", "items": {"type": "string"}},
                      podOptions={"type": "object"}, labelKeysToCopy={"type": "array", "items": {"type": "string"}}),
    queueVisibility={"type": "object"},
    multiKueue={"type": "object"},
    fairSharing={"type": "object"},
    admissionFairSharing={"type": "object"},
    resources={"type": "object"},
    featureGates={"type": "object", "additionalProperties": {"type": "boolean"}},
    objectRetentionPolicies={"type": "object"},
    # ControllerManager, inlined.
    webhook=_obj(port={"type": "integer"}, host={"type": "string"}, certDir={"type": "string"}),
    leaderElection=_obj(leaderElect={"type": "boolean"}, leaseDuration=_DURATION, renewDeadline=_DURATION,
                        retryPeriod=_DURATION, resourceLock={"type": "string"}, resourceName={"type": "string"},
                        resourceNamespace={"type": "string"}),
    metrics=_obj(bindAddress={"type": "string"}, enableClusterQueueResources={"type": "boolean"},
                 customLabels={"type": "array"}, localQueueMetrics={"type": "object"}),
    health=_obj(healthProbeBindAddress={"type": "string"}, readinessEndpointName={"type": "string"},
                livenessEndpointName={"type": "string"}),
    pprofBindAddress={"type": "string"},
    controller=_obj(groupKindConcurrency={"type": "object", "additionalProperties": {"type": "integer"}},
                    cacheSyncTimeout={"type": "integer"}),
    tls=_obj(minVersion={"type": "string"}, cipherSuites={"type": "array"}, curvePreferences={"type": "array"}),
)
KUEUE_FRAMEWORK_NAMES = frozenset(
    {
        "batch/job",
        "kubeflow.org/mpijob",
        "ray.io/rayjob",
        "ray.io/raycluster",
        "ray.io/rayservice",
        "jobset.x-k8s.io/jobset",
        "kubeflow.org/paddlejob",
        "kubeflow.org/pytorchjob",
        "kubeflow.org/tfjob",
        "kubeflow.org/xgboostjob",
        "kubeflow.org/jaxjob",
        "trainer.kubeflow.org/trainjob",
        "workload.codeflare.dev/appwrapper",
        "sparkoperator.k8s.io/sparkapplication",
        "pod",
        "deployment",
        "statefulset",
        "leaderworkerset.x-k8s.io/leaderworkerset",
    }
)


def kueue_configuration_validate(config: dict[str, Any]) -> None:
    """Validate a Kueue `Configuration` strictly against `KUEUE_CONFIGURATION_SCHEMA` and Kueue's framework names."""
    jsonschema.Draft202012Validator(KUEUE_CONFIGURATION_SCHEMA).validate(config)
    unknown = set((config.get("integrations") or {}).get("frameworks") or []) - KUEUE_FRAMEWORK_NAMES
    assert not unknown, f"integrations.frameworks names unknown to Kueue: {sorted(unknown)}"


def go_duration_seconds(text: str) -> float:
    """A Go duration string ("10m", "1h30m", "90s") in seconds."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"{text!r} is not a Go duration"
    return sum(float(n) * units[u] for n, u in parts)
