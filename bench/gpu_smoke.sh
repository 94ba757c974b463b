#!/usr/bin/env bash
# GPU smoke test for a machine with NVIDIA GPUs (never needed by tests or CI):
# DDP and FSDP with NCCL and bf16 on all local GPUs through the platform's entrypoint,
# against a bare PyTorch loop, each timed over a steady-state window (no start-up,
# checkpoint write or validation inside; see bench/gpu_smoke.py). Writes
# bench/results/gpu_smoke.json; `--dry-run` runs the same path on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
nvidia-smi --query-gpu=name,memory.total --format=csv
"$PY" -m bench.gpu_smoke "$@"
# NCCL between GPU ranks forked from one warm server, against torchrun's ranks (bench/gpu_forked_nccl.py):
# until this passes, LocalLauncher starts trials of several GPU ranks cold. Needs two GPUs; else "not run".
case " $* " in *" --dry-run "*) ;; *) "$PY" -m bench.gpu_forked_nccl ;; esac
