"""An image classifier on image shards: built with the data's shape, evaluated on the whole streamed splits, exported
and served from images sent as a client sends them (each image's raw values, flattened row-major).

One trial (`trained`, one process, in this one) trains `DigitsCNN` on the digits written as 8x8 image shards
(`tests.support.shards`, values 0..16) through `training.entrypoint.main`. Serving is checked against the model
itself on the data module's own batches, so the served normalization is the training one, for grey and for
colour (`[H, W, C]`) images.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from tests.support.shards import write_image_split, write_splits
from training import entrypoint
from training.lightning_eval import export_model, final_metrics
from training.lightning_task import build
from training.serving_model import ExportedModel, read_meta
from training.spec import DataSpec, ImportTarget, TrainResult, TrainSpec

N = 300  # digits per split (each split holds the first N: the test only checks that evaluation and serving agree)
CNN = {"channels": 8, "hidden": 32, "lr": 0.01}


def image_spec(tmp: Path, paths: dict[str, str], **over: Any) -> TrainSpec:
    """A classification trial of `DigitsCNN` on the image splits `paths`, written to `tmp/spec.json`, output in
    `tmp/run`."""
    base: dict[str, Any] = dict(
        pipeline="vision/digit_images",
        trial_id="trial-0000",
        prediction_task="classification",
        model=ImportTarget(path="pipelines.vision.models:DigitsCNN", kwargs=CNN),
        datamodule=ImportTarget(path="training.streaming:StreamingShardDataModule"),
        data=DataSpec(
            train_uri=paths["train"],
            val_uri=paths["val"],
            test_uri=paths["test"],
            features=["image"],
            target="label",
            version="0" * 32,
        ),
        output_uri=str(tmp / "run"),
        max_epochs=6,
        batch_size=32,
        monitor="val_acc",
        monitor_mode="max",
    )
    base.update(over)
    spec = TrainSpec(**base)
    (tmp / "spec.json").write_text(spec.to_json())
    return spec


def digits(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    """The raw images (uint8 0..16) and labels the splits hold, in stored order."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images[:n].astype(np.uint8), d.target[:n].astype(int)


def rows(images: np.ndarray) -> pd.DataFrame:
    """Images as a client sends them: one list of raw values per row, flattened row-major."""
    return pd.DataFrame({"image": [image.reshape(-1).tolist() for image in images]})


def own_outputs(model: torch.nn.Module, dm: Any, split: str = "test") -> tuple[np.ndarray, np.ndarray]:
    """The model's logits on the data module's own batches of `split` (the training normalization), and the labels."""
    model.eval()
    with torch.no_grad():
        batches = [(model(x), y) for x, y in dm.eval_dataloader(split)]
    return torch.cat([o for o, _ in batches]).numpy(), torch.cat([y for _, y in batches]).numpy()


def served(model_dir: Path) -> ExportedModel:
    model = ExportedModel()
    model.load_dir(str(model_dir))
    return model


@pytest.fixture(scope="module")
def splits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_splits(str(tmp_path_factory.mktemp("digit-shards")), "image", n=N)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, splits: dict[str, str]) -> Path:
    tmp = tmp_path_factory.mktemp("image-trial")
    image_spec(tmp, splits)
    assert entrypoint.main(["--spec", str(tmp / "spec.json")]) == 0
    return tmp


# -- the model's arguments ----------------------------------------------------------------------------


def test_the_platform_fills_the_image_shape_unless_the_pipeline_sets_it(tmp_path: Path, splits: dict[str, str]) -> None:
    colour = {s: str(tmp_path / s) for s in ("train", "val", "test")}
    for i, path in enumerate(colour.values()):
        write_image_split(path, n=40, digits=False, shape=(6, 4, 3), seed=i)
    model, dm = build(image_spec(tmp_path, colour))
    assert dm.input_shape == [3, 6, 4]
    assert {k: model.hparams[k] for k in ("in_channels", "height", "width", "n_classes")} == {
        "in_channels": 3,
        "height": 6,
        "width": 4,
        "n_classes": 10,
    }
    assert model(dm.example_input()).shape == (2, 10)
    model, _ = build(
        image_spec(
            tmp_path, splits, model=ImportTarget(path="pipelines.vision.models:DigitsCNN", kwargs={**CNN, "width": 16})
        )
    )
    assert (model.hparams["height"], model.hparams["width"]) == (8, 16)  # set by the pipeline: kept


# -- one trial, end to end --------------------------------------------------------------------------


def test_the_trial_is_evaluated_on_the_whole_streamed_splits_against_the_train_prior(trained: Path) -> None:
    result = TrainResult.model_validate_json((trained / "run" / "result.json").read_text())
    m = result.metrics
    for split in ("val", "test"):
        assert {f"{split}_acc", f"{split}_logloss", f"{split}_balanced_acc", f"{split}_f1", f"{split}_roc_auc",
                f"baseline_{split}_acc", f"baseline_{split}_logloss"} <= set(m)
    _, labels = digits()
    majority = np.bincount(
        labels
    ).argmax()  # every split holds the same digits: the prior's answer scores its own share
    assert m["baseline_test_acc"] == pytest.approx(np.mean(labels == majority))
    assert m["baseline_test_logloss"] == pytest.approx(-np.mean(np.log(np.bincount(labels)[labels] / len(labels))))
    assert m["test_acc"] > 0.7 > m["baseline_test_acc"]
    assert m["val_acc"] == m["test_acc"]  # the same images in both splits, evaluated whole

    meta = read_meta(str(trained / "run" / "model"))
    assert {
        k: meta[k]
        for k in ("task", "input_kind", "features", "target", "shape", "input_shape", "scale", "classes", "input_dtype")
    } == {
        "task": "classification",
        "input_kind": "image",
        "features": ["image"],
        "target": "label",
        "shape": [8, 8],
        "input_shape": [1, 8, 8],
        "scale": [0, 16],
        "classes": list(range(10)),
        "input_dtype": "float32",
    }

    images, labels = digits()
    out = served(trained / "run" / "model").predict(None, rows(images))
    assert list(out.columns) == ["label", *(f"proba_{d}" for d in range(10))]
    assert np.mean(out["label"].to_numpy() == labels) == pytest.approx(
        m["test_acc"], rel=1e-6
    )  # served as the pod measured it (the pod: a float32 mean)
    proba = out[[f"proba_{d}" for d in range(10)]].to_numpy()
    assert -np.mean(np.log(proba[np.arange(len(labels)), labels])) == pytest.approx(m["test_logloss"], rel=1e-5)


# -- serving --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 8), (6, 4, 3)], ids=["grey", "colour"])
def test_served_images_are_read_as_training_read_them(tmp_path: Path, shape: tuple[int, ...]) -> None:
    paths = {s: str(tmp_path / s) for s in ("train", "val", "test")}
    for i, path in enumerate(paths.values()):
        write_image_split(path, n=50, digits=False, shape=shape, seed=i)
    spec = image_spec(tmp_path, paths)
    torch.manual_seed(0)
    model, dm = build(spec)
    export_model(model, dm, spec, str(tmp_path / "model"))
    logits, _ = own_outputs(model, dm)

    from litdata import StreamingDataset

    raw = np.stack([np.asarray(StreamingDataset(paths["test"])[i]["image"]) for i in range(50)])
    assert raw.shape == (50, *shape) and raw.max() > 200  # raw 0..255 values, as they landed
    out = served(tmp_path / "model").predict(None, rows(raw))
    expected = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(
        out[[f"proba_{d}" for d in range(10)]].to_numpy(), expected / expected.sum(axis=1, keepdims=True), rtol=1e-6
    )
    assert out["label"].tolist() == logits.argmax(axis=1).tolist()


def test_a_row_of_the_wrong_size_or_range_is_refused_naming_it(trained: Path) -> None:
    model = served(trained / "run" / "model")
    images, _ = digits(3)
    good = images.reshape(3, -1).tolist()
    cases = [
        (
            [good[0], good[1][:63]],
            r"row 2 holds 63 values; the model reads 64: an image of shape \[8, 8\] flattened row-major",
        ),
        ([[*good[0][:5], 17, *good[0][6:]]], r"row 1: value 17 at position 5 is outside the image range 0\.\.16"),
        ([good[0], good[1], [-1] + good[2][1:]], r"row 3: value -1 at position 0 is outside the image range 0\.\.16"),
        ([[math.nan] * 64], r"row 1: value nan at position 0 is outside the image range"),
        ([["a"] * 64], r"row 1: expected a list of pixel values, got \['a'"),
    ]
    for cells, message in cases:
        with pytest.raises(ValueError, match=message):
            model.predict(None, pd.DataFrame({"image": cells}))
    with pytest.raises(ValueError, match=r"missing feature columns \['image'\]"):
        model.predict(None, pd.DataFrame({"pixels": good}))
    assert model.predict(None, pd.DataFrame({"image": good[:0]})).shape == (0, 11)


def test_an_image_model_meta_without_a_valid_shape_or_scale_is_refused(trained: Path, tmp_path: Path) -> None:
    import json
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(trained / "run" / "model", model_dir)
    meta = json.loads((model_dir / "meta.json").read_text())
    for field, value, message in (
        (
            "shape",
            [8],
            r"field 'shape' of an image model must be \[height, width\] or \[height, width, channels\], got \[8\]",
        ),
        ("scale", [16, 0], r"field 'scale' of an image model must be \[min, max\] with min < max, got \[16, 0\]"),
    ):
        (model_dir / "meta.json").write_text(json.dumps({**meta, field: value}))
        with pytest.raises(ValueError, match=message):
            read_meta(str(model_dir))


def test_final_metrics_name_an_empty_split(tmp_path: Path, splits: dict[str, str]) -> None:
    spec = image_spec(tmp_path, splits)
    model, dm = build(spec)
    dm.eval_dataloader = lambda split: iter(())
    with pytest.raises(ValueError, match="the val split of data module StreamingShardDataModule holds no sample"):
        final_metrics(spec, model, dm)
