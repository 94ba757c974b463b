"""`trainyard` command line: the demo and operational commands.

The Dagster UI and CLI stay the main way to work; these commands drive the
same definitions through real Dagster runs recorded in `DAGSTER_HOME`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

# Everything beyond the standard library is imported inside the commands:
# `trainyard --help` builds the whole parser, and the environments, Dagster and
# the data stack take seconds to import.


def ensure_dagster_home() -> Path:
    """Point `DAGSTER_HOME` at `<TRAINYARD_HOME>/dagster` and give it the project's `deploy/local/dagster.yaml`.

    Raises:
        FileNotFoundError: The project directory (`TRAINYARD_PROJECT_DIR`, default: here) has no such file.
    """
    from pipelines.environments import trainyard_home  # lazy: loads every resource
    from trainyard.project import project_dir
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(trainyard_home() / "dagster")))
    home.mkdir(parents=True, exist_ok=True)
    target = home / "dagster.yaml"
    if not target.exists():
        source = project_dir() / "deploy" / "local" / "dagster.yaml"
        if not source.is_file():
            raise FileNotFoundError(f"no {source}: run from the project directory or set TRAINYARD_PROJECT_DIR to it")
        shutil.copyfile(source, target)
    return home


def cmd_init(args: argparse.Namespace) -> int:
    """Create the homes and set each team's GPU pool limit (`TeamSpec.gpu_pool_limit`) on the instance."""
    from dagster import DagsterInstance  # lazy: Dagster

    from pipelines.catalog import workspace_teams  # lazy: loads the code locations
    from pipelines.team import apply_pool_limits

    home = ensure_dagster_home()
    with DagsterInstance.get() as instance:
        limits = apply_pool_limits(instance, workspace_teams())
    print(f"DAGSTER_HOME={home}")
    for pool, limit in sorted(limits.items()):
        print(f"pool {pool}: at most {limit} trial(s) at once")
    return 0


def write_digits_landing(store_root: Path) -> Path:
    """Write scikit-learn's bundled digits as the landing CSV (same bytes every time)."""
    from sklearn.datasets import load_digits  # lazy: scikit-learn

    landing = store_root / "landing" / "vision" / "digits"
    landing.mkdir(parents=True, exist_ok=True)
    path = landing / "digits.csv"
    frame = load_digits(as_frame=True).frame.rename(columns={"target": "label"})
    text = frame.to_csv(index=False)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def cmd_demo(args: argparse.Namespace) -> int:
    from pipelines.demo import run_demo  # lazy: Dagster and the code locations
    from pipelines.environments import trainyard_home  # lazy: loads every resource

    ensure_dagster_home()
    write_digits_landing(trainyard_home() / "store")
    return run_demo()


# Command groups living in their own modules; each defines `register(subparsers)`
# and sets `func` on its parsers, and like this module imports only the standard
# library at its top.
COMMAND_MODULES: tuple[str, ...] = (
    "pipelines.cli_registry",
    "pipelines.cli_repro",
    "pipelines.cli_data",
    "pipelines.cli_k8s",
)


def build_parser() -> argparse.ArgumentParser:
    """The `trainyard` parser with every command group's subcommands."""
    parser = argparse.ArgumentParser(
        prog="trainyard", description="trainyard: raw data to registered models, on Dagster"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the vision/digits pipeline end to end through Dagster")
    demo.set_defaults(func=cmd_demo)
    init = sub.add_parser("init", help="create TRAINYARD_HOME and DAGSTER_HOME and set each team's GPU pool limit")
    init.set_defaults(func=cmd_init)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Runs one `trainyard` command; returns its exit status."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
