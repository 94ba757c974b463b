"""Pipeline discovery loads each code location's module and nothing else of a team folder."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from pipelines.catalog import all_pipelines, find_pipeline, location_modules

SPEC = """\
from trainyard import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec

{name} = PipelineSpec(
    team="{team}",
    name="{name}",
    source=SourceSpec(prefix="landing/{team}/{name}", pattern="*.csv"),
    columns={{"x": ColumnSpec(dtype="float"), "y": ColumnSpec(dtype="int", domain=[0, 1])}},
    target="y",
    model=ModelSpec(task="gbt", hparams={{"objective": "binary"}}),
)
"""


@pytest.fixture
def team_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A team package `catalogteam` whose folder also holds a helper script that rewrites a file on import."""
    package = tmp_path / "catalogteam"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "wine.py").write_text(SPEC.format(team="catalogteam", name="wine"))
    (package / "diabetes.py").write_text(SPEC.format(team="catalogteam", name="diabetes"))
    (package / "definitions.py").write_text(
        textwrap.dedent(
            """\
            from catalogteam import diabetes
            from catalogteam.wine import wine

            served = [wine, diabetes.diabetes]
            """
        )
    )
    # A helper of the kind a team keeps beside its specs: it declares a spec too, but
    # no code location serves it, and importing it has effects.
    (package / "make_landing.py").write_text(
        SPEC.format(team="catalogteam", name="scratch")
        + textwrap.dedent(
            f"""\
            from pathlib import Path

            print("helper ran")
            Path({str(tmp_path / "landing.csv")!r}).write_text("x,y\\n")
            """
        )
    )
    (tmp_path / "workspace.yaml").write_text(
        "load_from:\n  - python_module:\n      module_name: catalogteam.definitions\n      location_name: catalogteam\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m == "catalogteam" or m.startswith("catalogteam.")]:
        del sys.modules[name]


def test_discovery_never_runs_a_helper_module_of_a_team_folder(
    team_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = all_pipelines(team_folder / "workspace.yaml")

    assert sorted(specs) == ["catalogteam/diabetes", "catalogteam/wine"]
    assert not (team_folder / "landing.csv").exists()
    assert "helper ran" not in capsys.readouterr().out
    assert "catalogteam.make_landing" not in sys.modules


def test_find_pipeline_names_the_known_keys(team_folder: Path) -> None:
    assert find_pipeline("catalogteam/wine", team_folder / "workspace.yaml").name == "wine"
    with pytest.raises(KeyError, match=r"catalogteam/diabetes.*catalogteam/wine"):
        find_pipeline("catalogteam/scratch", team_folder / "workspace.yaml")


def test_the_project_workspace_serves_every_team_pipeline() -> None:
    assert location_modules()[:3] == [
        "pipelines.vision.definitions",
        "pipelines.tabular.definitions",
        "pipelines.language.definitions",
    ]
    assert {"vision/digits", "tabular/breast_cancer", "language/precedence"} <= set(all_pipelines())


def test_spec_only_team_locations_map_to_their_team_module(tmp_path: Path) -> None:
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(
        "load_from:\n"
        "  - python_module:\n      module_name: pipelines.locations\n      attribute: fraud\n      location_name: "
        "fraud\n"
        "  - python_module:\n      module_name: pipelines.vision.definitions\n      location_name: vision\n"
    )
    assert location_modules(workspace) == ["pipelines.fraud.team", "pipelines.vision.definitions"]
