"""The import rules between pod and orchestrator.

Pod-side `training/` never imports the orchestrator; the orchestrator imports only
the modules of it that `TRAINING_FOR_ORCHESTRATION` allows (the contract, the shards' format and the metrics); the
shared utilities (retry, atomic writes, settings) are not pod-side: they live in `common/`, below both. Team model code
(whatever a `ModelSpec.path` or
`datamodule` of a code location's pipeline names) is pod-side: it runs in the
trainer image, so it must import with Dagster absent. (tests/deploy/test_trainer_image.py
checks the same code against the trainer image's declared requirements and trains it
in an environment built like the image.)
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from trainyard.spec import PipelineSpec

ROOT = Path(__file__).resolve().parent.parent
ORCHESTRATION = {"dagster", "assets", "resources", "instance", "pipelines"}
# dagster_pipes is the protocol package for external processes; it does not depend on dagster.
ALLOWED_DAGSTER_PACKAGES = {"dagster_pipes"}
# What the orchestrator may use of `training/`: the contract, the shards' format and the metrics. The shared utilities
# (retry, atomic writes, settings) are in `common/`, the bottom package both sides import, not here.
# An allow-list: a module of `training/` not named here is pod-side, and the orchestrator (every module of `assets/`,
# `instance/`,
# `resources/`, `trainyard/` and `pipelines/` but team model code) never imports it.
TRAINING_FOR_ORCHESTRATION = {
    "training.spec",  # the contract: TrainSpec, TrainResult, the exit codes
    # the contract's checkpoint, watchdog and fault-injection settings (training.spec re-exports them)
    "training.spec_policies",
    "training.shard_format",  # the shards' on-disk format, which landing writes and the pod reads
    # the metrics the pod reports, computed the same way on served predictions (trainyard.promotion)
    "training.metrics",
}

# Run in a fresh interpreter: a meta-path finder that refuses Dagster (every
# `dagster` and `dagster_*` package but the protocol package), then each target.
_BLOCKED_IMPORT_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys

    class NoDagster:
        def find_spec(self, name, path=None, target=None):
            top = name.split(".")[0]
            if (top == "dagster" or top.startswith("dagster_")) and top != "dagster_pipes":
                raise ImportError(f"{name} is blocked: pod-side code must import without Dagster")
            return None

    sys.meta_path.insert(0, NoDagster())
    try:
        import dagster  # noqa: F401
    except ImportError:
        pass
    else:
        sys.exit("the Dagster blocker did not block `import dagster`")
    failures = {}
    for target in json.loads(sys.argv[1]):
        module, _, attr = target.partition(":")
        try:
            getattr(importlib.import_module(module), attr)
        except Exception as e:
            failures[target] = f"{type(e).__name__}: {e}"
    loaded = sorted(m for m in sys.modules if m == "dagster" or (m.startswith("dagster_") and m != "dagster_pipes"))
    print(json.dumps({"failures": failures, "dagster_modules": loaded}))
    """
)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from training import shard_format` imports the module training.shard_format
            package = ROOT / node.module.replace(".", "/")
            subs = [
                f"{node.module}.{a.name}"
                for a in node.names
                if (package / f"{a.name}.py").exists() or (package / a.name).is_dir()
            ]
            found += [(node.lineno, m) for m in subs] or [(node.lineno, node.module)]
    return found


def violations(package: Path) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top in ALLOWED_DAGSTER_PACKAGES:
                continue
            if top in ORCHESTRATION or top.startswith("dagster_"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


def team_locations() -> dict[str, str]:
    """Code locations that serve a team's pipelines (their definitions call `team_definitions`): location name -> team
    package."""
    out = {}
    for entry in yaml.safe_load((ROOT / "workspace.yaml").read_text())["load_from"]:
        module = entry["python_module"]["module_name"]
        source = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        calls = {n.func.id for n in ast.walk(source) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        if "team_definitions" in calls:
            out[entry["python_module"]["location_name"]] = module.rsplit(".", 1)[0]
    return out


def pod_side_specs() -> dict[str, PipelineSpec]:
    """Every pipeline whose trials can run: those the code locations serve (`pipelines.catalog`), and those a
    spec-only team module declares (`pipelines/<team>/team.py`, `pipelines.team.declared_specs`), by key."""
    from pipelines.catalog import all_pipelines, team_module_name
    from pipelines.team import declared_specs

    specs = dict(all_pipelines())
    teams = {spec.key.split("/")[0] for spec in specs.values()}
    missing = {loc: pkg for loc, pkg in team_locations().items() if pkg.split(".")[-1] not in teams}
    assert not missing, f"code locations {missing} serve no pipeline the catalog finds"
    for team_file in sorted((ROOT / "pipelines").glob("*/team.py")):
        for spec in declared_specs(importlib.import_module(team_module_name(team_file.parent.name)))[1]:
            specs.setdefault(spec.key, spec)
    return dict(sorted(specs.items()))


def pod_side_targets() -> dict[str, list[str]]:
    """Every `ModelSpec.path` and `datamodule` of every pipeline of every team (`pod_side_specs`), by pipeline key."""
    return {key: [spec.model.path, spec.model.datamodule] for key, spec in pod_side_specs().items()}


def test_training_imports_no_orchestration() -> None:
    assert violations(ROOT / "training") == []


def test_orchestration_imports_only_the_training_contract_and_utilities() -> None:
    # Modules a spec names as model or data module are pod-side by declaration (the
    # test below imports them with Dagster blocked); every other module is orchestration.
    pod_side = {target.partition(":")[0] for targets in pod_side_targets().values() for target in targets}
    bad = []
    for folder in ("assets", "resources", "instance", "trainyard", "pipelines"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if ".".join(path.relative_to(ROOT).with_suffix("").parts) in pod_side:
                continue
            for line, module in imported_modules(path):
                if module.split(".")[0] == "training" and module not in TRAINING_FOR_ORCHESTRATION:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert bad == []


def test_pod_side_code_of_every_code_location_imports_without_dagster() -> None:
    by_pipeline = pod_side_targets()
    assert {"vision/digits", "tabular/breast_cancer", "language/precedence"} <= set(by_pipeline)
    targets = sorted({t for ts in by_pipeline.values() for t in ts})
    assert "pipelines.language.models:SequenceTransformer" in targets and "lightgbm:train" in targets
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT_SCRIPT, json.dumps(targets)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"failures": {}, "dagster_modules": []}


def test_dagster_blocker_catches_a_model_that_imports_dagster(tmp_path: Path) -> None:
    (tmp_path / "leaky_models.py").write_text("import dagster\n\nclass Model:\n    pass\n")
    (tmp_path / "pipes_models.py").write_text("import dagster_pipes\n\nclass Model:\n    pass\n")
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT_SCRIPT, json.dumps(["leaky_models:Model", "pipes_models:Model"])],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(report["failures"]) == ["leaky_models:Model"]
    assert "dagster is blocked" in report["failures"]["leaky_models:Model"]


def test_rule_detects_a_violation(tmp_path: Path) -> None:
    pkg = tmp_path / "training"
    pkg.mkdir()
    (pkg / "bad.py").write_text("import os\nfrom dagster import asset\nimport dagster_k8s\nimport dagster_pipes\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert violations(pkg) == ["training/bad.py:2 imports dagster", "training/bad.py:3 imports dagster_k8s"]
    finally:
        ROOT = old
