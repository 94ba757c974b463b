"""Model code for the continue-smaller drills: each training process writes the world size it trains at.

Imported by the training processes of `tests/resources/test_k8s_elastic.py` (the
spec's `ModelSpec.path` names the class), so it imports only what model code may.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from tests.support.gang_models import SlowSteps
from training.spec import LAUNCH_ID_ENV


class RecordsWorldSize(SlowSteps):
    """`SlowSteps` whose every process writes, after its first training step, `<record>/<launch>-rank<r>.json`:
    its launch, world size, rank, global step and the time (`at`)."""

    def __init__(
        self,
        n_features: int = 64,
        n_classes: int = 10,
        hidden: int = 64,
        lr: float = 1e-2,
        step_seconds: float = 0.1,
        until: Optional[str] = None,
        record: str = "",
    ) -> None:
        super().__init__(
            n_features=n_features, n_classes=n_classes, hidden=hidden, lr=lr, step_seconds=step_seconds, until=until
        )
        self.record = record
        self._recorded = False

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self._recorded or not self.record:
            return
        self._recorded = True
        launch = os.environ.get(LAUNCH_ID_ENV, "direct")
        os.makedirs(self.record, exist_ok=True)
        with open(os.path.join(self.record, f"{launch}-rank{self.global_rank}.json"), "w") as f:
            json.dump({"launch": launch, "world_size": self.trainer.world_size, "rank": self.global_rank,
                       "global_step": self.global_step, "at": time.time()}, f)
