"""Every trial pod the launcher renders passes the `restricted` Pod Security level, on a read-only root filesystem.

The rules are those of the Pod Security Standards' Baseline and Restricted
tables (`tests.support.k8s.restricted_violations`); the first test proves that
the check fails on a pod that breaks any one of them. Pod specs come from the
manifest builders (Job and JobSet) for every shape of trial; where the
libraries in a pod write (HOME, TMPDIR, the caches of torch, W&B, matplotlib)
is resolved by those libraries themselves, in a process given the pod's
environment, and must lie inside the pod's writable emptyDirs.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from resources.k8s.config import K8sJobConfig, SecretKeyRef, Toleration
from resources.k8s.manifests import job_manifest, jobset_manifest
from tests.support.k8s import (
    load_crd_schemas,
    local_env,
    local_volumes,
    pod_specs,
    read_only_root_violations,
    remap,
    restricted_violations,
    validate_any,
)
from tests.support.train_specs import make_spec
from training.spec import Distribution, TrainSpec

SPEC_URI = "s3://bucket/runs/vision/digits/trial-0000/spec.json"
IMAGE = "registry.example/trainyard/trainer@sha256:" + "ab" * 32
SHAPES = {
    "cpu, one node": Distribution(),
    "cpu, three nodes": Distribution(nodes=3, procs_per_node=2),
    "gpu, two nodes": Distribution(nodes=2, procs_per_node=4, accelerator="gpu"),
}
CONFIGS = {
    "minimal": dict(namespace="vision", image=IMAGE),
    "no /dev/shm": dict(namespace="vision", image=IMAGE, shm_size=None, queue_name=None),
    "everything": dict(
        namespace="vision",
        image=IMAGE,
        queue_name="trainyard",
        priority_class="trainyard-sweep",
        service_account="trainyard-trial",
        cpu="16",
        memory="96Gi",
        cpu_limit="32",
        memory_limit="128Gi",
        node_selector={"trainyard.io/pool": "gpu"},
        tolerations=(Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),),
        affinity={
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 50,
                        "podAffinityTerm": {
                            "labelSelector": {
                                "matchExpressions": [{"key": "trainyard.io/trial", "operator": "Exists"}]
                            },
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            }
        },
        shm_size="16Gi",
        scratch_size="100Gi",
        env={"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN"},
        secret_env={"HF_TOKEN": SecretKeyRef(secret="hf", key="token")},
        env_from_secrets=("trainyard-storage",),
    ),
}


@pytest.fixture(scope="module")
def specs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainSpec]:
    return {name: make_spec(tmp_path_factory.mktemp("spec"), distribution=d) for name, d in SHAPES.items()}


def rendered(specs: dict[str, TrainSpec]) -> list[dict[str, Any]]:
    out = []
    for spec in specs.values():
        for over in CONFIGS.values():
            cfg = K8sJobConfig(**over)
            out += [job_manifest(spec, SPEC_URI, 0, cfg), jobset_manifest(spec, SPEC_URI, 1, cfg)]
    return out


def good_pod(specs: dict[str, TrainSpec]) -> dict[str, Any]:
    job = job_manifest(specs["gpu, two nodes"], SPEC_URI, 0, K8sJobConfig(**CONFIGS["everything"]))
    return copy.deepcopy(job["spec"]["template"]["spec"])


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["containers"][0]


def _sc(pod: dict[str, Any]) -> dict[str, Any]:
    return _container(pod)["securityContext"]


# One mutation per control of the Baseline and Restricted tables, and the control's name in the message.
BREAKS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "hostProcess": (lambda p: _sc(p).update(windowsOptions={"hostProcess": True}), "HostProcess"),
    "hostNetwork": (lambda p: p.update(hostNetwork=True), "Host Namespaces"),
    "hostPID": (lambda p: p.update(hostPID=True), "Host Namespaces"),
    "hostIPC": (lambda p: p.update(hostIPC=True), "Host Namespaces"),
    "privileged": (lambda p: _sc(p).update(privileged=True), "Privileged Containers"),
    "baseline capability": (lambda p: _sc(p)["capabilities"].update(add=["SYS_ADMIN"]), "Capabilities"),
    "hostPath": (lambda p: p["volumes"].append({"name": "host", "hostPath": {"path": "/var/run"}}), "HostPath Volumes"),
    "hostPort": (lambda p: _container(p)["ports"][0].update(hostPort=29500), "Host Ports"),
    "AppArmor field": (lambda p: _sc(p).update(appArmorProfile={"type": "Unconfined"}), "AppArmor"),
    "SELinux type": (lambda p: p["securityContext"].update(seLinuxOptions={"type": "spc_t"}), "SELinux"),
    "SELinux user": (lambda p: _sc(p).update(seLinuxOptions={"user": "system_u"}), "SELinux"),
    "procMount": (lambda p: _sc(p).update(procMount="Unmasked"), "/proc Mount Type"),
    "seccomp unconfined": (lambda p: _sc(p).update(seccompProfile={"type": "Unconfined"}), "Seccomp"),
    "seccomp unset": (lambda p: p["securityContext"].pop("seccompProfile"), "Seccomp"),
    "unsafe sysctl": (
        lambda p: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
        "Sysctls",
    ),
    "volume type": (
        lambda p: p["volumes"].append({"name": "nfs", "nfs": {"server": "x", "path": "/"}}),
        "Volume Types",
    ),
    "privilege escalation": (lambda p: _sc(p).pop("allowPrivilegeEscalation"), "Privilege Escalation"),
    "runAsNonRoot unset": (
        lambda p: (p["securityContext"].pop("runAsNonRoot"), _sc(p).pop("runAsNonRoot")),
        "Running as Non-root",
    ),
    "runAsNonRoot false": (lambda p: _sc(p).update(runAsNonRoot=False), "Running as Non-root"),
    "root user": (lambda p: p["securityContext"].update(runAsUser=0), "Running as Non-root user"),
    "capabilities kept": (lambda p: _sc(p).pop("capabilities"), "Capabilities: containers[trainer] does not drop ALL"),
    "capability added": (
        lambda p: _sc(p)["capabilities"].update(add=["CHOWN"]),
        "restricted allows only NET_BIND_SERVICE",
    ),
    "init container": (lambda p: p.update(initContainers=[{"name": "setup", "image": IMAGE}]), "initContainers[setup]"),
}


@pytest.mark.parametrize("control", sorted(BREAKS))
def test_the_check_fails_on_a_pod_breaking_any_control(specs: dict[str, TrainSpec], control: str) -> None:
    pod = good_pod(specs)
    assert restricted_violations(pod) == []
    mutate, fragment = BREAKS[control]
    mutate(pod)
    found = restricted_violations(pod)
    assert any(fragment in v for v in found), found


def test_the_check_reads_apparmor_annotations(specs: dict[str, TrainSpec]) -> None:
    pod = good_pod(specs)
    assert (
        restricted_violations(pod, {"container.apparmor.security.beta.kubernetes.io/trainer": "runtime/default"}) == []
    )
    assert restricted_violations(pod, {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"})


def test_the_read_only_root_check_fails_on_a_writable_root_or_a_path_outside_the_mounts(
    specs: dict[str, TrainSpec],
) -> None:
    pod = good_pod(specs)
    assert read_only_root_violations(pod) == []
    writable = copy.deepcopy(pod)
    _sc(writable)["readOnlyRootFilesystem"] = False
    assert read_only_root_violations(writable) == ["containers[trainer]: readOnlyRootFilesystem is not true"]
    stray = copy.deepcopy(pod)
    _container(stray)["env"].append({"name": "MY_CACHE", "value": "/opt/cache"})
    assert read_only_root_violations(stray) == [
        "containers[trainer]: env MY_CACHE=/opt/cache is not inside a writable emptyDir mount"
    ]
    unmounted = copy.deepcopy(pod)
    _container(unmounted)["volumeMounts"] = [
        m for m in _container(unmounted)["volumeMounts"] if m["mountPath"] != "/tmp"
    ]
    assert read_only_root_violations(unmounted) == [
        "containers[trainer]: env TMPDIR=/tmp is not inside a writable emptyDir mount"
    ]


def test_every_rendered_pod_is_restricted_with_a_read_only_root(specs: dict[str, TrainSpec]) -> None:
    objects = rendered(specs)
    pods = [p for obj in objects for p in pod_specs(obj)]
    assert len(pods) == len(objects) == 2 * len(SHAPES) * len(CONFIGS)
    for where, pod, pod_annotations in pods:
        assert restricted_violations(pod, pod_annotations) == [], where
        assert read_only_root_violations(pod) == [], where
        assert pod["automountServiceAccountToken"] is False, where
    schemas = load_crd_schemas()
    for obj in objects:
        validate_any(obj, schemas)


PROBE = """
import json, os, tempfile
import matplotlib, torch.hub, wandb.env
from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir
print(json.dumps({k: str(v) for k, v in {
    "HOME": os.path.expanduser("~"),
    "tempfile": tempfile.gettempdir(),
    "working directory (Lightning's default_root_dir)": os.getcwd(),
    "torch inductor cache": cache_dir(),
    "triton cache": triton_cache_dir(0),
    "torch hub": torch.hub.get_dir(),
    "matplotlib config": matplotlib.get_configdir(),
    "matplotlib cache": matplotlib.get_cachedir(),
    "wandb dir": wandb.env.get_dir(),
    "wandb cache": wandb.env.get_cache_dir(),
    "wandb data": wandb.env.get_data_dir(),
    "wandb artifacts": os.path.abspath(wandb.env.get_artifact_dir()),
}.items()}))
"""


@pytest.mark.slow
def test_libraries_in_the_pod_write_only_into_its_emptydirs(specs: dict[str, TrainSpec], tmp_path: Path) -> None:
    """Where torch, W&B and matplotlib would write, asked of them in a process with the pod's environment."""
    pod = good_pod(specs)
    container = _container(pod)
    mounts = local_volumes(pod, container, tmp_path / "volumes")
    env = local_env(container, mounts, {
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0",
        "metadata.labels['batch.kubernetes.io/job-name']": "job",
        "spec.nodeName": "node-0",  # set by the scheduler
    }, secrets={"hf": {"token": "hf-test"}, "trainyard-storage": {"AWS_ACCESS_KEY_ID": "test"}})
    cwd = Path(remap(container["workingDir"], mounts))
    # Only what the image's ENV would add: nothing of this machine's HOME or caches leaks in.
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    places = json.loads(out.stdout.strip().splitlines()[-1])
    writable = [str(d) + "/" for path, d in mounts.items() if path != "/dev/shm"]
    for what, place in places.items():
        assert any((place.rstrip("/") + "/").startswith(w) for w in writable), (
            f"{what} writes to {place}, outside {writable}"
        )
