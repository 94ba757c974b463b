"""The planner's model description runs on the pod side (`training.describe`): on a warm worker or a new interpreter.

Nothing here writes what it asserts: the facts come from the team's real model
class built in another process, compared with the same class built here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from resources.model_facts import describe_model
from trainyard.planner import ModelQuery, TrialPlanError

ROOT = Path(__file__).resolve().parents[2]


def _query(model: str = "pipelines.vision.models:DigitsMLP", hparams: dict | None = None, n_classes=lambda: 10,
           classification: bool = True, n_features: int = 64) -> ModelQuery:
    return ModelQuery(model, dict(hparams or {}), n_features, classification, n_classes)


@pytest.mark.slow
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_facts_are_those_of_the_model_built_here(warm: bool) -> None:
    from pipelines.vision.models import DigitsMLP, DigitsParallelMLP

    plain = describe_model(_query(hparams={"hidden": 32}), warm=warm)
    built = DigitsMLP(n_features=64, n_classes=10, hidden=32)
    assert (plain.name, plain.params, plain.fsdp_units, plain.parallel, plain.tp_plan) == (
        "DigitsMLP", sum(p.numel() for p in built.parameters()), None, False, False)
    parallel = describe_model(_query("pipelines.vision.models:DigitsParallelMLP"), warm=warm)
    model = DigitsParallelMLP(n_features=64, n_classes=10)
    assert (parallel.params, parallel.fsdp_units, parallel.parallel, parallel.tp_plan) == (
        sum(p.numel() for p in model.parameters()),
        max(1, len(model.fsdp_units())),
        True,
        bool(model.tensor_parallel_plan()),
    )


def test_classes_are_counted_only_when_the_constructor_needs_them() -> None:
    calls: list[int] = []

    def count() -> int:
        calls.append(1)
        return 7

    facts = describe_model(_query(n_classes=count))
    assert calls == [1] and facts.params == 64 * 64 + 64 + 64 * 7 + 7
    assert describe_model(
        _query(hparams={"n_classes": 3}, n_classes=count)
    ).params == 64 * 64 + 64 + 64 * 3 + 3 and calls == [1]
    # a regression model gets no n_classes, as training.lightning_task.build gives it none: the constructor's default
    # stays
    assert describe_model(
        _query(classification=False, n_classes=count)
    ).params == 64 * 64 + 64 + 64 * 10 + 10 and calls == [1]


def test_a_model_known_to_need_classes_gets_them_with_its_first_question(monkeypatch: pytest.MonkeyPatch) -> None:
    """After one description asked for `n_classes`, the next of the same model class is one question, not two."""
    from resources import model_facts

    asked: list[dict] = []
    real = model_facts._ask

    def ask(request: dict, tmp: Path, warm: bool):
        asked.append(dict(request))
        return real(request, tmp, warm)

    monkeypatch.setattr(model_facts, "_NEEDS_CLASSES", set())
    monkeypatch.setattr(model_facts, "_ask", ask)
    first = describe_model(_query(n_classes=lambda: 7))
    assert [a["n_classes"] for a in asked] == [None, 7]
    second = describe_model(_query(hparams={"hidden": 32}, n_classes=lambda: 7))
    assert [a["n_classes"] for a in asked[2:]] == [7]
    assert (first.params, second.params) == (64 * 64 + 64 + 64 * 7 + 7, 64 * 32 + 32 + 32 * 7 + 7)


@pytest.mark.slow
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_model_that_cannot_be_built_is_a_plan_error_naming_it(warm: bool) -> None:
    with pytest.raises(
        TrialPlanError,
        match=r"model 'pipelines.vision.nowhere:Net' cannot be imported: No module named 'pipelines.vision.nowhere'",
    ):
        describe_model(_query("pipelines.vision.nowhere:Net"), warm=warm)
    with pytest.raises(
        TrialPlanError, match=r"model 'pipelines.vision.models:DigitsMLP' rejected hyperparameters .*'depth': 3"
    ):
        describe_model(_query(hparams={"depth": 3}), warm=warm)


def test_a_describer_that_dies_is_a_plan_error_with_its_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dying_team.py").write_text(textwrap.dedent("""
        import os
        import torch

        class Net(torch.nn.Module):
            def __init__(self, n_features: int) -> None:
                super().__init__()
                print("about to die", flush=True)
                os._exit(3)
    """))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(
        TrialPlanError, match=r"model 'dying_team:Net' could not be described for planning: exit status \d+;"
    ) as err:
        describe_model(_query("dying_team:Net"))
    assert "about to die" in str(err.value)


def test_an_edit_to_team_code_is_seen_by_the_next_description(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = textwrap.dedent("""
        import torch

        class Net(torch.nn.Module):
            def __init__(self, n_features: int) -> None:
                super().__init__()
                self.layer = torch.nn.Linear(n_features, {width})
    """)
    module = tmp_path / "edited_team.py"
    module.write_text(source.format(width=2))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert describe_model(_query("edited_team:Net", n_features=5)).params == 5 * 2 + 2
    module.write_text(source.format(width=3))
    assert describe_model(_query("edited_team:Net", n_features=5)).params == 5 * 3 + 3


def test_the_caller_never_imports_torch(tmp_path: Path) -> None:
    """The point of describing elsewhere: a Dagster run worker planning a trial pays none of torch's imports."""
    code = textwrap.dedent("""
        import json, sys
        from resources.model_facts import describe_model
        from trainyard.planner import ModelQuery
        facts = describe_model(ModelQuery("pipelines.vision.models:DigitsMLP", {}, 64, True, lambda: 10))
        print(json.dumps({"params": facts.params, "torch": "torch" in sys.modules,
                          "lightning": "lightning" in sys.modules}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "params": 64 * 64 + 64 + 64 * 10 + 10,
        "torch": False,
        "lightning": False,
    }


def test_a_warm_request_runs_only_the_platform_programs() -> None:
    from training.warm_protocol import Request

    base = {"env": {}, "cwd": "/", "spec_uri": "/s.json", "max_restarts": 0, "run_id": "r"}
    assert Request.parse(json.dumps(base).encode()).entry == "training.entrypoint"  # a launcher of before the field
    assert Request.parse(json.dumps({**base, "entry": "training.describe"}).encode()).entry == "training.describe"
    with pytest.raises(
        ValueError,
        match=r"request field 'entry' must be one of \['training.entrypoint', 'training.describe'\], got 'os'",
    ):
        Request.parse(json.dumps({**base, "entry": "os"}).encode())
