"""A registered model whose artifact was tampered with is refused by every loader, and nothing in it runs.

The version is registered for real (SQLite registry, local artifact store); then
its stored `model.pt2` is rewritten in place, as someone with write access to the
artifact store could, and loaded the ways trainyard loads models: in process
(`ModelRegistry.predict`, as promotion's evaluation does) and in a fresh serving
process (`ModelRegistry.smoke_test`). The control loads the same file with plain
`torch.export.load`, which runs the payload.
"""

from __future__ import annotations

import contextlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from resources.registry import ModelRegistry, RegistryError
from tests.support.models import export_model
from tests.support.payloads import rewrite_zip, torch_payload

FEATURES = ["f0", "f1", "f2", "f3"]
CLASSES = [0, 1, 2]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("safe-models")


@pytest.fixture(scope="module")
def registry(workdir: Path) -> ModelRegistry:
    return ModelRegistry(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}", artifact_root=str(workdir / "mlartifacts"))


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    return pd.DataFrame(np.random.default_rng(0).normal(size=(8, len(FEATURES))), columns=FEATURES)


def register(registry: ModelRegistry, workdir: Path, frame: pd.DataFrame, name: str) -> tuple[str, Path]:
    """Register a fresh tiny model as `name`; its model URI and the stored `model.pt2` the loaders read."""
    torch.manual_seed(0)
    model_dir = export_model(torch.nn.Linear(len(FEATURES), len(CLASSES)), workdir / name, FEATURES, CLASSES)
    version = registry.register(name, str(model_dir), trial_key=f"{name}/trial-0000", tags={}, metrics={},
                                description="tampered later", input_example=frame)
    stored = list((workdir / "mlartifacts" / "trainyard" / name).rglob("model.pt2"))
    assert len(stored) == 1, stored
    return version.model_uri, stored[0]


def plant_sample_inputs(pt2: Path, marker: Path) -> None:
    """torch.export.load reads sample inputs with weights_only=True, then falls back to False."""
    rewrite_zip(pt2, {"data/sample_inputs/model.pt": torch_payload(marker)})


def plant_pickled_weight(pt2: Path, marker: Path) -> None:
    """A weight marked `use_pickle` is read with torch.load(weights_only=False)."""
    with zipfile.ZipFile(pt2) as archive:
        config_name = next(n for n in archive.namelist() if n.endswith("_weights_config.json"))
        config = json.loads(archive.read(config_name))
    entry = next(iter(config["config"].values()))
    entry["use_pickle"] = True
    rewrite_zip(
        pt2,
        {
            config_name.split("/", 1)[1]: json.dumps(config).encode(),
            f"data/weights/{entry['path_name']}": torch_payload(marker),
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("plant", [plant_sample_inputs, plant_pickled_weight])
def test_planted_pickle_in_a_registered_model_is_refused_by_every_loader(
    registry: ModelRegistry, workdir: Path, frame: pd.DataFrame, plant, tmp_path: Path
) -> None:
    name = f"tampered-{plant.__name__.replace('_', '-')}"
    model_uri, pt2 = register(registry, workdir, frame, name)
    assert registry.predict(model_uri, frame).shape == (len(frame),)  # served fine before the tampering
    marker = tmp_path / "payload-ran"
    plant(pt2, marker)

    with pytest.raises(RegistryError, match=r"model file .*model\.pt2 was refused: .*pickle") as refused:
        registry.predict(model_uri, frame)
    assert "tampered with" in str(refused.value)
    smoke = registry.smoke_test(model_uri, {"test": frame})
    assert not smoke.passed and "was refused" in (smoke.error or "") and "UnsafeModelError" in (smoke.error or "")
    assert not marker.exists()

    # Control: the stock loader runs the payload planted in the very same file (then fails on what it unpickled).
    with contextlib.suppress(Exception):
        torch.export.load(str(pt2)).module()
    assert marker.exists()


def test_graph_calling_more_than_torch_operators_is_refused(
    registry: ModelRegistry, workdir: Path, frame: pd.DataFrame
) -> None:
    model_uri, pt2 = register(registry, workdir, frame, "tampered-graph")
    with zipfile.ZipFile(pt2) as archive:
        program_name = next(n for n in archive.namelist() if "/models/" in n)
        program = json.loads(archive.read(program_name))
    node = program["graph_module"]["graph"]["nodes"][0]
    node["target"] = "torch.os.system"  # resolved by getattr from `torch`, then called with the node's arguments
    rewrite_zip(pt2, {program_name.split("/", 1)[1]: json.dumps(program).encode()})
    with pytest.raises(RegistryError, match="its graph calls 'torch.os.system', which is not a torch operator"):
        registry.predict(model_uri, frame)


def test_compiled_code_in_the_archive_is_refused(registry: ModelRegistry, workdir: Path, frame: pd.DataFrame) -> None:
    model_uri, pt2 = register(registry, workdir, frame, "tampered-aoti")
    rewrite_zip(pt2, {"data/aotinductor/model/model.so": b"\x7fELF"})
    with pytest.raises(RegistryError, match=r"it holds 'data/aotinductor/model/model.so', which is neither graph"):
        registry.predict(model_uri, frame)
