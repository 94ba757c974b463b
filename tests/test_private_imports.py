"""Every import of a dependency's private module or name, listed: a new one fails here by name.

A private module (a dotted path with a part starting with `_`, e.g.
`dagster._core...`, `optuna.samplers._tpe`) or name (`from optuna.distributions
import _get_single_value`) can move in any release. Each one below is known and
kept for a reason docs/architecture-notes.md gives ("Private APIs we use"); an
upgrade that moves one breaks the test of the module that uses it. Adding one
means adding it here, with its reason there; removing one means removing it here.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = {"pipelines", "assets", "resources", "instance", "trainyard", "training", "common", "featurestore", "__future__"}

KNOWN: dict[str, set[str]] = {
    # Dagster: the pool-slot accounting patch of the event-log storage, the warm run worker's run body, the sweep
    # sensor's daemon-side evaluation, the run queue's and storage pool's serialized instance references.
    "instance/pool_slots.py": {
        "dagster._core.storage.event_log.schema",
        "dagster._core.storage.event_log.sql_event_log",
        "dagster._core.storage.sqlalchemy_compat",
        "dagster._utils.concurrency",
    },
    "instance/run_launcher.py": {"dagster._core.launcher.base", "dagster._serdes"},
    "instance/zygote.py": {
        "dagster._cli.api",
        "dagster._cli.api._execute_run_command_body",
        "dagster._cli.utils",
        "dagster._cli.utils._inject_local_env_file",
        "dagster._core.execution.api",
        "dagster._core.instance.ref",
        "dagster._core.origin",
        "dagster._serdes",
        "dagster._utils.hosted_user_process",
        "dagster._utils.interrupts",
    },
    "instance/run_queue.py": {"dagster._serdes"},
    "instance/storage_connections.py": {"dagster._core.execution.resources_init", "dagster._serdes"},
    "resources/sweeps/trial_runs.py": {
        "dagster._core.remote_origin",
        "dagster._core.scheduler.instigation",
        "dagster._daemon.controller",
    },
    # Optuna: the batched TPE (its Parzen estimators and trial split) and the RDB storage's batched writes.
    "resources/sweeps/acquisition.py": {
        "optuna.samplers._tpe",
        "optuna.samplers._tpe._truncnorm",
        "optuna.samplers._tpe.probability_distributions",
        "optuna.samplers._tpe.probability_distributions._BatchedCategoricalDistributions",
        "optuna.samplers._tpe.probability_distributions._unique_inverse_2d",
    },
    "resources/sweeps/batch.py": {
        "optuna.distributions._get_single_value",
        "optuna.samplers._tpe.sampler",
        "optuna.samplers._tpe.sampler._split_trials",
        "optuna.storages._cached_storage",
        "optuna.storages._cached_storage._CachedStorage",
        "optuna.storages._cached_storage._StudyInfo",
    },
    "resources/sweeps/rdb.py": {
        "optuna.storages._cached_storage",
        "optuna.storages._cached_storage._CachedStorage",
        "optuna.storages._rdb",
        "optuna.storages._rdb.storage",
        "optuna.storages._rdb.storage._create_scoped_session",
    },
    # torch: one adapter each (training.checkpointing.sharding.region_of; the exported model's symbolic shapes).
    "training/checkpointing/sharding.py": {"torch.distributed.tensor._utils"},
    "training/serving_model.py": {"torch.utils._sympy.functions"},
    # litdata: the worker environment its shard order is computed for.
    "training/streaming.py": {"litdata.utilities.env._WorkerEnv"},
}


def private_imports() -> dict[str, set[str]]:
    """Every private module or name of a dependency that our packages import, by file (imports inside functions
    included)."""
    found: dict[str, set[str]] = defaultdict(set)
    for package in sorted(OURS - {"__future__"}):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
                else:
                    continue
                for module in modules:
                    parts = module.split(".")
                    if parts[0] not in OURS and any(p.startswith("_") for p in parts):
                        found[str(path.relative_to(ROOT))].add(module)
    return dict(found)


def test_every_private_import_of_a_dependency_is_a_known_one() -> None:
    found = private_imports()
    new = {f: sorted(m - KNOWN.get(f, set())) for f, m in found.items() if m - KNOWN.get(f, set())}
    gone = {f: sorted(m - found.get(f, set())) for f, m in KNOWN.items() if m - found.get(f, set())}
    assert new == {}, f"new private imports of a dependency (use a public API, or list them here with a reason): {new}"
    assert gone == {}, f"private imports no longer made (remove them from KNOWN): {gone}"

