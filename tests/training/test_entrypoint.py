"""The entrypoint in one process (no torchrun): result, export, failure records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.train_specs import make_spec
from training import entrypoint
from training.checkpointing import CheckpointStore
from training.spec import EXIT_BAD_CONFIG, EXIT_USER_ERROR, FaultInjection, ImportTarget, TrainResult


def test_trains_exports_and_writes_result(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == 0
    result = TrainResult.model_validate_json((tmp_path / "run" / "result.json").read_text())
    assert result.epochs == 2 and result.world_size == 1
    assert {
        "val_acc",
        "test_acc",
        "val_logloss",
        "val_roc_auc",
        "val_pr_auc",
        "val_f1",
        "test_balanced_acc",
        "baseline_test_acc",
        "test_recall/9",
    } <= set(result.metrics)
    assert 0.0 <= result.metrics["test_acc"] <= 1.0
    assert result.train_samples == 2 * 210  # 70% of 300 rows, two epochs
    assert set(result.finish_seconds) == {"load_best", "evaluate", "export"} and all(
        v >= 0 for v in result.finish_seconds.values()
    )
    assert result.checkpoint_uri == CheckpointStore(str(tmp_path / "run" / "checkpoints")).best().uri
    meta = json.loads((tmp_path / "run" / "model" / "meta.json").read_text())
    assert meta["features"] == spec.data.features and meta["classes"] == list(range(10))
    exported = torch.export.load(str(tmp_path / "run" / "model" / "model.pt2")).module()
    assert exported(torch.zeros(5, 64)).shape == (5, 10)


def test_same_seed_gives_identical_weights(tmp_path: Path) -> None:
    weights = []
    for i in range(2):
        d = tmp_path / str(i)
        make_spec(d)
        assert entrypoint.main(["--spec", str(d / "spec.json")]) == 0
        latest = CheckpointStore(str(d / "run" / "checkpoints")).latest()
        weights.append(latest.state["state_dict"])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_unknown_model_module_is_a_config_error(tmp_path: Path) -> None:
    make_spec(tmp_path, model=ImportTarget(path="pipelines.vision.nope:Model"))
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == EXIT_BAD_CONFIG
    failure = json.loads((tmp_path / "run" / "failures" / "rank-0.json").read_text())
    assert failure["category"] == "config"
    assert "cannot import module 'pipelines.vision.nope'" in failure["error"]


def test_rejected_hyperparameter_is_a_config_error(tmp_path: Path) -> None:
    make_spec(tmp_path, model=ImportTarget(path="pipelines.vision.models:DigitsMLP", kwargs={"depth": 3}))
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == EXIT_BAD_CONFIG
    failure = json.loads((tmp_path / "run" / "failures" / "rank-0.json").read_text())
    assert "rejected hyperparameters" in failure["error"] and "depth" in failure["error"]


def test_exception_in_training_is_a_user_error_with_traceback(tmp_path: Path) -> None:
    make_spec(tmp_path, faults=FaultInjection(raise_at_step=3))
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == EXIT_USER_ERROR
    failure = json.loads((tmp_path / "run" / "failures" / "rank-0.json").read_text())
    assert failure["category"] == "user"
    assert "injected fault at step 3" in failure["error"]
    assert "Traceback" in failure["traceback"]
    assert not (tmp_path / "run" / "result.json").exists()


def test_world_size_mismatch_is_a_config_error(tmp_path: Path) -> None:
    from training.spec import Distribution

    make_spec(tmp_path, distribution=Distribution(procs_per_node=2))
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == EXIT_BAD_CONFIG
    failure = json.loads((tmp_path / "run" / "failures" / "rank-0.json").read_text())
    assert "launch with torchrun --nproc-per-node 2" in failure["error"]


def test_missing_spec_file(tmp_path: Path) -> None:
    assert entrypoint.main(["--spec", str(tmp_path / "missing.json")]) == EXIT_BAD_CONFIG


def test_a_restarted_group_skips_a_failure_record_cut_short_and_still_finds_a_terminal_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank stopped while writing its record leaves an empty file; the restarted group must not fail on it."""
    failures = tmp_path / "failures"
    failures.mkdir()
    (failures / "rank-0.json").write_text("")  # truncated by the write, then the writer was stopped
    monkeypatch.setenv("TRAINYARD_LAUNCH_ID", "launch-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert entrypoint.earlier_terminal_failure(str(tmp_path)) is None
    (failures / "rank-1.json").write_text(
        json.dumps({"rank": 1, "launch": "launch-1", "category": "user", "error": "boom"})
    )
    earlier = entrypoint.earlier_terminal_failure(str(tmp_path))
    assert earlier is not None and earlier["rank"] == 1


def test_a_failure_record_is_written_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record replaces the file by rename: no moment exists at which a reader finds it empty."""
    monkeypatch.setenv("RANK", "0")
    entrypoint.write_failure(str(tmp_path / "spec.json"), str(tmp_path), "user", ValueError("first"))
    record = tmp_path / "failures" / "rank-0.json"
    before = record.stat().st_ino
    entrypoint.write_failure(str(tmp_path / "spec.json"), str(tmp_path), "config", ValueError("second"))
    assert record.stat().st_ino != before  # a new file renamed into place, not the old one truncated and rewritten
    assert json.loads(record.read_text())["error"] == "ValueError: second"
    assert [p.name for p in record.parent.iterdir()] == ["rank-0.json"]


def _linear_state(value: float) -> dict[str, object]:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return {"state_dict": model.state_dict()}


def test_the_trained_model_is_kept_without_reading_the_checkpoint_when_the_last_step_is_the_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.lightning_task import _load_best

    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.save(5, _linear_state(1.0), best=True)
    store.save(9, _linear_state(2.0), best=True)
    trained = torch.nn.Linear(4, 3)
    with torch.no_grad():
        trained.weight.fill_(2.0)
        trained.bias.fill_(2.0)
    reads: list[str] = []
    real_load = CheckpointStore._load
    monkeypatch.setattr(
        CheckpointStore,
        "_load",
        lambda self, entry, *a, **k: reads.append(entry.name) or real_load(self, entry, *a, **k),
    )
    model, uri = _load_best(make_spec(tmp_path), trained, store, step=9)
    assert model is trained and uri == store.uri(9) and reads == []  # the weights in memory are step 9's: nothing read
    # the best is older than the last step: it is read, verified and loaded over the trained weights
    store.save(12, _linear_state(3.0), best=False)
    model, uri = _load_best(make_spec(tmp_path), trained, store, step=12)
    assert uri == store.uri(9) and reads == ["step-000000009"]
    assert torch.equal(model.weight, torch.full((3, 4), 2.0))


def test_the_final_evaluation_in_batches_equals_one_pass_and_leaves_the_model_where_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from training import lightning_eval as lightning_task

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(1000, 8), torch.randint(0, 3, (1000,))
    whole = lightning_task.evaluate(model, x, y, "classification")
    monkeypatch.setattr(lightning_task, "EVAL_BATCH_ROWS", 64)  # 16 batches, the last one short
    assert lightning_task.evaluate(model, x, y, "classification", "cpu") == whole
    assert whole == float((model(x).argmax(dim=1) == y).float().mean())
    reg = torch.nn.Linear(8, 1)
    rmse = lightning_task.evaluate(reg, x, y.float(), "regression")
    assert rmse == pytest.approx(
        float(torch.sqrt(torch.mean((reg(x).reshape(-1).double() - y.double()) ** 2))), rel=1e-6
    )
    assert next(model.parameters()).device.type == "cpu" and not model.training
