"""The project directory (`TRAINYARD_PROJECT_DIR`, default: the current directory) and what is found in it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pipelines import catalog, cli
from pipelines.environments import trainyard_home
from trainyard import lineage
from trainyard.data import feast
from trainyard.project import PROJECT_DIR_ENV, package_dir, package_file, project_dir
from trainyard.spec import resolve_suite_path

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory that is not the checkout, with no project variables set."""
    for name in (PROJECT_DIR_ENV, "TRAINYARD_HOME", "TRAINYARD_LOCK_FILE", feast.PYTHON_ENV, "DAGSTER_HOME"):
        monkeypatch.delenv(name, raising=False)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    return here


def test_the_project_directory_is_the_variable_else_the_current_directory(elsewhere: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert project_dir() == elsewhere
    assert (trainyard_home(), lineage.lock_file(), resolve_suite_path("suites/s.json")) == (
        elsewhere / ".trainyard", elsewhere / "constraints.txt", str(elsewhere / "suites" / "s.json"))
    with pytest.raises(feast.FeastUnavailable, match=f"no Feast interpreter at {elsewhere}/.venv-feast/bin/python"):
        feast.feast_python()
    project = tmp_path / "project"
    monkeypatch.setenv(PROJECT_DIR_ENV, str(project))
    assert (project_dir(), trainyard_home(), lineage.lock_file()) == (
        project, project / ".trainyard", project / "constraints.txt")
    assert resolve_suite_path("/abs/s.json") == "/abs/s.json"
    # The variables of each file still win over the directory.
    monkeypatch.setenv("TRAINYARD_LOCK_FILE", "/etc/lock.txt")
    assert lineage.lock_file() == Path("/etc/lock.txt")
    assert project_dir({PROJECT_DIR_ENV: "/srv/p"}) == Path("/srv/p")


def test_the_workspace_is_the_project_directorys(elsewhere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = f"no workspace.yaml in {elsewhere}: run from the project directory or set {PROJECT_DIR_ENV} to it"
    with pytest.raises(FileNotFoundError, match=missing):
        catalog.location_modules()
    (elsewhere / "workspace.yaml").write_text("load_from:\n  - python_module: pipelines.vision.definitions\n")
    assert catalog.location_modules() == ["pipelines.vision.definitions"]
    monkeypatch.setenv(PROJECT_DIR_ENV, str(ROOT))
    assert "pipelines.commerce.definitions" in catalog.location_modules()


def test_init_copies_the_project_directorys_dagster_yaml(elsewhere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_HOME", str(elsewhere / "home"))
    with pytest.raises(FileNotFoundError, match=f"no {elsewhere}/deploy/local/dagster.yaml"):
        cli.ensure_dagster_home()
    monkeypatch.delenv("DAGSTER_HOME")  # set by the call above, as `trainyard` sets it for its own process
    (elsewhere / "deploy" / "local").mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / "local" / "dagster.yaml", elsewhere / "deploy" / "local" / "dagster.yaml")
    home = cli.ensure_dagster_home()
    assert home == elsewhere / "home" / "dagster"
    assert (home / "dagster.yaml").read_text() == (ROOT / "deploy" / "local" / "dagster.yaml").read_text()
    assert os.environ["DAGSTER_HOME"] == str(home)


def test_packages_and_their_files_are_where_the_import_system_finds_them() -> None:
    assert package_dir("featurestore") == ROOT / "featurestore"  # the editable install: the checkout
    assert package_file("training", "serving_model.py") == ROOT / "training" / "serving_model.py"
    with pytest.raises(ModuleNotFoundError, match="package 'no_such_package' is not installed"):
        package_dir("no_such_package")
    with pytest.raises(FileNotFoundError, match="training ships no file 'nope.yaml'"):
        package_file("training", "nope.yaml")
