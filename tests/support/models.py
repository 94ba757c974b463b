"""A trained model's export directory, written as the training process writes it."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def export_model(model: torch.nn.Module, directory: Path, features: list[str], classes: list) -> Path:
    """Write `<directory>/model/` as the training process does: model.pt2 + meta.json.

    Args:
        model: A classifier taking `len(features)` float inputs.
        directory: Parent of the `model/` folder, which must not exist yet.
        features: Input column names, in order.
        classes: The label of each output logit.

    Returns:
        The `model/` folder.
    """
    model_dir = directory / "model"
    model_dir.mkdir(parents=True)
    ep = torch.export.export(
        model.eval(),
        (torch.zeros(2, len(features)),),
        dynamic_shapes=({0: torch.export.Dim("batch")},),
    )
    torch.export.save(ep, str(model_dir / "model.pt2"))
    meta = {
        "features": features,
        "target": "label",
        "task": "classification",
        "classes": classes,
        "input_dtype": "float32",
    }
    (model_dir / "meta.json").write_text(json.dumps(meta))
    return model_dir
