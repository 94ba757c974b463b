"""Progress and metrics reporting from rank 0 to Dagster through Dagster Pipes.

Under Dagster the launcher sets the Pipes bootstrap environment variables and
rank 0 opens a Pipes session; every other rank, and any run without Dagster
(a bare `torchrun`, a benchmark, a reproduction), reports to the process log only.
`dagster_pipes` is the protocol package meant for external processes: it has no
dependency on Dagster itself, so the trainer image stays Dagster-free.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

log = logging.getLogger("trainyard.training")

PIPES_ENV = "DAGSTER_PIPES_CONTEXT"


class Reporter:
    """Reports progress; a no-op except for logging when not under Pipes or not rank 0."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._pipes: Optional[Any] = None
        self._stack: Optional[Any] = None

    def __enter__(self) -> "Reporter":
        if self.rank == 0 and os.environ.get(PIPES_ENV):
            from dagster_pipes import open_dagster_pipes  # needed only when launched through Dagster Pipes

            from training.pipes_store import StoreOrDefaultMessageWriter

            # A local launch passes a file to write to; a cluster launch passes a store folder.
            self._stack = open_dagster_pipes(message_writer=StoreOrDefaultMessageWriter())
            self._pipes = self._stack.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stack is not None:
            self._stack.__exit__(*exc)
            self._pipes = None
            self._stack = None

    @property
    def active(self) -> bool:
        return self._pipes is not None

    def info(self, message: str) -> None:
        if self.rank != 0:
            return
        log.info(message)
        if self._pipes is not None:
            self._pipes.log.info(message)

    def progress(self, payload: dict[str, Any]) -> None:
        """Send a structured progress record (epoch, step, metrics) to the orchestrator."""
        if self.rank != 0:
            return
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(payload.get("metrics", {}).items()))
        line = f"epoch {payload.get('epoch')} step {payload.get('step')}: {metrics}"
        log.info(line)
        if self._pipes is not None:
            self._pipes.log.info(line)
            self._pipes.report_custom_message({"type": "progress", **payload})
