"""Where the platform finds its files: the project directory (a deployment's) and its own packages (the code's).

Two kinds of location, never derived from each other and never from a module's
`__file__` (an installed wheel puts the packages in site-packages, away from
any checkout):

- **The project directory** holds what belongs to a deployment rather than to
  the code: `workspace.yaml` (the code locations), the dependency lock
  `constraints.txt`, the state folder `.trainyard` (`TRAINYARD_HOME`'s
  default), the Feast interpreter `.venv-feast`, `deploy/local/dagster.yaml`
  (what `trainyard init` copies into `DAGSTER_HOME`) and the suite files a
  `PipelineSpec(suite=...)` names by relative path. It is
  `TRAINYARD_PROJECT_DIR` when set, else the current directory: a checkout
  when you work in one (`make demo`, `make test` and `dagster dev` run from
  its root), `/opt/trainyard` in the orchestrator image, which sets the
  variable.
- **A package's directory** is where the import system finds it (`package_dir`,
  `package_file`): the checkout for the editable install, site-packages for a
  wheel. Files the code reads from its own packages (the serving pyfunc
  `training/serving_model.py`) are found this way, and ship in the wheel.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import sys
from pathlib import Path
from typing import Mapping, Optional

from common.settings import settings

PROJECT_DIR_ENV = "TRAINYARD_PROJECT_DIR"
"""The project directory (see the module docstring); default: the current directory."""


def project_dir(env: Optional[Mapping[str, str]] = None) -> Path:
    """`TRAINYARD_PROJECT_DIR` (`common.settings`) in `env` (default: this process's), else the current directory.

    Raises:
        common.settings.SettingsError: A `TRAINYARD_*` variable in `env` does not parse.
    """
    return (settings(env).project_dir or Path.cwd()).resolve()


def package_dir(package: str) -> Path:
    """The directory the import system loads the regular package `package` from, found without importing it.

    Raises:
        ModuleNotFoundError: `package` is not importable, or is not a directory on disk (a namespace
            package spread over several, a zip); the message says to reinstall.
    """
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if spec is None or spec.origin is None or len(locations) != 1:
        raise ModuleNotFoundError(
            f"package {package!r} is not installed as a directory of this interpreter ({sys.executable}); "
            "reinstall trainyard (`make install`, or `pip install .`)",
            name=package,
        )
    return Path(locations[0]).resolve()


def package_file(package: str, name: str) -> Path:
    """A file shipped in `package` (`importlib.resources`), as a path on disk for tools that need one.

    Raises:
        FileNotFoundError: The package holds no such file, or is not on disk (a zip).
    """
    resource = importlib.resources.files(package).joinpath(name)
    if not isinstance(resource, Path) or not resource.is_file():
        raise FileNotFoundError(f"{package} ships no file {name!r} on disk ({resource}); reinstall trainyard")
    return resource.resolve()
