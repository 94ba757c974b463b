"""Planner memory model vs measurement: real 2-process CPU training under DDP, FSDP and tensor parallel.

A 33.6M-parameter `MLPClassifier` (width 1024, 4 residual blocks of 1024 -> 4096
-> 1024, fp32, Adam) trains for a few steps through the platform launcher with
each strategy. Every rank measures its own peak memory:

    peak delta = peak RSS over the training steps (VmHWM, read at the end
                 of each training batch, before validation and checkpointing)
               - RSS just before the model's parameters are allocated
    measured   = peak delta(width 1024) - peak delta(width 16) + planner(width 16)

The width-16 run of the same strategy pays the same fixed costs (the process
group, Lightning, data, library pages touched by the first backward and
optimizer step: 70-95 MiB per rank here), so the difference is the memory that
scales with the model: parameters, gradients, optimizer state, communication
buffers and activations. `MALLOC_MMAP_THRESHOLD_` makes glibc serve every block
of 64 KiB or more with mmap, so freed tensors leave the resident set and RSS
tracks live memory. The planner's estimate for the same model, dtype,
optimizer, device count and FSDP units is the prediction; the value written
is the planner's worst error over the strategies, max |predicted/measured - 1|
(0 is a perfect model; lower is better; target <= 0.2, i.e. every strategy's
predicted/measured within 0.8..1.2). Each strategy's predicted/measured (below
1 the planner underestimates) and their mean are in the details.

No checkpoint is saved within the measured steps. The planner predicts
accelerator memory; an asynchronous save copies what the rank writes into
host RAM (DDP: rank 0, all model states; FSDP/TP: each rank its shard), which
on a GPU machine is not device memory, but on CPU would land in the same RSS.
That host copy is measured separately, by a run of the big model with the
default checkpoint policy (first save after the first step), and reported in
`details.checkpoint_host_copy` next to the bytes the rank saves.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from typing_extensions import override

from bench.harness import Target, peak_rss_bytes, write_result
from training.parallel import MLPClassifier

ROOT = Path(__file__).resolve().parent.parent
WIDTH, CALIBRATION_WIDTH, BLOCKS, EXPANSION, BATCH, STEPS, PROCS = 1024, 16, 4, 4, 32, 4, 2


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryProbeMLP(MLPClassifier):
    """`MLPClassifier` that writes its rank's memory high-water mark to `probe_dir/rank-<r>.json`."""

    def __init__(self, probe_dir: str, **kwargs: Any) -> None:
        before = _rss_bytes()
        super().__init__(**kwargs)
        self.probe_dir = probe_dir
        self.rss_before_model = before

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        peak = peak_rss_bytes()  # not ru_maxrss: a spawned rank inherits its launcher's high-water mark
        record = {
            "rank": self.global_rank,
            "steps": self.trainer.global_step,
            "rss_before_model": self.rss_before_model,
            "peak_rss": peak,
            "measured_bytes": peak - self.rss_before_model,
            "rss_now": _rss_bytes(),
        }
        path = Path(self.probe_dir) / f"rank-{self.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))


def _activation_gb(width: int) -> float:
    """fp32 tensors autograd keeps per block: block input, up output, ReLU output; plus the head's input."""
    from trainyard.capacity import GIB

    per_block = BATCH * (width + 2 * width * EXPANSION) * 4
    return (BLOCKS * per_block + BATCH * width * 4) / GIB


def main() -> dict:
    sys.path.insert(0, str(ROOT))
    from resources.launcher import LocalLauncher
    from tests.digits import features, write_splits
    from training.spec import CheckpointPolicy, DataSpec, Distribution, ImportTarget, TrainSpec
    from trainyard.capacity import GIB, estimate_params, memory_per_device

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    per_strategy: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_splits(str(Path(tmp) / "data"), n=600)
        data = DataSpec(train_uri=paths["train"], val_uri=paths["val"], test_uri=paths["test"], features=features(),
                        target="label", version="bench")

        def run(strategy: str, width: int, save_in_window: bool = False) -> tuple[list[float], Any]:
            """Measured GiB per rank and the planner's prediction for one run."""
            t = 2 if strategy == "tp" else 1
            hparams = {"width": width, "blocks": BLOCKS, "expansion": EXPANSION, "lr": 1e-3, "input_scale": 16.0}
            name = f"{strategy}-{width}{'-saving' if save_in_window else ''}"
            probe = Path(tmp) / name / "probe"
            spec = TrainSpec(
                pipeline="bench/planner-memory",
                trial_id=f"trial-{name}",
                model=ImportTarget(
                    path="bench.planner_memory:MemoryProbeMLP", kwargs={**hparams, "probe_dir": str(probe)}
                ),
                data=data,
                output_uri=str(Path(tmp) / name / "run"),
                max_epochs=1,
                limit_train_batches=STEPS,
                batch_size=BATCH,
                distribution=Distribution(procs_per_node=PROCS, strategy=strategy, tensor_parallel_size=t),
                checkpoint=CheckpointPolicy() if save_in_window else CheckpointPolicy(every_n_steps=10 * STEPS),
            )
            LocalLauncher(timeout_seconds=300).launch(spec)
            ranks = [json.loads(p.read_text()) for p in sorted(probe.glob("rank-*.json"))]
            predicted = memory_per_device(
                strategy,
                estimate_params(MLPClassifier(**hparams)),
                4,
                "adam",
                PROCS,
                tensor_parallel_size=t,
                activation_gb=_activation_gb(width),
                fsdp_units=BLOCKS,
            )
            return [r["measured_bytes"] / GIB for r in ranks], predicted

        for strategy in ("ddp", "fsdp", "tp"):
            big, predicted = run(strategy, WIDTH)
            tiny, predicted_tiny = run(strategy, CALIBRATION_WIDTH)
            saving, _ = run(strategy, WIDTH, save_in_window=True)
            # what a rank saves: weights and both Adam moments of its part, 3 of the 4 model-state copies (no grads)
            saved = predicted.model_states_gb * 3 / 4
            saved_per_rank = [saved] + [0.0 if strategy == "ddp" else saved] * (PROCS - 1)  # DDP: rank 0 writes
            # the tiny run pays the same fixed costs (code pages, process group, Lightning, data)
            measured = [b - s + predicted_tiny.total_gb for b, s in zip(big, tiny)]
            per_strategy[strategy] = {
                "predicted_gib": round(predicted.total_gb, 4),
                "predicted_breakdown_gib": {"model_states": round(predicted.model_states_gb, 4),
                                            "buffers": round(predicted.buffers_gb, 4),
                                            "activations": round(predicted.activations_gb, 4)},
                "measured_gib_per_rank": [round(m, 4) for m in measured],
                "raw_peak_delta_gib_per_rank": [round(b, 4) for b in big],
                "calibration_peak_delta_gib_per_rank": [round(s, 4) for s in tiny],
                "ratio": round(predicted.total_gb / max(measured), 4),
                "checkpoint_host_copy": {
                    "measured_gib_per_rank": [round(a - b, 4) for a, b in zip(saving, big)],
                    "saved_gib_per_rank": [round(x, 4) for x in saved_per_rank],
                },
            }
    worst = max(abs(s["ratio"] - 1.0) for s in per_strategy.values())
    return write_result(
        "planner_memory",
        worst,
        "max |predicted/measured - 1|",
        None,
        {
            "strategies": per_strategy,
            "mean_predicted_over_measured": statistics.mean(s["ratio"] for s in per_strategy.values()),
            "params": estimate_params(MLPClassifier(width=WIDTH, blocks=BLOCKS, expansion=EXPANSION)),
            "dtype": "float32",
            "optimizer": "adam",
            "processes": PROCS,
            "batch_per_rank": BATCH,
            "steps": STEPS,
            "fsdp_units": BLOCKS,
            "measurement": "per rank: VmHWM at the end of each training batch minus RSS before the model's parameters "
            f"exist, minus the same for width {CALIBRATION_WIDTH} (fixed costs); ratio uses the larger rank; "
            "MALLOC_MMAP_THRESHOLD_=65536",
        },
        targets=[Target("value", "<=", 0.2)],
        better="lower",
    )


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
