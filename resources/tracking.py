"""Experiment tracking settings (Weights & Biases) handed to training processes."""

from __future__ import annotations

import os
from typing import Any, Literal, Optional

from dagster import ConfigurableResource

from training.spec import TrackerSpec


class TrackingConfigError(ValueError):
    """Tracking cannot work as configured."""


class Tracking(ConfigurableResource):
    """W&B for every trial: offline files by default, online when a key is configured.

    Args:
        mode: `auto` is online when `WANDB_API_KEY` is set and offline otherwise,
            unless `WANDB_MODE` says `offline` or `disabled` (W&B's own switch).
            The key reaches training processes through their environment (a
            Secret on Kubernetes), never through the spec or the run config.
        dir: where offline runs are written (`<dir>/wandb/offline-run-*`); open them
            with `wandb sync` or browse the files directly.
        entity: W&B entity (team) for online runs.
    """

    mode: Literal["auto", "offline", "online", "disabled"] = "auto"
    dir: Optional[str] = None
    entity: Optional[str] = None

    def resolved_mode(self) -> str:
        if self.mode == "auto":
            forced = os.environ.get("WANDB_MODE", "").strip().lower()
            if forced in ("offline", "disabled"):
                return forced
            return "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if self.mode == "online" and not os.environ.get("WANDB_API_KEY"):
            raise TrackingConfigError(
                "tracking mode 'online' needs WANDB_API_KEY in the environment; use mode 'offline' or 'auto'"
            )
        return self.mode

    def tracker_spec(self, project: str, group: str, name: str, config: dict[str, Any]) -> TrackerSpec:
        mode = self.resolved_mode()
        return TrackerSpec(
            kind="none" if mode == "disabled" else "wandb",
            mode=mode,
            project=project,
            entity=self.entity,
            group=group,
            name=name,
            dir=self.dir,
            config=config,
        )
