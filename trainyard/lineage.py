"""The lineage record of a trial: what data, code, environment and settings produced it.

The same record goes to Dagster metadata, the W&B run config and the MLflow
version tags, so any registered model can be traced and rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

from trainyard.spec import PipelineSpec

PROJECT_ROOT = Path(__file__).resolve().parent.parent
LOCK_FILE = PROJECT_ROOT / "constraints.txt"


@functools.lru_cache(maxsize=1)
def code_version(root: str = str(PROJECT_ROOT)) -> tuple[str, bool]:
    """(git commit, dirty flag) of the project; ('unknown', True) outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True
    return commit, bool(status.strip())


def lock_hash(path: Path = LOCK_FILE) -> str:
    if not path.exists():
        return "unknown"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def record(spec: PipelineSpec, data_version: str, params: dict[str, Any], seed: int) -> dict[str, Any]:
    commit, dirty = code_version()
    return {
        "pipeline": spec.key,
        "pipeline_fingerprint": spec.fingerprint(),
        "data_version": data_version,
        "code_version": commit,
        "code_dirty": dirty,
        "lock_hash": lock_hash(),
        "seed": seed,
        "world_size": spec.distribution.world_size,
        "strategy": spec.distribution.strategy,
        "params": dict(params),
        "hparams": dict(spec.model.hparams),
        "model": spec.model.path,
        "max_epochs": spec.model.max_epochs,
        "batch_size": spec.model.batch_size,
    }


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out

