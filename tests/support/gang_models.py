"""Model code that fails on one rank only, as a bug or a misfit setting in a team's model would.

Imported by the training processes of `tests/training/test_gang.py` (the spec's
`ModelSpec.path` names these classes), so it imports only what model code may.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from pipelines.vision.models import DigitsMLP
from training.errors import ConfigError


class _FailsOnRank(DigitsMLP):
    """`DigitsMLP` that raises at training step `at_step` on rank `rank`; the other ranks train on."""

    def __init__(
        self,
        n_features: int = 64,
        n_classes: int = 10,
        hidden: int = 64,
        lr: float = 1e-2,
        rank: int = 1,
        at_step: int = 2,
    ) -> None:
        super().__init__(n_features=n_features, n_classes=n_classes, hidden=hidden, lr=lr)
        self.fail_rank, self.fail_step = rank, at_step

    def error(self) -> Exception:
        raise NotImplementedError("a subclass says what it raises")

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and self.global_step == self.fail_step:
            raise self.error()
        return super().training_step(batch, batch_idx)


class ConfigErrorOnRank(_FailsOnRank):
    """Finds at step `at_step` on rank `rank` that its settings cannot work (a `ConfigError`)."""

    def error(self) -> Exception:
        return ConfigError(f"rank {self.fail_rank}: hidden={self.hparams.hidden} does not fit this shard")


class UserErrorOnRank(_FailsOnRank):
    """Has a bug that shows at step `at_step` on rank `rank` (a plain exception)."""

    def error(self) -> Exception:
        return ZeroDivisionError(f"rank {self.fail_rank}: division by zero in the loss")


class SlowSteps(DigitsMLP):
    """`DigitsMLP` whose every training step also waits `step_seconds`: a window in which a disruption lands
    mid-training.

    A digits step takes milliseconds, so a 200-step trial could finish before an eviction
    the test asked for has reached its pods on a loaded machine.

    `until`: a file; once it exists, steps no longer wait. A test creates it when the
    disruption has landed (the disturbed processes are gone), so the resumed training runs
    at full speed instead of sleeping through the rest of its steps. The weights do not
    depend on the wait: a trial is bitwise the same with or without it.
    """

    def __init__(
        self,
        n_features: int = 64,
        n_classes: int = 10,
        hidden: int = 64,
        lr: float = 1e-2,
        step_seconds: float = 0.1,
        until: Optional[str] = None,
    ) -> None:
        super().__init__(n_features=n_features, n_classes=n_classes, hidden=hidden, lr=lr)
        self.step_seconds = step_seconds
        self.until = until

    def training_step(self, batch, batch_idx):
        if self.until is None or not os.path.exists(self.until):
            time.sleep(self.step_seconds)
        return super().training_step(batch, batch_idx)


class MakesWandbImage(DigitsMLP):
    """`DigitsMLP` that makes a `wandb.Image` when training starts, as a team's model that logs samples does.

    A `wandb.Image` of an array is written at once to W&B's media directory, a temporary
    directory `wandb` creates when it is imported: on a warm worker, the server's.
    """

    def on_train_start(self) -> None:
        import numpy as np
        import wandb

        wandb.Image(np.zeros((8, 8, 3), dtype=np.uint8), caption="a sample")


class ProbesTheStorePort(DigitsMLP):
    """Rank 0 is slow to build; rank 1 meanwhile connects to `MASTER_PORT` once, as a peer's store client does.

    Rank 1 writes to `record` whether the port took the connection ("accepted")
    or refused it ("refused"): rank 0 has not reached its TCPStore yet, so only a
    port something already listens on can take it. Rank 0 waits `head_start`
    seconds on its first build only (the file exists by its later ones).
    """

    def __init__(self, n_features: int = 64, n_classes: int = 10, hidden: int = 64, lr: float = 1e-2, record: str = "",
                 head_start: float = 1.0) -> None:
        super().__init__(n_features=n_features, n_classes=n_classes, hidden=hidden, lr=lr)
        import socket

        if os.environ.get("RANK", "0") == "0":
            if not os.path.exists(record):
                time.sleep(head_start)
            return
        if os.path.exists(record):
            return
        try:
            with socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=5):
                outcome = "accepted"
        except ConnectionRefusedError:
            outcome = "refused"
        with open(record, "w") as f:
            f.write(outcome)
