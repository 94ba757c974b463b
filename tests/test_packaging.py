"""What a non-editable install gets: the wheel holds every package and every file the code reads, and no module
finds a root through `__file__` (trainyard/project.py says where each kind of file is found instead).

The wheel is built offline from the files a clone would have (`git ls-files`, plus files not yet added), with
the interpreter's own setuptools, in a copy: nothing is written into the checkout.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.lineage_repo import checkout

ROOT = Path(__file__).resolve().parents[1]

NOT_SHIPPED = {
    "tests": "the test suite, run from a checkout",
    "bench": "the benchmarks, run from a checkout (`make bench`)",
}
"""Top-level packages of the repository that the wheel leaves out, each with its reason."""

FILE_USES = {
    ("instance/zygote.py", 'getattr(module, "__file__", None)'):
        "the warm run launcher watches every loaded module's file for edits (to fall back to a fresh process); "
        "it reads files, it finds no root",
    ("resources/registry/smoke.py", "SCRIPT = os.path.abspath(__file__)"):
        "the serving smoke test runs this module's own file in isolated mode (`python -I <file>`): `-m` would import "
        "resources.registry (mlflow, Dagster) before the import blocker that stands in for a serving image",
    ("training/warm_supervisor.py", "sys.argv = [str(program.__file__)"):
        "a trial forked from the warm server gets the argv[0] `python -m training.entrypoint` would give it "
        "(the module's file); it finds no root",
}
"""The only `__file__` reads allowed in shipped modules: (module path, its source line's text) -> why it is no root."""


def source_files() -> list[str]:
    """The repository's files as a clone has them, plus new ones not yet added (git's ignore rules apply)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (ROOT / f).is_file()})


def shipped_packages(files: list[str]) -> list[str]:
    """Every package directory (one with `__init__.py`) under a top-level package, but those in NOT_SHIPPED."""
    found = {str(Path(f).parent) for f in files if Path(f).name == "__init__.py" and len(Path(f).parts) > 1}
    tops = {p for p in found if "/" not in p}
    assert set(NOT_SHIPPED) <= tops, f"NOT_SHIPPED names packages the repository lacks: {set(NOT_SHIPPED) - tops}"
    return sorted(p for p in found if p.split("/")[0] in tops - set(NOT_SHIPPED))


def package_files_read(files: list[str]) -> set[str]:
    """The files shipped modules read from their packages: every `package_file("<package>", "<name>")` with literals."""
    read = set()
    for f in shipped_modules(files):
        for node in ast.walk(ast.parse((ROOT / f).read_text(), filename=f)):
            called = getattr(node.func, "id", getattr(node.func, "attr", None)) if isinstance(node, ast.Call) else None
            if called == "package_file" and len(node.args) == 2 and all(isinstance(a, ast.Constant) for a in node.args):
                package, name = (a.value for a in node.args)
                read.add(f"{package.replace('.', '/')}/{name}")
    return read


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    for f in source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    build = ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(work / "dist"), str(src)]
    proc = subprocess.run([sys.executable, "-m", "pip", *build], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = (work / "dist").glob("trainyard-*.whl")
    with zipfile.ZipFile(built) as zf:
        yield zf


def test_the_wheel_holds_every_package_and_every_file_in_them(wheel: zipfile.ZipFile) -> None:
    files = source_files()
    packages = shipped_packages(files)
    assert {"assets", "resources", "instance", "pipelines", "trainyard", "training", "common", "featurestore",
            "resources/registry", "trainyard/data"} <= set(packages)
    names = set(wheel.namelist())
    assert [p for p in packages if f"{p}/__init__.py" not in names] == []
    # Every file in a package directory, modules and data alike: a data file left out of the wheel is
    # one the code cannot read once installed ([tool.setuptools.package-data] declares those).
    in_packages = [f for f in files if str(Path(f).parent) in packages]
    assert [f for f in in_packages if f not in names] == []
    assert not {n.split("/")[0] for n in names} & set(NOT_SHIPPED)


def test_the_wheel_holds_every_file_the_code_reads_from_its_packages(wheel: zipfile.ZipFile) -> None:
    read = package_files_read(source_files())
    assert {"training/serving_model.py", "training/preprocessing.py"} <= read
    assert sorted(read - set(wheel.namelist())) == []


_INSTALLED_PROBE = """
import json, sys
sys.path[:0] = [sys.argv[1]]
sys.path.append(sys.argv[2])  # the dependencies, without the .pth files that install the editable finder
import pipelines.catalog
from resources.registry.registration import PREPROCESSING_PATH, SERVING_MODEL_PATH
from resources.warm import training_root
from trainyard.data.feast import run_featurestore
from trainyard.lineage import code_version, lock_file
from trainyard.project import package_dir
proc = run_featurestore("retrieve", input="not json", timeout_s=300)
print(json.dumps({
    "modules": {m: sys.modules[m].__file__ for m in ("trainyard", "resources.warm", "pipelines.catalog", "training")},
    "featurestore": str(package_dir("featurestore")), "serving": str(SERVING_MODEL_PATH),
    "preprocessing": str(PREPROCESSING_PATH), "training_root": str(training_root()),
    "code_version": code_version(), "lock": str(lock_file()),
    "retrieve": [proc.returncode, proc.stdout], "stderr": proc.stderr[-2000:],
}))
"""


@pytest.mark.slow  # 18-45 s: the probe imports the registry (mlflow) and starts the Feast interpreter
def test_an_installed_wheel_finds_its_files_in_site_packages_and_the_deployment_in_the_project_dir(
    wheel: zipfile.ZipFile, tmp_path: Path,
) -> None:
    """The wheel unpacked into a venv-like folder inside a git checkout, imported from there (not the source tree)."""
    site = checkout(tmp_path / "checkout") / ".venv" / "site-packages"
    wheel.extractall(site)
    project = tmp_path / "deployment"
    project.mkdir()
    unset = ("PYTHONPATH", "TRAINYARD_CODE_VERSION", "TRAINYARD_LOCK_FILE")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(TRAINYARD_PROJECT_DIR=str(project), TRAINYARD_FEAST_PYTHON=str(ROOT / ".venv-feast" / "bin" / "python"))
    probe = [sys.executable, "-S", "-P", "-c", _INSTALLED_PROBE, str(site), sysconfig.get_paths()["purelib"]]
    proc = subprocess.run(probe, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(path.startswith(f"{site}/") for path in found["modules"].values()), found["modules"]
    assert found["featurestore"] == str(site / "featurestore")
    assert (found["serving"], found["preprocessing"]) == (str(site / "training" / "serving_model.py"),
                                                          str(site / "training" / "preprocessing.py"))
    assert found["training_root"] == str(site)
    # The checkout around the venv says nothing of the installed code; the lock is the deployment's.
    assert found["code_version"] == ["unknown", True]
    assert found["lock"] == str(project / "constraints.txt")
    # The Feast interpreter imported the wheel's featurestore (not the whole site-packages) and answered.
    code, answer = found["retrieve"]
    assert (code, json.loads(answer.strip().splitlines()[-1])["error"]["kind"]) == (2, "request"), found["stderr"]


def shipped_modules(files: list[str]) -> list[str]:
    packages = set(shipped_packages(files))
    return [f for f in files if f.endswith(".py") and str(Path(f).parent) in packages]


def file_uses(modules: list[str]) -> dict[tuple[str, str], int]:
    """Every read of `__file__` in `modules`: (module path, its line's text) -> line number."""
    uses = {}
    for f in modules:
        text = (ROOT / f).read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, filename=f)):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name == "__file__" or (isinstance(node, ast.Constant) and node.value == "__file__"):
                uses[(f, lines[node.lineno - 1].strip())] = node.lineno
    return uses


def test_no_shipped_module_finds_a_root_through_its_file() -> None:
    uses = file_uses(shipped_modules(source_files()))
    allowed = {use for use in uses if any(use[0] == path and snippet in use[1] for path, snippet in FILE_USES)}
    assert {f"{path}:{line}: {text}" for (path, text), line in uses.items() if (path, text) not in allowed} == set(), (
        "find a deployment's files under trainyard.project.project_dir() and a package's with "
        "trainyard.project.package_file/package_dir (docs/architecture-notes.md, 'Packaging')"
    )
    stale = [key for key in FILE_USES if not any(use[0] == key[0] and key[1] in use[1] for use in uses)]
    assert stale == [], "an allowed use is gone: take it off FILE_USES"


def test_the_scan_sees_every_way_of_reading_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        'import os\nROOT = os.path.dirname(__file__)\nx = getattr(os, "__file__")\nimport m\ny = m.__file__\n'
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sorted(file_uses(["pkg/a.py"]).values()) == [2, 3, 5]
