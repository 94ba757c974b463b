"""Shared utilities with no dependency on any trainyard package, used by the orchestrator and the pod side alike.

The bottom layer of the import contracts (pyproject.toml's `[tool.importlinter]`):
`common` imports only the standard library and third-party packages, never
`training`, `trainyard`, `instance`, `resources`, `assets`, `pipelines` or
`featurestore`, so every layer above may use it and the trainer image carries it
as it carries `training/`.

- `common.retry`: the one retry utility (tenacity, injected sleep and clock).
- `common.atomic`: the one atomic write of a local file.
- `common.settings`: every `TRAINYARD_*` environment variable, declared once
  (docs/configuration.md is its table).
"""
