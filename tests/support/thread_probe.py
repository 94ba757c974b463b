"""Digits models that record what their training process sees (thread settings, an installed library), for the
warm-worker tests.

Imported by the trial's own process (the spec's `ModelSpec.path` names `ThreadProbe`), so it imports only what model
code may, and records what the process really has: its environment, torch's intra-op threads, and what each OpenMP
and BLAS runtime loaded in it would use (threadpoolctl asks the libraries themselves).
"""

from __future__ import annotations

import json
import os

import torch
from threadpoolctl import threadpool_info

from pipelines.vision.models import DigitsMLP


class ThreadProbe(DigitsMLP):
    """`DigitsMLP` that writes `{"pid", "env", "torch", "runtimes"}` to the JSON file `record` when it is built."""

    def __init__(
        self, n_features: int = 64, n_classes: int = 10, hidden: int = 16, lr: float = 0.02, record: str = ""
    ) -> None:
        super().__init__(n_features=n_features, n_classes=n_classes, hidden=hidden, lr=lr)
        names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
        seen = {
            "pid": os.getpid(),
            "env": {n: os.environ.get(n) for n in names},
            "torch": torch.get_num_threads(),
            "runtimes": [
                {"api": i["internal_api"], "library": os.path.basename(i["filepath"]), "threads": i["num_threads"]}
                for i in threadpool_info()
            ],
        }
        with open(record, "w") as f:
            json.dump(seen, f)


class ImportProbe(DigitsMLP):
    """`DigitsMLP` that imports the module `module` when it is built and writes `{"pid", "value": module.VALUE}` to
    `record`."""

    def __init__(self, n_features: int = 64, n_classes: int = 10, hidden: int = 16, lr: float = 0.02, module: str = "",
                 record: str = "") -> None:
        super().__init__(n_features=n_features, n_classes=n_classes, hidden=hidden, lr=lr)
        import importlib

        with open(record, "w") as f:
            json.dump({"pid": os.getpid(), "value": importlib.import_module(module).VALUE}, f)
