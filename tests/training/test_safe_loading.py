"""Checkpoints are read as data: a planted pickle is refused by resume, `training.verify` and reproduce, and never runs.

Each planted checkpoint is committed the way the store commits (payload, then a
manifest with its checksum), so it is the one a resume picks; only the store's
save-time check is switched off, as an attacker's writer would not have it. Each
test ends with the control: the same bytes loaded the unsafe way run the payload.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import training.checkpointing.store as store_module
from resources.launcher import LocalLauncher, TrainingConfigError
from tests.support.payloads import TouchOnUnpickle, run_payload, torch_payload
from tests.support.train_specs import make_spec
from training import entrypoint
from training.checkpointing import CheckpointStateError, CheckpointStore, ShardSpec, UnsafeCheckpointError
from training.spec import EXIT_BAD_CONFIG, CheckpointPolicy, Distribution, ImportTarget

REPO = Path(__file__).resolve().parents[2]


def plant(
    store: CheckpointStore, step: int, state: dict[str, Any], marker: Path, monkeypatch: pytest.MonkeyPatch, **save: Any
) -> Path:
    """Commit `state` plus a payload as checkpoint `step` through `store.save`; returns the payload file."""
    with monkeypatch.context() as m:
        m.setattr(store_module, "check_plain", lambda state, uri: None)
        uri = store.save(step, {**state, "payload": TouchOnUnpickle(marker)}, **save)
    shard = save.get("shard")
    return Path(uri) / ("state.pt" if shard is None else f"shard-{shard.rank:05d}.pt")


def test_planted_pickle_in_the_newest_committed_checkpoint_is_refused_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec(tmp_path)
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == 0
    store = CheckpointStore(spec.output_uri + "/checkpoints")
    newest = store.latest()
    assert newest is not None and set(newest.state) >= {
        "state_dict",
        "optimizer_states",
        "loops",
        "callbacks",
        "hyper_parameters",
    }
    marker = tmp_path / "payload-ran"
    planted = plant(store, newest.step + 1, newest.state, marker, monkeypatch, epoch=newest.epoch)

    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == EXIT_BAD_CONFIG  # refused, not retried
    failure = json.loads((tmp_path / "run" / "failures" / "rank-0.json").read_text())
    assert failure["category"] == "config"
    assert f"checkpoint file {planted} contains pickled code or types outside the allow-list" in failure["error"]
    assert "posix.system" in failure["error"] and "tampered with" in failure["error"]
    assert not marker.exists()

    run_payload(planted.read_bytes())
    assert marker.exists()


def test_store_refuses_a_planted_checkpoint_on_every_read_without_falling_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(str(tmp_path / "checkpoints"), keep_last=5)
    store.save(1, {"w": torch.ones(2)}, best=True)
    marker = tmp_path / "payload-ran"
    planted = plant(store, 2, {"w": torch.zeros(2)}, marker, monkeypatch, best=True)
    sharded = plant(
        store, 3, {"w": torch.zeros(2)}, marker, monkeypatch, shard=ShardSpec(rank=0, world_size=1, token="t")
    )
    reads = {
        planted: [store.best, lambda: store.load("step-000000002")],
        sharded: [
            store.latest,
            lambda: store.load("step-000000003"),
            lambda: store.load("step-000000003", rank=0, world_size=1),
        ],
    }
    for path, calls in reads.items():
        for read in calls:
            with pytest.raises(UnsafeCheckpointError, match=f"checkpoint file {path} contains pickled code") as refused:
                read()
            assert refused.value.source == str(path)
    assert not marker.exists()

    run_payload(planted.read_bytes())
    assert marker.exists()


def test_verify_refuses_a_planted_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `trainyard reproduce` runs, before the retrain (`--check`) and after it (the comparison)."""
    original = CheckpointStore(str(tmp_path / "original"))
    marker = tmp_path / "payload-ran"
    planted = plant(original, 5, {"state_dict": {"w": torch.ones(2)}}, marker, monkeypatch, best=True)
    CheckpointStore(str(tmp_path / "rebuilt")).save(5, {"state_dict": {"w": torch.ones(2)}}, best=True)
    for args in (["--check", original.root_uri], [original.root_uri, str(tmp_path / "rebuilt")]):
        proc = subprocess.run(
            [sys.executable, "-m", "training.verify", *args], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        verdict = json.loads(proc.stdout.strip().splitlines()[-1])
        assert verdict["refused"] and not verdict["identical"]
        assert f"checkpoint file {planted} contains pickled code" in verdict["error"]
    assert not marker.exists()
    clean = subprocess.run([sys.executable, "-m", "training.verify", "--check", str(tmp_path / "rebuilt")], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0 and json.loads(clean.stdout.strip().splitlines()[-1])["ok"]

    run_payload(planted.read_bytes())
    assert marker.exists()


def test_distributed_checkpoint_metadata_is_read_as_data(tmp_path: Path) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    from training.strategies import full_state_dict

    dcp.save({"state_dict": {"w": torch.ones(3)}}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert torch.equal(full_state_dict(str(tmp_path / "ckpt"))["w"], torch.ones(3))
    marker = tmp_path / "payload-ran"
    metadata = tmp_path / "ckpt" / ".metadata"
    metadata.write_bytes(pickle.dumps(TouchOnUnpickle(marker)))
    with pytest.raises(
        UnsafeCheckpointError, match=r"\.metadata contains pickled code .*posix\.system is not on the allow-list"
    ):
        full_state_dict(str(tmp_path / "ckpt"))
    assert not marker.exists()

    pickle.loads(metadata.read_bytes())  # the control: what torch's own reader does
    assert marker.exists()


def test_state_a_resume_could_not_load_is_refused_at_save(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    with pytest.raises(
        CheckpointStateError,
        match=r"state\['hyper_parameters'\]\['root'\] is a pathlib.PosixPath, which a resume could not load",
    ):
        store.save(1, {"state_dict": {"w": torch.ones(1)}, "hyper_parameters": {"root": tmp_path}})
    assert store.list_committed() == [] and not (tmp_path / "checkpoints").exists()


def test_reproduce_refuses_a_planted_checkpoint_before_retraining(
    trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipelines.reproduce import ReproductionError, reproduce
    from trainyard import naming
    from trainyard.lineage import CHECKPOINT_URI_TAG

    harness, _ = trained
    champion = harness.resources["registry"].get_alias("test.digits", "champion")
    trial_dir = champion.tags[CHECKPOINT_URI_TAG].rstrip("/").rsplit("/", 2)[0]
    store = CheckpointStore(f"{trial_dir}/checkpoints", keep_last=10)
    best = store.best()
    assert best is not None
    marker = tmp_path / "payload-ran"
    planted = plant(store, best.step + 100, best.state, marker, monkeypatch, best=True)
    with pytest.raises(
        ReproductionError, match=f"test.digits@champion: checkpoint file {planted} contains pickled code"
    ):
        reproduce("test.digits@champion", harness.resources, pipeline=harness.spec)
    assert not marker.exists()
    reproductions = harness.resources["store"].uri(naming.REPRODUCTIONS, "test.digits")
    assert not harness.resources["store"].exists(reproductions)  # refused before any retraining


@pytest.mark.slow
def test_planted_shard_stops_every_rank_of_a_sharded_resume(tmp_path: Path) -> None:
    """fsdp over 2 processes: rank 1's shard of the newest checkpoint is replaced (manifest updated to match)."""
    spec = make_spec(
        tmp_path,
        model=ImportTarget(path="pipelines.vision.models:DigitsParallelMLP", kwargs={"hidden": 16, "lr": 0.02}),
        distribution=Distribution(procs_per_node=2, strategy="fsdp", max_restarts=1),
        checkpoint=CheckpointPolicy(every_n_steps=4, keep_last=2),
        max_epochs=1,
        batch_size=16,
    )
    LocalLauncher().launch(spec)
    newest = Path(CheckpointStore(spec.output_uri + "/checkpoints").list_committed()[0]["uri"])
    shard, manifest_file = newest / "shard-00001.pt", newest / "MANIFEST.json"
    marker = tmp_path / "payload-ran"
    payload = torch_payload(marker, torch.load(shard, weights_only=True))
    shard.write_bytes(payload)
    manifest = json.loads(manifest_file.read_text())
    manifest["files"][shard.name] = {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}
    manifest_file.write_text(json.dumps(manifest))

    with pytest.raises(TrainingConfigError, match=f"checkpoint file {shard} contains pickled code"):
        LocalLauncher().launch(spec)  # every rank stops (no rank waits forever for the one that refused)
    assert not marker.exists()

    run_payload(shard.read_bytes())
    assert marker.exists()
