"""Print the worked examples of docs/capacity.md from the planner's own functions.

Run: `.venv/bin/python docs/capacity_examples.py` and paste the output into docs/capacity.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainyard.capacity import (
    H100_BF16_TFLOPS,
    H200_BF16_TFLOPS,
    NothingFitsError,
    TransformerShape,
    checkpoint_gb,
    checkpoint_seconds,
    memory_per_device,
    plan,
    training_time,
)

GPUS = {"H100 80GB": (79.6, H100_BF16_TFLOPS), "H200 141GB": (140.4, H200_BF16_TFLOPS)}
MODELS = {
    # Llama-2-like shapes; micro-batch 1 sequence of 4096 tokens per device, FlashAttention
    "7B": (7_000_000_000, TransformerShape(layers=32, hidden=4096, heads=32, seq_len=4096, vocab=32000)),
    "70B": (70_000_000_000, TransformerShape(layers=80, hidden=8192, heads=64, seq_len=4096, vocab=32000)),
}
RUNS = {"7B": (1e12, 64), "70B": (2e12, 512)}  # token budget, devices (8 per node)
MFU, BANDWIDTH_GIB_S, PER_NODE = 0.40, 5.0, 8


def memory_table(name: str, devices: int, checkpointing: bool) -> None:
    params, base = MODELS[name]
    shape = TransformerShape(**{**base.__dict__, "activation_checkpointing": checkpointing})
    print(f"\n{name}, bf16 + Adam, {devices} devices ({devices // PER_NODE} node(s) of {PER_NODE}), "
          f"activation checkpointing {'on' if checkpointing else 'off'}; GiB per device\n")
    rows = [("DDP", "ddp", 1), ("FSDP", "fsdp", 1)] + [(f"FSDP x TP, tp={t}", "tp", t) for t in (2, 4, 8)]
    print("| strategy | model states | buffers | activations | total | " + " | ".join(f"fits {g}" for g in GPUS) + " |")
    print("|---|---:|---:|---:|---:|" + "---|" * len(GPUS))
    for label, strategy, t in rows:
        e = memory_per_device(strategy, params, 2, "adam", devices, tensor_parallel_size=t, shape=shape)
        fits = " | ".join("yes" if e.total_gb <= mem * 0.9 else "no" for mem, _ in GPUS.values())
        print(
            f"| {label} | {e.model_states_gb:.1f} | {e.buffers_gb:.1f} | {e.activations_gb:.1f} | {e.total_gb:.1f} | "
            f"{fits} |"
        )
    for gpu, (mem, _) in GPUS.items():
        try:
            p = plan(params, 2, "adam", mem, devices, nodes=devices // PER_NODE, shape=shape)
            choice = p.strategy + (f" (tp={p.tensor_parallel_size})" if p.strategy == "tp" else "")
        except NothingFitsError as e:
            choice = "nothing fits: " + str(e).rsplit("; ", 1)[-1]
        print(f"\n- plan on {gpu} ({mem} GiB, 90% usable): **{choice}**")


def run_table() -> None:
    print("\nRun time at 40% MFU, 6·N·tokens FLOPs; peak bf16 dense 989 TFLOPS (H100 SXM and H200 alike)\n")
    print("| model | tokens | devices | tokens/s | days |")
    print("|---|---:|---:|---:|---:|")
    for name, (tokens, devices) in RUNS.items():
        params = MODELS[name][0]
        cost = training_time(params, tokens, devices, H100_BF16_TFLOPS, MFU)
        print(f"| {name} | {tokens:.0e} | {devices} | {cost.tokens_per_second:,.0f} | {cost.days:.1f} |")


def checkpoint_table() -> None:
    print(
        f"\nCheckpoint (bf16 weights + fp32 master + 2 fp32 Adam states = 14 bytes/param) at {BANDWIDTH_GIB_S} GiB/s "
        "aggregate\n"
    )
    print("| model | size GiB | save seconds |")
    print("|---|---:|---:|")
    for name, (params, _) in MODELS.items():
        size = checkpoint_gb(params, 2, "adam")
        print(f"| {name} | {size:.0f} | {checkpoint_seconds(size, BANDWIDTH_GIB_S):.0f} |")


def main() -> None:
    memory_table("7B", 8, checkpointing=False)
    memory_table("70B", 64, checkpointing=False)
    memory_table("70B", 64, checkpointing=True)
    run_table()
    checkpoint_table()


if __name__ == "__main__":
    main()
