"""`python -m bench.gpu_forked_nccl`: NCCL between GPU ranks forked from one warm server, against torchrun's ranks.

Local one-node trials start on warm workers, forks of a server that imported torch
without touching CUDA (`training.warm`); CPU trials of several ranks (gloo) are tested
there, but several GPU ranks talking NCCL from forked processes have never run, so
`LocalLauncher` starts such trials cold with torchrun unless `warm_multi_gpu=True`.
This is the run that settles it, for a machine with two or more GPUs (`bash
bench/gpu_smoke.sh` runs it after the smoke benchmark): the same two-rank DDP trial
(bf16, NCCL, seeded, deterministic) once cold and once on warm workers, each through
`LocalLauncher`. It passes when the warm launch really ran on forked ranks (its log
names the warm server's workers), both trials finished with world size 2, and their
final validation loss agrees within `TOLERANCE` (bf16 all-reduces in another order may
differ in the last bits). `bench/results/gpu_forked_nccl.json`: value 1 passed, 0
failed; on a machine with fewer than two GPUs it writes "not run" and exits 0.
If it passes, `warm_multi_gpu` can become the default.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import Target, write_result

TOLERANCE = 0.02  # relative difference of the final val_loss
STEPS_ROWS = 64 * 2 * 200  # 200 steps of 64 rows a rank
WARM_WORKER = re.compile(
    r"worker pid \d+ started \(restart 0\) by supervisor pid \d+ of warm server pid (\d+) \(rank (\d) of 2\)"
)


def _write_data(directory: Path, rows: int, features: int = 64, classes: int = 10) -> list[str]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, features), dtype=np.float32)
    y = x[:, :classes].argmax(axis=1).astype(np.int64)
    names = [f"f{i}" for i in range(features)]
    table = pa.table({**{n: x[:, i] for i, n in enumerate(names)}, "label": y})
    for split in ("train", "val", "test"):
        pq.write_table(table if split == "train" else table.slice(0, 4096), directory / f"{split}.parquet")
    return names


def _trial(directory: Path, names: list[str], warm: bool) -> dict[str, Any]:
    from resources.launcher import LocalLauncher
    from training.spec import DataSpec, Distribution, ImportTarget, TrainSpec

    how = "warm" if warm else "cold"
    spec = TrainSpec(
        pipeline="bench/gpu-forked-nccl",
        trial_id=f"trial-{how}",
        model=ImportTarget(
            path="training.parallel:MLPClassifier", kwargs={"n_features": len(names), "n_classes": 10, "width": 256}
        ),
        data=DataSpec(
            train_uri=str(directory / "train.parquet"),
            val_uri=str(directory / "val.parquet"),
            test_uri=str(directory / "test.parquet"),
            features=names,
            target="label",
            version="synthetic",
        ),
        output_uri=str(directory / how),
        max_epochs=2,
        batch_size=64,
        seed=0,
        deterministic=True,
        precision="bf16-mixed",
        distribution=Distribution(procs_per_node=2, strategy="ddp", accelerator="gpu"),
    )
    outcome = LocalLauncher(timeout_seconds=900, warm_multi_gpu=warm, warm_workers=warm).launch(spec)
    log = Path(outcome.log_uri).read_text(errors="replace")
    ranks = sorted(int(m[2]) for m in WARM_WORKER.finditer(log))
    return {"world_size": outcome.result.world_size, "val_loss": outcome.result.metrics.get("val_loss"),
            "forked_ranks": ranks, "seconds": outcome.seconds}


def main() -> dict[str, Any]:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(f"gpu_forked_nccl: not run: {gpus} GPU(s) here, two are needed", file=sys.stderr)
        return write_result(
            "gpu_forked_nccl", 0.0, "passed", None, {"run": False, "why": f"{gpus} GPU(s); two are needed"}
        )
    with tempfile.TemporaryDirectory(prefix="gpu-forked-nccl-") as tmp:
        directory = Path(tmp)
        names = _write_data(directory, STEPS_ROWS)
        cold, warm = _trial(directory, names, warm=False), _trial(directory, names, warm=True)
    close = (cold["val_loss"] is not None and warm["val_loss"] is not None
             and abs(warm["val_loss"] - cold["val_loss"]) <= TOLERANCE * abs(cold["val_loss"]))
    passed = (
        warm["forked_ranks"] == [0, 1]
        and not cold["forked_ranks"]
        and cold["world_size"] == warm["world_size"] == 2
        and close
    )
    return write_result("gpu_forked_nccl", 1.0 if passed else 0.0, "passed", None,
                        {"run": True, "gpus": gpus, "device": torch.cuda.get_device_name(0), "cold": cold, "warm": warm,
                         "tolerance": TOLERANCE},
                        targets=[Target("value", ">=", 1.0)], better="higher")


if __name__ == "__main__":
    main()
