"""The serving smoke test's child process: load a model with only serving dependencies, predict.

Run by `resources.registry.serving.run_smoke_test` as
`python -I <this file> <request.json>`: isolated mode puts neither the working
directory nor PYTHONPATH on `sys.path`, so trainyard itself is not importable,
and `ServingImageOnly` makes the training-only packages named in the request
unimportable too, as in a serving image that has mlflow, torch, numpy and
pandas and nothing of the training stack. That is also why it runs as a file
rather than `python -m resources.registry.smoke`: `-m` would import the
`resources` package (and Dagster) first. Hence: standard library only at the
top; mlflow and numpy are imported after the blocker is installed.
For the same reason the registry's error translation borrows `exception_chain`
from here rather than the other way round.

The request (JSON) holds `model_uri`, `blocked` (top-level package names),
`samples` (`{name: {"columns": [...], "data": [[...], ...]}}`, each the
`dataframe_split` body a client would post to `/invocations`), `params` (per
sample, the predict params to send with it, e.g. a language model's
`{"output": "token_nll"}`; absent: none), `generate` (a language model's
`{"prompt_tokens": [...], "max_new_tokens": n}`: its greedy continuation is
reported as `generated`; absent: none) and `output`, the
path the result JSON is written to: `blocked_imports`, and either
`load_seconds`, `run_id`, `predictions` (per sample, plus `input_example`) and
`probabilities` (per sample, the served `proba_<label>` columns, when there are any),
or `error`, `error_types` (the exception chain's type names) and `traceback`.

A model whose files hold pickled code is refused while loading (MLflow's
pickle opt-in is forced off here; `training/serving_model.py` checks the
exported program before torch reads it): the result's `error` says so, and
nothing in the files ran.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import time
import traceback
from typing import Any, Optional, Sequence

SCRIPT = os.path.abspath(__file__)
"""The file the serving process runs (`python -I SCRIPT request.json`)."""


class ServingImageOnly(importlib.abc.MetaPathFinder):
    """An import hook that refuses `blocked` top-level packages and records each attempt.

    Args:
        blocked: Top-level package names a serving image does not have.
        attempts: Receives the full name of every refused import.
    """

    def __init__(self, blocked: frozenset[str], attempts: list[str]) -> None:
        self.blocked = blocked
        self.attempts = attempts

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None, target: Any = None) -> None:
        """Refuses a blocked module; returns None (let the next finder look) for any other."""
        if fullname.partition(".")[0] in self.blocked:
            self.attempts.append(fullname)
            raise ModuleNotFoundError(f"No module named {fullname!r} (not a serving dependency)", name=fullname)
        return None


def predict_all(request: dict[str, Any], out: dict[str, Any]) -> None:
    """Loads `request["model_uri"]` and predicts on its input example and each sample.

    Fills `out` as it goes (`load_seconds`, `run_id`, then `predictions`), so a
    model that loads but fails to predict still reports what it loaded.

    Each sample is a `dataframe_split` request body and is read as MLflow's
    scoring server reads a JSON request (`infer_and_parse_data` with the
    model's input schema: JSON numbers are cast to the types the signature
    declares), so a sample passes here exactly when the same body would be
    served.

    Raises:
        ValueError: The model was logged without an input example.
    """
    started = time.perf_counter()
    import mlflow.pyfunc
    import numpy as np
    from mlflow.pyfunc.scoring_server import infer_and_parse_data

    model = mlflow.pyfunc.load_model(request["model_uri"])
    out["load_seconds"] = time.perf_counter() - started
    out["run_id"] = model.metadata.run_id
    example = model.input_example
    if example is None:
        raise ValueError("the model was logged without an input example")
    predictions = {"input_example": np.asarray(served_values(model.predict(example))).tolist()}
    probabilities: dict[str, dict[str, list[float]]] = {}
    schema = model.metadata.get_input_schema()
    for name, sample in request["samples"].items():
        frame = infer_and_parse_data({"dataframe_split": sample}, schema)
        params = request.get("params", {}).get(name)
        output = model.predict(frame, params=params) if params else model.predict(frame)
        predictions[name] = np.asarray(served_values(output)).tolist()
        probabilities[name] = served_probabilities(output)
    out["predictions"] = predictions
    out["probabilities"] = {k: v for k, v in probabilities.items() if v}
    wanted = request.get("generate")
    if wanted:  # a language model continues a prompt, as a user's process would (`training.serving_model.generate`)
        text = model.unwrap_python_model().generate(list(wanted["prompt_tokens"]), int(wanted["max_new_tokens"]))
        out["generated"] = {"prompt_tokens": list(wanted["prompt_tokens"]), "text": text}


def served_values(output: Any) -> Any:
    """One prediction per row from a served model's output.

    `training/serving_model.py` returns a frame: the kept id/timestamp columns, the
    target (labels or values), then `proba_<label>` per class; the target is its
    last column not named `proba_*`. Anything else (a model logged before the
    frame, a plain array) is returned as it is.
    """
    columns = getattr(output, "columns", None)
    if columns is None:
        return output
    names = [c for c in columns if not str(c).startswith("proba_")]
    return output[names[-1]] if names else output


def served_probabilities(output: Any) -> dict[str, list[float]]:
    """The `proba_<label>` columns of a served frame, in its order (empty: none, or not a frame)."""
    columns = getattr(output, "columns", None)
    if columns is None:
        return {}
    return {str(c): [float(v) for v in output[c].tolist()] for c in columns if str(c).startswith("proba_")}


def exception_chain(error: BaseException) -> list[BaseException]:
    """`error`, then its cause (or context), and so on, each once."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def describe_failure(error: BaseException) -> dict[str, Any]:
    """`error`, `error_types` (the whole cause/context chain) and `traceback` of a failure."""
    chain = exception_chain(error)
    return {
        "error": f"{type(chain[0]).__name__}: {chain[0]}"[:4000],
        "error_types": [type(x).__name__ for x in chain],
        "traceback": traceback.format_exc()[-4000:],
    }


def main(argv: Sequence[str]) -> int:
    """Serves the request at `argv[0]` and writes its result; always exits 0 once the result is written."""
    with open(argv[0], encoding="utf-8") as f:
        request = json.load(f)
    attempts: list[str] = []
    sys.meta_path.insert(0, ServingImageOnly(frozenset(request["blocked"]), attempts))
    # trainyard logs no pickled model: MLflow's opt-in to unpickling one stays off here, whatever the parent set.
    os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = "false"
    out: dict[str, Any] = {"blocked_imports": attempts}
    try:
        predict_all(request, out)
    except BaseException as e:  # anything, even SystemExit from a model, is a failed smoke test
        out.update(describe_failure(e))
    with open(request["output"], "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
