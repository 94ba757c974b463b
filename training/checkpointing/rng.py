"""Capture and restore every random generator a training step draws from, for exact resume."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when available) CUDA RNG states, for exact resume.

    Plain tuples, lists, ints and tensors only, so it loads with `weights_only=True`.
    """
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np_state["state"]["key"].tolist(), "pos": int(np_state["state"]["pos"])},
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators captured by `rng_state`; keys that are absent are left alone."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": s["bit_generator"],
                "state": {"key": np.asarray(s["state"]["key"], dtype=np.uint32), "pos": s["state"]["pos"]},
                "has_gauss": s["has_gauss"],
                "gauss": s["gauss"],
            }
        )
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["cuda"])[: torch.cuda.device_count()]
        for device, s in enumerate(cuda_states):
            torch.cuda.set_rng_state(s, device)
