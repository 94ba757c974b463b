"""The local launcher: real torchrun processes on CPU with gloo."""

from __future__ import annotations

from pathlib import Path

import pytest

from resources.launcher import (
    InfrastructureError,
    LocalLauncher,
    TrainingCodeError,
    TrainingConfigError,
    outcome_error,
    torchrun_command,
)
from tests.training.test_entrypoint import make_spec
from training.spec import Distribution, FaultInjection, ImportTarget


def test_torchrun_command_single_node(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, distribution=Distribution(procs_per_node=2, max_restarts=1))
    assert torchrun_command(spec, "/x/spec.json", python="py") == [
        "py", "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
        "--standalone", "-m", "training.entrypoint", "--spec", "/x/spec.json",
    ]


def test_torchrun_command_multi_node_needs_master(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, distribution=Distribution(nodes=2, procs_per_node=1))
    with pytest.raises(ValueError, match="needs master_addr and node_rank"):
        torchrun_command(spec, "s")
    cmd = torchrun_command(spec, "s", python="py", node_rank="$(JOB_COMPLETION_INDEX)", master_addr="job-0.svc", master_port=29400)
    assert cmd[5:9] == ["--max-restarts=0", "--node-rank=$(JOB_COMPLETION_INDEX)", "--master-addr=job-0.svc", "--master-port=29400"]


def test_outcome_mapping() -> None:
    assert isinstance(outcome_error(1, [{"category": "config", "rank": 1, "error": "e"}], "", "t"), TrainingConfigError)
    user = outcome_error(1, [{"category": "user", "rank": 1, "error": "boom", "traceback": "TB"}], "", "t")
    assert isinstance(user, TrainingCodeError) and not user.retryable and "rank 1 raised boom" in str(user) and "TB" in str(user)
    infra = outcome_error(-9, [], "last line", "t")
    assert isinstance(infra, InfrastructureError) and infra.retryable and "last line" in str(infra)


def test_two_process_ddp_trains(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, distribution=Distribution(procs_per_node=2))
    outcome = LocalLauncher().launch(spec)
    assert outcome.result.world_size == 2
    assert outcome.result.train_samples == 2 * 210
    log = Path(outcome.log_uri).read_text()
    assert "[default0]" in log and "[default1]" in log


@pytest.mark.slow
def test_exception_on_one_rank_is_terminal_with_its_traceback(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, distribution=Distribution(procs_per_node=2), faults=FaultInjection(raise_at_step=2))
    with pytest.raises(TrainingCodeError) as err:
        LocalLauncher().launch(spec)
    assert "injected fault at step 2" in str(err.value)
    assert "Traceback" in str(err.value)


@pytest.mark.slow
def test_bad_import_path_is_config_error(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, model=ImportTarget(path="pipelines.vision.models:NoSuchModel"), distribution=Distribution(procs_per_node=2))
    with pytest.raises(TrainingConfigError, match="has no attribute 'NoSuchModel'"):
        LocalLauncher().launch(spec)


def test_timeout_stops_the_launch(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    with pytest.raises(InfrastructureError, match="no result after 1 s"):
        LocalLauncher(timeout_seconds=1).launch(spec)
