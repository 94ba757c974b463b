"""Open a Feast repository, with the registry and offline store the environment names instead of the file's."""

from __future__ import annotations

import os
from typing import Any, Optional

import yaml
from feast import FeatureStore
from feast.repo_config import RepoConfig

from featurestore.errors import RetrievalRefused


def open_store(
    repo: str,
    registry: Optional[str] = None,
    offline_store: Optional[dict[str, Any]] = None,
    project: Optional[str] = None,
) -> FeatureStore:
    """The feature store of the repository at `repo`, its `feature_store.yaml` overridden by the arguments given.

    Args:
        repo: Directory holding `feature_store.yaml`.
        registry: A registry path or URI (`sqlite:///...`, `postgresql://...`, `s3://...`) replacing the file's.
        offline_store: An offline store configuration (`{"type": "dask"}`, `{"type": "duckdb"}`...) replacing the
        file's.
        project: A project replacing the file's.

    Raises:
        RetrievalRefused: No `feature_store.yaml` in `repo`, or the configuration is not valid.
    """
    path = os.path.join(repo, "feature_store.yaml")
    if not os.path.isfile(path):
        raise RetrievalRefused(
            "repo",
            f"no feature_store.yaml in Feast repository {repo!r} (create it with `feast init`, or `make demo` for the "
            "example)",
        )
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    if registry:
        kind = "sql" if "://" in registry and not registry.startswith(("s3://", "gs://")) else "file"
        raw["registry"] = {"registry_type": kind, "path": registry, "cache_ttl_seconds": 0}
    if offline_store:
        raw["offline_store"] = offline_store
    if project:
        raw["project"] = project
    try:
        config = RepoConfig(repo_path=repo, **raw)
    except ValueError as e:
        raise RetrievalRefused("repo", f"{path}: not a valid Feast configuration: {e}") from e
    return FeatureStore(config=config)
