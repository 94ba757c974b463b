"""The serving smoke test, parent side: run `resources.registry.smoke` in a fresh process, read its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from resources.registry.errors import RegistryUnavailable
from resources.registry.smoke import SCRIPT

if TYPE_CHECKING:
    import pandas as pd

TRAINING_ONLY_MODULES: tuple[str, ...] = (
    "assets", "resources", "pipelines", "training",  # trainyard itself
    "dagster", "dagster_pipes", "dagster_k8s", "dagster_webserver",
    "lightning", "pytorch_lightning", "optuna", "wandb",
    "great_expectations", "dvc", "kubernetes",
)
"""Top-level packages a serving image does not have; `smoke_test` makes them unimportable."""

# Error types that, raised inside the smoke-test process, mean the registry or
# artifact store could not be reached rather than that the model is broken.
_TRANSPORT_ERROR_NAMES = frozenset({
    "ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "RetryError",
    "MaxRetryError", "NewConnectionError", "EndpointConnectionError",
    "ConnectTimeoutError", "OperationalError", "TimeoutError", "ConnectionRefusedError",
})


@dataclass(frozen=True)
class SmokeResult:
    """What a fresh serving process did with a model.

    Attributes:
        model_uri: The URI the process loaded (e.g. `models:/vision.digits@challenger`).
        run_id: MLflow run of the model it actually loaded (None if loading failed).
        predictions: Per sample name, one prediction per row; `input_example` holds
            the predictions on the input example logged with the model.
        load_seconds: Time to load the model inside the process.
        seconds: Wall time of the whole process, start to exit.
        blocked_imports: Training-only modules something tried to import (each failed).
        error: Why the process failed to load or predict; None when it succeeded.
        probabilities: Per sample name, the served `proba_<label>` columns (`{column: [p, ...]}`,
            the model's class order); empty for a regression or a version that serves labels only.
        generated: A language model asked to continue a prompt: `{"prompt_tokens": [...], "text": continuation}`.
    """

    model_uri: str
    run_id: Optional[str]
    predictions: dict[str, list[Any]]
    load_seconds: Optional[float]
    seconds: float
    blocked_imports: tuple[str, ...] = ()
    error: Optional[str] = None
    probabilities: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    generated: Optional[dict[str, Any]] = None

    @property
    def passed(self) -> bool:
        """True when the process loaded the model and predicted on every sample."""
        return self.error is None


def client_payload(frame: "pd.DataFrame") -> dict[str, Any]:
    """`frame` as a JSON client sends it to a served model: MLflow's `dataframe_split` body, `columns` and `data`.

    Each value keeps its own column's type (an int column's values are JSON
    integers, a float column's are floats), as a client that builds its rows
    per field writes them. `frame.to_numpy()` would not: a frame mixing int
    and float columns becomes one float array, and a model whose signature
    declares an integer column would be sent `3.0` where a client sends `3`.
    Dates and times are sent as ISO 8601 text, as JSON has no date type, and a
    missing date or time as null.
    """
    split = frame.to_dict(orient="split", index=False)
    rows = [[_json_value(v) for v in row] for row in split["data"]]
    return {"columns": [str(c) for c in split["columns"]], "data": rows}


def _json_value(value: Any) -> Any:
    """A cell as a JSON client writes it: dates and times as ISO 8601 text, pandas' missing date (NaT) as null."""
    import datetime as dt

    import pandas as pd

    if value is pd.NaT:
        return None
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    return value


def smoke_request(model_uri: str, samples: Mapping[str, "pd.DataFrame"], blocked_modules: Sequence[str], output: str,
                  params: Optional[Mapping[str, Mapping[str, Any]]] = None,
                  generate: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The JSON request `smoke.main` reads: each sample frame as the `dataframe_split` body a client would send,
    and the predict params of the samples that have them (a language model's `{"output": "token_nll"}`)."""
    request = {
        "model_uri": model_uri,
        "blocked": sorted(set(blocked_modules)),
        "output": output,
        "samples": {name: client_payload(frame) for name, frame in samples.items()},
    }
    sent = {name: dict(p) for name, p in (params or {}).items() if name in samples and p}
    if sent:
        request["params"] = sent
    if generate:
        request["generate"] = dict(generate)
    return request


def run_smoke_test(
    tracking_uri: str,
    model_uri: str,
    samples: Mapping[str, "pd.DataFrame"],
    *,
    timeout_s: float,
    blocked_modules: Sequence[str],
    params: Optional[Mapping[str, Mapping[str, Any]]] = None,
    generate: Optional[Mapping[str, Any]] = None,
) -> SmokeResult:
    """Runs `smoke.py` as `python -I` against `tracking_uri` and reads back what it did (`params`: per sample,
    `generate`:
    a language model's prompt, see `smoke_request`).

    Returns:
        What happened; `passed` is False (with `error`) when the model could not
        be loaded or predict, or the process timed out or wrote no result.

    Raises:
        RegistryUnavailable: The process could not reach the registry or the
            artifact store (retryable; says nothing about the model).
    """
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trainyard-smoke-") as scratch:
        request = smoke_request(
            model_uri, samples, blocked_modules, os.path.join(scratch, "result.json"), params, generate
        )
        request_path = os.path.join(scratch, "request.json")
        with open(request_path, "w", encoding="utf-8") as f:
            json.dump(request, f)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["MLFLOW_TRACKING_URI"] = tracking_uri
        env["MLFLOW_REGISTRY_URI"] = tracking_uri
        try:
            proc = subprocess.run(
                [sys.executable, "-I", SCRIPT, request_path],
                cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return SmokeResult(
                model_uri, None, {}, None, time.perf_counter() - started,
                error=f"serving process did not finish within {timeout_s:.0f}s",
            )
        seconds = time.perf_counter() - started
        try:
            with open(request["output"], encoding="utf-8") as f:
                out = json.load(f)
        except (OSError, json.JSONDecodeError):
            return SmokeResult(
                model_uri, None, {}, None, seconds,
                error=f"serving process exited with {proc.returncode} and wrote no result: "
                f"{proc.stderr.strip()[-1500:]}",
            )
    error = out.get("error")
    if error and _TRANSPORT_ERROR_NAMES.intersection(out.get("error_types", [])):
        raise RegistryUnavailable(
            f"smoke test of {model_uri!r}: the serving process could not reach the registry: {error}"
        )
    return SmokeResult(
        model_uri=model_uri,
        run_id=out.get("run_id"),
        predictions=out.get("predictions", {}),
        load_seconds=out.get("load_seconds"),
        seconds=seconds,
        blocked_imports=tuple(out.get("blocked_imports", ())),
        error=error,
        probabilities=out.get("probabilities", {}),
        generated=out.get("generated"),
    )
