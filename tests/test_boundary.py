"""The one import rule: pod-side `training/` never imports the orchestrator."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORCHESTRATION = {"dagster", "assets", "resources", "pipelines"}
# dagster_pipes is the protocol package for external processes; it does not depend on dagster.
ALLOWED_DAGSTER_PACKAGES = {"dagster_pipes"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
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


def test_training_imports_no_orchestration() -> None:
    assert violations(ROOT / "training") == []


def test_orchestration_imports_only_training_spec() -> None:
    bad = []
    for folder in ("assets", "resources", "pipelines"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "models.py":  # team model code is pod-side by design
                continue
            for line, module in imported_modules(path):
                if module.split(".")[0] == "training" and module != "training.spec":
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert bad == []


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
