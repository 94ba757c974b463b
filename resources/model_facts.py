"""The capacity planner's model description, run on the pod side: on a warm worker, or in a fresh interpreter.

`trainyard.planner.plan_trial` needs a trial's parameter count and parallel
support before it launches anything. Building the model to count them imports
torch, Lightning and the team's code, which cost a Dagster run worker about 5 s
of imports on every trial (a run worker is a fresh process per run). The
orchestrator imports no pod code, so it sends the question to
`training.describe` in a process of its own:

- on the warm worker server one-process trials start on (`resources.warm`):
  a fork of a process that has the imports done answers in tens of
  milliseconds, and the server stays up for the next trial's description
  (and its training, when it is a one-process trial);
- where no warm server can take it (warm workers off, not Linux, a server
  that cannot start), in `python -m training.describe`: a cold interpreter,
  which costs what the run worker's own imports used to.

Either way the team's model module is imported after the fork or in the new
interpreter, so an edit to it is always seen, and the run worker itself never
imports torch for planning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from resources.warm import WarmUnavailable, launch_warm, training_env, warm_workers_enabled
from trainyard.planner import ModelFacts, ModelQuery, TrialPlanError

DESCRIBE_TIMEOUT_SECONDS = 300.0
WARM_IDLE_SECONDS = 300.0
WARM_START_TIMEOUT_SECONDS = 180.0
OUTPUT_LINES = 20
_NEEDS_CLASSES: set[str] = set()  # model classes (`module:attribute`) whose description asked for `n_classes`


def _ask(request: dict[str, Any], tmp: Path, warm: bool) -> tuple[Optional[dict[str, Any]], str]:
    """Run one description; (its answer or None, why not: its status and output's last lines)."""
    request_path, answer_path, output_path = tmp / "request.json", tmp / "answer.json", tmp / "output.log"
    answer_path.unlink(missing_ok=True)
    request_path.write_text(json.dumps({**request, "answer": str(answer_path)}))
    env = {
        **training_env(os.environ),
        "PYTHONUNBUFFERED": "1",
    }  # OMP_NUM_THREADS 1 unless set (`resources.warm.LOAD_DEFAULTS`)
    how = "cold"
    with open(output_path, "wb") as out:
        proc: Any = None
        if warm:
            try:
                proc = launch_warm(
                    env,
                    str(request_path),
                    0,
                    out.fileno(),
                    python=sys.executable,
                    idle_seconds=WARM_IDLE_SECONDS,
                    start_timeout=WARM_START_TIMEOUT_SECONDS,
                    entry="training.describe",
                )
                how = "warm"
            except WarmUnavailable as e:
                out.write(
                    f"[trainyard.model_facts] warm workers unavailable, describing the model in a new interpreter: "
                    f"{e}\n".encode()
                )
                out.flush()
        try:
            if proc is None:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "training.describe", "--spec", str(request_path)],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            status = proc.wait(DESCRIBE_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            if how == "cold":
                proc.kill()
                proc.wait()
            else:
                proc.stop(5.0)
            status = f"none: stopped after {DESCRIBE_TIMEOUT_SECONDS:.0f} s"
    output = output_path.read_text(errors="replace").splitlines()
    tail = "\n".join(output[-OUTPUT_LINES:])
    if status == 0 and answer_path.exists():
        return json.loads(answer_path.read_text()), tail
    return None, f"exit status {status}; last output:\n{tail}"


def describe_model(query: ModelQuery, *, warm: bool = True) -> ModelFacts:
    """The facts of `query`'s model, built by `training.describe` on a warm worker or in a new interpreter.

    Args:
        query: the model and its arguments; `query.n_classes()` is called only if the constructor needs it.
        warm: use a warm worker unless `TRAINYARD_WARM_WORKERS` turns them off (False: always a new interpreter).

    Raises:
        TrialPlanError: the model cannot be imported or rejects its arguments (the pod side's message), or the
            description failed (its output's last lines).
    """
    warm = warm and warm_workers_enabled(os.environ)
    # A model class found to need `n_classes` gets it with its first question from then on (a run that goes on with
    # the sweep describes one model per trial): one description instead of two, 0.1 s a trial on a warm worker.
    known = query.model in _NEEDS_CLASSES and query.classification and "n_classes" not in query.hparams
    request: dict[str, Any] = {
        "model": query.model,
        "hparams": query.hparams,
        "n_features": query.n_features,
        "n_classes": int(query.n_classes()) if known else None,
        "classification": query.classification,
        "data_kwargs": dict(query.data_kwargs),
    }
    with tempfile.TemporaryDirectory(prefix="trainyard-describe-") as tmp:
        answer, detail = _ask(request, Path(tmp), warm)
        if answer is not None and answer.get("needs") == "n_classes":
            _NEEDS_CLASSES.add(query.model)
            answer, detail = _ask({**request, "n_classes": int(query.n_classes())}, Path(tmp), warm)
    if answer is None:
        raise TrialPlanError(f"model {query.model!r} could not be described for planning: {detail}")
    if "error" in answer:
        raise TrialPlanError(str(answer["error"]))
    facts = answer["facts"]
    return ModelFacts(name=str(facts["name"]), params=int(facts["params"]), fsdp_units=facts.get("fsdp_units"),
                      parallel=bool(facts["parallel"]), tp_plan=bool(facts["tp_plan"]))
