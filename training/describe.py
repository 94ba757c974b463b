"""`python -m training.describe --spec REQUEST.json`: what the capacity planner needs to know of a trial's model.

The orchestrator plans a trial (`trainyard.planner.plan_trial`) before any
`TrainSpec` exists: it needs the model's parameter count, its FSDP units and
whether it can be sharded or tensor-parallel. Those come from instantiating
the team's model class with the trial's hyperparameters, which imports torch,
Lightning and the team's code: seconds of imports that a Dagster run worker
would otherwise pay on every trial. This module does it on the pod side, in a
process of its own: forked from a warm server that has those imports done
(`resources.model_facts` sends it there, the way trials start),
or a cold `python -m training.describe` when no warm server can take it.

The request is a JSON file:

    {"model": "pkg.module:Class", "hparams": {...}, "n_features": 4,
     "n_classes": 10 | null, "classification": true,
     "data_kwargs": {"vocab_size": 2048, "block_size": 128}, "answer": "/path/answer.json"}

and the answer, written atomically to `answer`, is one of:

- `{"facts": {"name", "params", "fsdp_units", "parallel", "tp_plan"}}`;
- `{"needs": "n_classes"}`: the constructor takes `n_classes`, the request
  did not give it and the hyperparameters do not set it (the caller counts the
  classes, which reads the data, only then);
- `{"error": "..."}`: the class cannot be imported, or rejects the
  hyperparameters; the planner fails the trial with this text.

The model is built as `training.lightning_task.build` builds it (`n_features`,
for classification `n_classes`, and each of `data_kwargs` filled in when the
constructor takes them and the hyperparameters do not set them), on torch's meta device so no weights are allocated; a
constructor that
reads a tensor's value back cannot run on meta tensors and is built for real.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from typing import Any, Optional

from common.atomic import atomic_write_bytes


class DescribeError(ValueError):
    """The model class cannot be imported, or rejects the hyperparameters."""


def build_meta(
    model_path: str,
    hparams: dict[str, Any],
    n_features: int,
    n_classes: Optional[int],
    classification: bool,
    data_kwargs: Optional[dict[str, Any]] = None,
) -> Any:
    """The trial's model on the meta device, or `None` when `n_classes` is needed and not given.

    Raises:
        DescribeError: the class cannot be imported, or its constructor rejects the arguments.
    """
    import torch

    module, _, attr = model_path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise DescribeError(f"model {model_path!r} cannot be imported: {e}") from e
    kwargs = dict(hparams)
    accepted = inspect.signature(cls.__init__).parameters
    if "n_features" in accepted and "n_features" not in kwargs:
        kwargs["n_features"] = n_features
    for name, value in (data_kwargs or {}).items():
        if name in accepted and name not in kwargs:
            kwargs[name] = value
    if classification and "n_classes" in accepted and "n_classes" not in kwargs:
        if n_classes is None:
            return None
        kwargs["n_classes"] = n_classes
    try:
        try:
            with torch.device("meta"):
                return cls(**kwargs)
        except (NotImplementedError, RuntimeError):
            # A constructor that reads a tensor's value back cannot run on meta tensors; pay for real weights.
            return cls(**kwargs)
    except TypeError as e:
        raise DescribeError(f"model {model_path!r} rejected hyperparameters {kwargs}: {e}") from e


def facts(model: Any) -> dict[str, Any]:
    """What the planner reads of a built model: parameters (each tied one once), FSDP units, parallel support.

    Raises:
        DescribeError: the class is not a torch module.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise DescribeError(f"model class {type(model).__name__} is not a torch.nn.Module")
    units = getattr(model, "fsdp_units", None)
    plan = getattr(model, "tensor_parallel_plan", None)
    parallel = callable(units) and callable(plan)
    return {
        "name": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),  # parameters() yields a shared (tied) Parameter once
        "fsdp_units": max(1, len(units())) if callable(units) else None,
        "parallel": parallel,
        "tp_plan": bool(plan()) if parallel and callable(plan) else False,
    }


def describe(request: dict[str, Any]) -> dict[str, Any]:
    """The answer to one request (see the module's docstring); never raises for a model's own mistakes."""
    try:
        model = build_meta(
            str(request["model"]),
            dict(request.get("hparams") or {}),
            int(request["n_features"]),
            request.get("n_classes"),
            bool(request.get("classification", True)),
            request.get("data_kwargs"),
        )
        if model is None:
            return {"needs": "n_classes"}
        return {"facts": facts(model)}
    except DescribeError as e:
        return {"error": str(e)}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.describe", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the request's JSON file (named --spec as a launch's is)")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        request = json.load(f)
    answer = describe(request)
    atomic_write_bytes(str(request["answer"]), json.dumps(answer).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
