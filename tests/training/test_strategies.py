"""DDP, FSDP2 and tensor parallel: real 2-process CPU training compared with one process.

The comparisons use full-batch gradient descent (every step sees all 210
training rows: one process with batch 210, two data-parallel ranks with 105
each, tensor-parallel ranks with 210 each), so sample order does not matter
and a sharded run computes the same function as the single-process run up to
floating-point summation order. Four Adam steps keep that rounding small:
weights agree to `ATOL` = 1e-6 absolutely (measured: under 1e-7).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from pipelines.vision.models import DigitsMLP, DigitsParallelMLP
from resources.launcher import LocalLauncher, TrainingConfigError
from tests.support.train_specs import make_spec
from training import entrypoint
from training.checkpointing import CheckpointStore
from training.errors import ConfigError
from training.parallel import ColwiseParallel, MLPClassifier, ParallelizableModule, RowwiseParallel
from training.spec import Distribution, ImportTarget
from training.strategies import (
    CheckedModelParallelStrategy,
    StrategyConfigError,
    check_model_supports,
    evaluation_model,
    full_state_dict,
    trainer_kwargs,
)

TRAIN_ROWS, STEPS, ATOL = 210, 4, 1e-6
HPARAMS = {"hidden": 16, "lr": 0.02}
PARALLEL = ImportTarget(path="pipelines.vision.models:DigitsParallelMLP", kwargs=HPARAMS)


def _spec(tmp: Path, per_rank_batch: int, **over):
    return make_spec(tmp, max_epochs=STEPS, batch_size=per_rank_batch, **over)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst <= ATOL, f"max |difference| {worst:.2e} > {ATOL}"


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Weights after STEPS full-batch steps of DigitsMLP in one process (no strategy)."""
    tmp = tmp_path_factory.mktemp("single")
    _spec(tmp, TRAIN_ROWS, model=ImportTarget(path="pipelines.vision.models:DigitsMLP", kwargs=HPARAMS))
    assert entrypoint.main(["--spec", str(tmp / "spec.json")]) == 0
    return committed_weights(tmp)


def committed_weights(tmp: Path) -> dict[str, torch.Tensor]:
    """Final weights of a run: the newest committed checkpoint (sharded ones merged in this process)."""
    latest = CheckpointStore(str(tmp / "run" / "checkpoints")).latest()
    assert latest is not None
    return latest.state["state_dict"]


# --- configuration: pure, no processes -------------------------------------------------------


def test_trainer_kwargs_per_strategy() -> None:
    assert trainer_kwargs(Distribution(), 1) == {"accelerator": "cpu", "devices": 1, "num_nodes": 1}
    ddp = trainer_kwargs(Distribution(procs_per_node=2), 2)["strategy"]
    assert type(ddp).__name__ == "DDPStrategy" and ddp.process_group_backend == "gloo"

    fsdp = trainer_kwargs(Distribution(procs_per_node=4, strategy="fsdp"), 4)["strategy"]
    assert isinstance(fsdp, CheckedModelParallelStrategy)
    assert (fsdp.data_parallel_size, fsdp.tensor_parallel_size, fsdp.process_group_backend) == (4, 1, "gloo")

    dist = Distribution(nodes=2, procs_per_node=4, strategy="tp", tensor_parallel_size=4, accelerator="gpu")
    kwargs = trainer_kwargs(dist, 8)
    tp = kwargs.pop("strategy")
    assert kwargs == {"accelerator": "gpu", "devices": 4, "num_nodes": 2}
    assert (tp.data_parallel_size, tp.tensor_parallel_size, tp.process_group_backend) == (2, 4, "nccl")
    # one process: nothing to shard
    assert "strategy" not in trainer_kwargs(Distribution(strategy="fsdp"), 1)


def test_world_size_mismatch_is_a_config_error() -> None:
    with pytest.raises(StrategyConfigError, match="launch with torchrun --nproc-per-node 2") as err:
        trainer_kwargs(Distribution(procs_per_node=2, strategy="fsdp"), 1)
    assert isinstance(err.value, ConfigError)


def test_mesh_must_divide_world_size() -> None:
    with pytest.raises(ValidationError, match="tensor_parallel_size=2 does not divide world size 3"):
        Distribution(procs_per_node=3, strategy="tp", tensor_parallel_size=2)
    with pytest.raises(ValidationError, match="needs strategy 'tp'"):
        Distribution(procs_per_node=2, strategy="fsdp", tensor_parallel_size=2)


def test_parallel_variant_is_the_same_model() -> None:
    torch.manual_seed(0)
    plain = DigitsMLP(hidden=16).state_dict()
    torch.manual_seed(0)
    parallel = DigitsParallelMLP(hidden=16).state_dict()
    assert plain.keys() == parallel.keys() and all(torch.equal(plain[k], parallel[k]) for k in plain)


def test_check_model_supports() -> None:
    fsdp = Distribution(procs_per_node=2, strategy="fsdp")
    tp = Distribution(procs_per_node=2, strategy="tp", tensor_parallel_size=2)
    for dist in (Distribution(procs_per_node=2), fsdp, tp):
        check_model_supports(DigitsParallelMLP(hidden=16), dist)
        check_model_supports(MLPClassifier(blocks=2), dist)
    check_model_supports(DigitsMLP(), Distribution(procs_per_node=2))

    with pytest.raises(
        StrategyConfigError,
        match=r"DigitsMLP does not support strategy 'fsdp': inherit training.parallel.ParallelizableModule;",
    ):
        check_model_supports(DigitsMLP(), fsdp)
    with pytest.raises(
        StrategyConfigError, match=r"DigitsMLP does not support strategy 'tp'.*implement tensor_parallel_plan\(\)"
    ):
        check_model_supports(DigitsMLP(), tp)

    class NoPlan(ParallelizableModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    check_model_supports(NoPlan(), fsdp)  # FSDP needs no plan
    with pytest.raises(
        StrategyConfigError, match=r"model NoPlan does not support strategy 'tp': tensor_parallel_plan\(\) is empty"
    ):
        check_model_supports(NoPlan(), tp)

    class BadKey(NoPlan):
        def tensor_parallel_plan(self):
            return {"net.0": ColwiseParallel(), "mlp.down": RowwiseParallel()}

    with pytest.raises(
        StrategyConfigError, match=r"BadKey: tensor_parallel_plan\(\) key 'mlp.down' matches no submodule"
    ):
        check_model_supports(BadKey(), tp)

    class NotLinear(NoPlan):
        def tensor_parallel_plan(self):
            return {"net.*": ColwiseParallel()}

    with pytest.raises(StrategyConfigError, match=r"key 'net.\*' names a ReLU"):
        check_model_supports(NotLinear(), tp)

    class ForeignUnit(NoPlan):
        def fsdp_units(self):
            return [nn.Linear(2, 2)]

    with pytest.raises(StrategyConfigError, match=r"fsdp_units\(\) must return proper submodules"):
        check_model_supports(ForeignUnit(), fsdp)


def test_full_state_dict_reads_a_distributed_checkpoint_in_one_process(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = DigitsMLP(hidden=8)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = {"state": {"net.0.weight": {"exp_avg": torch.ones(8, 64)}}}
    # the layout ModelParallelStrategy writes: weights and optimizer state in one DCP folder
    dcp.save({"state_dict": weights, "optimizer_0": optimizer}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    loaded = full_state_dict(str(tmp_path / "ckpt"))
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)

    fresh = evaluation_model(
        DigitsMLP(hidden=8), str(tmp_path / "ckpt"), rebuild=lambda: pytest.fail("unsharded model is reused")
    )
    assert all(torch.equal(fresh.state_dict()[k], weights[k]) for k in weights)


def test_tp_with_a_model_without_plan_fails_as_config_before_training(tmp_path: Path) -> None:
    spec = make_spec(
        tmp_path,
        model=ImportTarget(path="pipelines.vision.models:DigitsMLP", kwargs=HPARAMS),
        distribution=Distribution(procs_per_node=2, strategy="tp", tensor_parallel_size=2),
    )
    with pytest.raises(
        TrainingConfigError, match=r"model DigitsMLP does not support strategy 'tp'.*ParallelizableModule"
    ):
        LocalLauncher(timeout_seconds=120).launch(spec)
    # Both ranks raise it, but the first to fail stops the group (as torchrun's agent does): its peer may be
    # stopped before writing a record, or write one as a consequence. Every record of a rank's own failure says config.
    records = [json.loads(p.read_text()) for p in (tmp_path / "run" / "failures").glob("rank-*.json")]
    own = [r["category"] for r in records if not r["consequence"]]
    assert own and set(own) == {"config"}, records


# --- real training: 2 (or 4) CPU processes through torchrun -----------------------------------


def _exported_runs(run: Path) -> None:
    exported = torch.export.load(str(run / "model" / "model.pt2")).module()
    assert exported(torch.zeros(3, 64)).shape == (3, 10)


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(tmp_path: Path, single_process: dict[str, torch.Tensor]) -> None:
    spec = _spec(
        tmp_path,
        TRAIN_ROWS // 2,
        model=ImportTarget(path="pipelines.vision.models:DigitsMLP", kwargs=HPARAMS),
        distribution=Distribution(procs_per_node=2),
    )
    result = LocalLauncher(timeout_seconds=300).launch(spec).result
    assert result.world_size == 2 and result.global_step == STEPS
    _assert_close(committed_weights(tmp_path), single_process)


@pytest.mark.slow
def test_fsdp_two_processes_match_one_process(tmp_path: Path, single_process: dict[str, torch.Tensor]) -> None:
    spec = _spec(
        tmp_path, TRAIN_ROWS // 2, model=PARALLEL, distribution=Distribution(procs_per_node=2, strategy="fsdp")
    )
    result = LocalLauncher(timeout_seconds=300).launch(spec).result
    assert result.global_step == STEPS and result.train_samples == STEPS * TRAIN_ROWS
    newest = CheckpointStore(str(tmp_path / "run" / "checkpoints")).committed()[0][0]
    shards = sorted(p.name for p in (tmp_path / "run" / "checkpoints" / newest).glob("shard-*.pt"))
    assert shards == ["shard-00000.pt", "shard-00001.pt"]  # one shard per rank, committed by rank 0
    _assert_close(committed_weights(tmp_path), single_process)
    _exported_runs(tmp_path / "run")


@pytest.mark.slow
def test_tp_matches_the_unsharded_model(tmp_path: Path, single_process: dict[str, torch.Tensor]) -> None:
    # data_parallel_size 1: both ranks see the whole batch and each holds half of every split layer
    spec = _spec(
        tmp_path,
        TRAIN_ROWS,
        model=PARALLEL,
        distribution=Distribution(procs_per_node=2, strategy="tp", tensor_parallel_size=2),
    )
    result = LocalLauncher(timeout_seconds=300).launch(spec).result
    assert result.global_step == STEPS and result.train_samples == STEPS * TRAIN_ROWS
    _assert_close(committed_weights(tmp_path), single_process)
    _exported_runs(tmp_path / "run")


@pytest.mark.slow
def test_2d_fsdp_by_tp_on_four_processes_matches(tmp_path: Path, single_process: dict[str, torch.Tensor]) -> None:
    # data_parallel_size 2 x tensor_parallel_size 2
    dist = Distribution(procs_per_node=4, strategy="tp", tensor_parallel_size=2)
    spec = _spec(tmp_path, TRAIN_ROWS // 2, model=PARALLEL, distribution=dist)
    result = LocalLauncher(timeout_seconds=300).launch(spec).result
    assert result.world_size == 4 and result.global_step == STEPS
    _assert_close(committed_weights(tmp_path), single_process)
