"""The Job manifest's own command trains a 2-node DDP gang, one torchrun agent per "node".

No cluster runs here, so this test does what the kubelet would do with the
manifest of a 2-node x 1-process trial, once per completion index:

- expands `$(VAR)` references in the container command from the container's env,
  where JOB_COMPLETION_INDEX (a fieldRef to the completion-index annotation in the
  manifest) is the node's index, as Kubernetes does;
- gives each pod its emptyDirs as fresh local directories, at which the
  variables naming paths inside them (HOME, TMPDIR, caches) and the working
  directory point, so the pod writes only there, as on its read-only root;
- sets PYTHONPATH to this checkout, as the trainer image's ENV does for its copy;
- replaces the master address `<job>-0.<job>` (rank 0's name through the headless
  Service, which only cluster DNS resolves) by 127.0.0.1, the one substitution
  that is not Kubernetes behaviour;
- replaces the `python` of the image by this virtualenv's interpreter.

Everything else (torchrun flags, node rank, port, entrypoint, spec URI) is taken
verbatim from the manifest, so the test fails if the manifest's command could not
form a gang.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from resources.k8s.config import K8sJobConfig
from resources.k8s.manifests import job_manifest
from resources.k8s.names import COMPLETION_INDEX_ANNOTATION
from tests.support.k8s import local_env, local_volumes, remap
from tests.support.train_specs import make_spec
from training.spec import Distribution, TrainResult

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_process_args(pod: dict, index: int, name: str, root: Path) -> tuple[list[str], dict[str, str], Path]:
    """The command, environment and working directory the kubelet would start for completion index `index`."""
    container = pod["containers"][0]
    mounts = local_volumes(pod, container, root / f"pod-{index}")
    env = local_env(container, mounts, {
        # The Job controller labels each pod with its Job's name and annotates its index.
        "metadata.labels['batch.kubernetes.io/job-name']": name,
        f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']": str(index),
        "spec.nodeName": f"node-{index}",  # set by the scheduler
    })
    env["PYTHONPATH"] = str(ROOT)
    command = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container["command"]]
    master = f"--master-addr={name}-0.{name}"
    assert master in command, command
    command = [("--master-addr=127.0.0.1" if arg == master else arg) for arg in command]
    assert command[0] == "python"
    return [sys.executable, *command[1:]], env, Path(remap(container["workingDir"], mounts))


@pytest.mark.slow
def test_manifest_command_trains_two_nodes(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, distribution=Distribution(nodes=2, procs_per_node=1))
    spec_uri = str(tmp_path / "spec.json")
    cfg = K8sJobConfig(namespace="vision", image="trainer:1", queue_name="trainyard", master_port=free_port())
    job = job_manifest(spec, spec_uri, 0, cfg)
    name = job["metadata"]["name"]
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2

    procs = []
    try:
        for index in range(2):
            command, pod_env, cwd = node_process_args(pod, index, name, tmp_path / "volumes")
            assert f"--node-rank={index}" in command
            env = {**os.environ, **pod_env, "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen(
                command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,
            ))
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for index, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {index} exited {p.returncode}:\n{out[-4000:]}"
    result = TrainResult.model_validate_json(Path(spec.output_uri, "result.json").read_text())
    assert result.world_size == 2
    assert result.train_samples == 2 * 210  # 70% of 300 rows, two epochs, split across both ranks
