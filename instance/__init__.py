"""Dagster instance plugins: what `dagster.yaml` names, apart from the resources steps use.

- `run_launcher.WarmRunLauncher`: run workers forked from a warm process per code location (local).
- `run_queue.RunQueue`: Dagster's queued run coordinator, looked at more often than whole seconds allow.
- `storage_connections`: a run worker keeps its PostgreSQL connections open (the platform's executor).
- `pool_slots`: one pool slot held by one step at a time (a fix to Dagster's slot claim).

They reach into Dagster's private modules where its public API has no hook; each such import is
listed in tests/test_private_imports.py, which fails by name when an upgrade moves one.
"""
